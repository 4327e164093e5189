"""The pixel values a backbone's weights expect, one place for the detector and the VL-BERT visual network.

Images enter the project as RGB floats in [0, 1]. A backbone's `pixel_format` (ResNetC4Config) says how
its weights were trained to see them:
- `rgb_imagenet`: RGB in [0, 1], minus the ImageNet mean, divided by the ImageNet std (torchvision's
  ResNets and the detector this project trains);
- `bgr255_caffe`: BGR in [0, 255] minus the Caffe means, std 1 (bottom-up attention's Caffe ResNet-101
  and the released VL-BERT: PIXEL_MEANS [102.9801, 115.9465, 122.7717], PIXEL_STDS [1, 1, 1], to_bgr255).
Zero in the normalised image is the mean colour in both, which is what masking a RoI writes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PixelFormat:
    bgr: bool                          # channel order the weights expect
    scale: float                       # [0, 1] pixels are multiplied by this first
    mean: tuple[float, float, float]   # in the weights' channel order, after scaling
    std: tuple[float, float, float]


PIXEL_FORMATS = {
    "rgb_imagenet": PixelFormat(bgr=False, scale=1.0, mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225)),
    "bgr255_caffe": PixelFormat(bgr=True, scale=255.0, mean=(102.9801, 115.9465, 122.7717), std=(1.0, 1.0, 1.0)),
}
DEFAULT_PIXEL_FORMAT = "rgb_imagenet"


def get_pixel_format(name: str) -> PixelFormat:
    try:
        return PIXEL_FORMATS[name]
    except KeyError:
        raise ValueError(f"unknown pixel_format {name!r}: expected one of {sorted(PIXEL_FORMATS)}") from None


def normalise_pixels(rgb01: torch.Tensor, pixel_format: str) -> torch.Tensor:
    """RGB in [0, 1], [..., 3, H, W] -> the network input of `pixel_format` (a new tensor)."""
    fmt = get_pixel_format(pixel_format)
    if rgb01.shape[-3] != 3:
        raise ValueError(f"normalise_pixels: expected 3 channels in dim -3, got shape {tuple(rgb01.shape)}")
    x = rgb01.flip(-3) if fmt.bgr else rgb01
    mean = torch.tensor(fmt.mean, dtype=x.dtype, device=x.device).view(3, 1, 1)
    std = torch.tensor(fmt.std, dtype=x.dtype, device=x.device).view(3, 1, 1)
    return (x * fmt.scale - mean) / std
