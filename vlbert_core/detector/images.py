"""Image files into the tensors the detector reads: decoded RGB uint8, then float in [0, 1]."""

from __future__ import annotations

import os

import numpy as np
import torch

from vlbert_core.images import DEFAULT_MAX_PIXELS, load_rgb


def decode_image(source: bytes | str | os.PathLike, *, max_pixels: int = DEFAULT_MAX_PIXELS,
                 name: str | None = None) -> torch.Tensor:
    """Decode JPEG/PNG bytes or a file into a [3, H, W] uint8 RGB tensor (fully decoded).

    An image over `max_pixels` (the config's max_image_pixels) raises `vlbert_core.images.ImageTooLarge`
    from its header, before it is decoded; one that does not decode (truncated, not an image) raises
    `ImageUnreadable`. Both name `name` (default: the path, or the byte count of bytes).
    """
    rgb = load_rgb(source, max_pixels=max_pixels, name=name)  # convert() decodes fully: truncation shows here
    # HWC -> CHW in numpy: a torch op on a tensor this small runs on torch's thread pool, whose
    # synchronisation costs more than the copy itself on a busy machine (benchmarks/rois.py).
    return torch.from_numpy(np.asarray(rgb, dtype=np.uint8).transpose(2, 0, 1).copy())  # copy: C order, writable


def to_unit_float(image: torch.Tensor) -> torch.Tensor:
    """[3, H, W] uint8 -> float32 in [0, 1] (the detector's input), computed in numpy for the same
    reason as in decode_image; the values equal image.float() / 255."""
    return torch.from_numpy(np.divide(image.numpy(), np.float32(255.0), dtype=np.float32))
