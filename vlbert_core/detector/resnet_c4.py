"""ResNet-C4 split into a stride-16 body (stem + stages 2-4) and a per-RoI head (stage 5 + pool).

The same builder serves the Faster R-CNN detector and the VL-BERT visual network, so the module
names are fixed and identical for the small embedded-world ResNet and the torchvision ResNets:

    body: conv1, bn1, relu, maxpool, layer1, layer2, layer3        (torchvision names)
    head: layer4, avgpool, flatten

Inside the detector (`build_detector`) the body is `model.backbone` and the head is
`model.roi_heads.box_head`; `visual_state_dict` strips those prefixes (see DETECTOR_BODY_PREFIX and
DETECTOR_HEAD_PREFIX) so that `body.load_state_dict(...)` / `head.load_state_dict(...)` work on a
fresh `build_resnet_c4` pair built with the same config.

BatchNorm is plain `nn.BatchNorm2d`: the detector trains it, and the VL-BERT side freezes it by
putting the modules in eval mode and turning off their gradients. A BatchNorm in eval mode is a fixed affine
map per channel, so the blocks and the stem fold it into the convolution before it (`conv_bn`): one
convolution with a bias, its per-channel scale on the weights or on the output (whichever is smaller), instead of
a convolution and a BatchNorm pass over its output, forward and backward. The weights and their names stay
torchvision's.

Two options reproduce the MSRA / Caffe ResNets of bottom-up attention and the released VL-BERT; neither
changes a tensor's shape, so the same weights load either way:
- `stride_in_1x1`: the stride of a stage's first bottleneck sits in its 1x1 conv (MSRA, Caffe), not in
  the 3x3 (torchvision, "ResNet v1.5").
- `head_dilation` 2: stage 5 keeps stride 1 and dilates its 3x3 convs by 2 (released VL-BERT,
  IMAGE_C5_DILATED), so a 14x14 RoI stays 14x14 until the average pool; 1 is the detector head of
  bottom-up attention and torchvision (stride 2, 14x14 -> 7x7).
- `stem_pool` "caffe": the stem's 3x3 max pool without padding and with ceil rounding, as Caffe pools
  (bottom-up attention's `pool1`); "torchvision" pads by 1 and floors. Same output size on even inputs,
  but the windows sit one pixel apart, so Caffe-trained weights need the Caffe pool.
The pixels a backbone's weights expect are part of its config too (`pixel_format`, pixels.py).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import torch
import torch.nn.functional as F
from torch import nn
from torchvision.models import resnet as tv_resnet

from .pixels import PIXEL_FORMATS
from ..safe_pickle import load_torch_file

# Key prefixes of the body and head inside the detector's state dict (see faster_rcnn.py).
DETECTOR_BODY_PREFIX = "backbone."
DETECTOR_HEAD_PREFIX = "roi_heads.box_head."

# How each RoI is cut out of the body's map for the head, in the detector and in VL-BERT's visual network
# (which must pool as the detector did, so that its stage-5 head sees the features it was trained on).
FEATURE_STRIDE = 16      # the body's stride (conv1, pool1, stages 3 and 4 halve the map)
ROI_OUTPUT_SIZE = 14     # RoIAlign output side; stage 5 halves it to 7 (or keeps 14 when dilated)
ROI_SAMPLING_RATIO = 2   # bilinear samples per bin side (released VL-BERT's ROIAlign: 1)
# torchvision's MultiScaleRoIAlign uses the legacy aligned=False convention, as did the released
# VL-BERT's maskrcnn-benchmark ROIAlign.
ROI_ALIGNED = False


def conv_bn(conv: nn.Conv2d, bn: nn.BatchNorm2d, x: torch.Tensor) -> torch.Tensor:
    """bn(conv(x)). In eval mode the BatchNorm is y = scale * x + shift per channel, so it is folded into the
    convolution: shift as the bias, and the scale on whichever side is smaller, the weights or the output (per
    output channel). The same function of x and of the weights to fp32 rounding, and gradients reach conv.weight
    (and bn.weight / bn.bias where they train) through the fold. A BatchNorm in training mode (the detector's)
    normalises by batch statistics and runs as it is."""
    if bn.training or bn.running_var is None or bn.weight is None or conv.padding_mode != "zeros":
        return bn(conv(x))
    scale = bn.weight * torch.rsqrt(bn.running_var + bn.eps)
    shift = bn.bias - bn.running_mean * scale
    if conv.bias is not None:
        shift = shift + conv.bias * scale
    if not isinstance(conv.padding, str) and output_positions(conv, x) < conv.weight[0].numel():
        # Few output positions (small images, few RoIs: stage 4 of a 112 x 80 image has 35): scaling the weights
        # would cost a weight-sized product and its gradient each step, and keep the scaled copy for the
        # backward, where the output's product costs less and the convolution keeps the weight itself.
        out = F.conv2d(x, conv.weight, None, conv.stride, conv.padding, conv.dilation, conv.groups)
        # In the convolution's dtype: under autocast (bf16) the fp32 scale would otherwise promote the output.
        return torch.addcmul(shift.reshape(-1, 1, 1).to(out.dtype), out, scale.reshape(-1, 1, 1).to(out.dtype))
    return F.conv2d(x, conv.weight * scale.reshape(-1, 1, 1, 1), shift, conv.stride, conv.padding, conv.dilation,
                    conv.groups)


def output_positions(conv: nn.Conv2d, x: torch.Tensor) -> int:
    """Images x output height x output width of conv on x [N, C, H, W]: its output's size per channel (numeric
    padding; conv_bn keeps "same" / "valid" on the weights' side)."""
    positions = x.shape[0]
    for size, kernel, stride, padding, dilation in zip(x.shape[-2:], conv.kernel_size, conv.stride, conv.padding,
                                                       conv.dilation):
        positions *= (size + 2 * padding - dilation * (kernel - 1) - 1) // stride + 1
    return positions


def add_shortcut(block: tv_resnet.Bottleneck | tv_resnet.BasicBlock, out: torch.Tensor,
                 x: torch.Tensor) -> torch.Tensor:
    """relu(out + the block's shortcut of x): x itself, or its downsample with that BatchNorm folded too."""
    out += x if block.downsample is None else conv_bn(block.downsample[0], block.downsample[1], x)
    return block.relu(out)


class Bottleneck(tv_resnet.Bottleneck):
    """torchvision's bottleneck (same modules, weights and names), its BatchNorms folded by conv_bn."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(conv_bn(self.conv1, self.bn1, x))
        out = self.relu(conv_bn(self.conv2, self.bn2, out))
        return add_shortcut(self, conv_bn(self.conv3, self.bn3, out), x)


class BasicBlock(tv_resnet.BasicBlock):
    """torchvision's basic block (same modules, weights and names), its BatchNorms folded by conv_bn."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(conv_bn(self.conv1, self.bn1, x))
        return add_shortcut(self, conv_bn(self.conv2, self.bn2, out), x)


class ResNetC4Body(nn.Sequential):
    """conv1, bn1, relu, maxpool, layer1, layer2, layer3 in order (torchvision names), bn1 folded into conv1."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(conv_bn(self.conv1, self.bn1, x)))
        return self.layer3(self.layer2(self.layer1(x)))


# torchvision's block and stage depths of each standard ResNet (torchvision.models.resnet18, ...)
_TORCHVISION_DEPTHS = {18: (BasicBlock, [2, 2, 2, 2]), 34: (BasicBlock, [3, 4, 6, 3]), 50: (Bottleneck, [3, 4, 6, 3]),
                       101: (Bottleneck, [3, 4, 23, 3]), 152: (Bottleneck, [3, 8, 36, 3])}
_BLOCKS = {"basic": BasicBlock, "bottleneck": Bottleneck}
# The stem's max pool: torchvision pads by 1; Caffe pads by 0 and rounds the output size up.
STEM_POOLS = {"torchvision": dict(kernel_size=3, stride=2, padding=1),
              "caffe": dict(kernel_size=3, stride=2, padding=0, ceil_mode=True)}


@dataclass
class ResNetC4Config:
    """Either a torchvision `depth` (18/34/50/101/152, standard widths) or explicit small widths.

    stage_widths / blocks_per_stage: planes and block count of stages 2, 3, 4, 5 (the stem has
    stage_widths[0] channels, as in torchvision where both are 64). `init_weights`: optional local
    path to a torchvision-format ResNet state dict (ImageNet weights) loaded into body and head;
    nothing is ever downloaded. `stride_in_1x1`, `head_dilation`: see the module docstring.
    `pixel_format`: the input normalisation the weights were trained with (pixels.PIXEL_FORMATS).
    """

    stage_widths: list[int] = field(default_factory=lambda: [16, 32, 64, 128])
    blocks_per_stage: list[int] = field(default_factory=lambda: [2, 2, 2, 2])
    block: str = "basic"
    depth: int | None = None
    init_weights: str | None = None
    stride_in_1x1: bool = False
    head_dilation: int = 1
    pixel_format: str = "rgb_imagenet"
    stem_pool: str = "torchvision"

    @classmethod
    def from_dict(cls, cfg: Mapping[str, Any] | "ResNetC4Config") -> "ResNetC4Config":
        if isinstance(cfg, ResNetC4Config):
            return cfg
        known = {"stage_widths", "blocks_per_stage", "block", "depth", "init_weights", "stride_in_1x1",
                 "head_dilation", "pixel_format", "stem_pool"}
        unknown = set(cfg) - known
        if unknown:
            raise ValueError(f"detector.backbone: unknown keys {sorted(unknown)}; allowed {sorted(known)}")
        out = cls(**{k: (list(v) if isinstance(v, (list, tuple)) else v) for k, v in cfg.items()})
        out.validate()
        return out

    def validate(self) -> None:
        if self.head_dilation not in (1, 2):
            raise ValueError(f"detector.backbone.head_dilation={self.head_dilation}: expected 1 (stride-2 stage 5) "
                             "or 2 (stride 1, dilation 2)")
        if self.pixel_format not in PIXEL_FORMATS:
            raise ValueError(f"detector.backbone.pixel_format={self.pixel_format!r}: expected one of "
                             f"{sorted(PIXEL_FORMATS)}")
        if self.stem_pool not in STEM_POOLS:
            raise ValueError(f"detector.backbone.stem_pool={self.stem_pool!r}: expected one of {sorted(STEM_POOLS)}")
        if self.stride_in_1x1 and self.uses_basic_blocks:
            raise ValueError("detector.backbone.stride_in_1x1 needs bottleneck blocks (ResNet-50/101/152 or "
                             "block: bottleneck): a basic block has no 1x1 conv")
        if self.depth is not None:
            if self.depth not in _TORCHVISION_DEPTHS:
                raise ValueError(f"detector.backbone.depth={self.depth}: expected one of {sorted(_TORCHVISION_DEPTHS)}")
            return
        if self.block not in _BLOCKS:
            raise ValueError(f"detector.backbone.block={self.block!r}: expected 'basic' or 'bottleneck'")
        if len(self.stage_widths) != 4 or len(self.blocks_per_stage) != 4:
            raise ValueError(
                "detector.backbone: stage_widths and blocks_per_stage need 4 entries (stages 2-5), got "
                f"{self.stage_widths} and {self.blocks_per_stage}"
            )
        if min(self.stage_widths) < 1 or min(self.blocks_per_stage) < 1:
            raise ValueError(f"detector.backbone: widths and block counts must be >= 1, got {self}")

    @property
    def uses_basic_blocks(self) -> bool:
        if self.depth is not None:
            return self.depth in (18, 34)
        return self.block == "basic"

    def to_dict(self) -> dict[str, Any]:
        return {"stage_widths": list(self.stage_widths), "blocks_per_stage": list(self.blocks_per_stage),
                "block": self.block, "depth": self.depth, "init_weights": self.init_weights,
                "stride_in_1x1": self.stride_in_1x1, "head_dilation": self.head_dilation,
                "pixel_format": self.pixel_format, "stem_pool": self.stem_pool}


def _make_stage(block: type[nn.Module], inplanes: int, planes: int, blocks: int, stride: int) -> tuple[nn.Sequential, int]:
    """torchvision's ResNet._make_layer, without its hard-coded widths."""
    out_planes = planes * block.expansion
    downsample = None
    if stride != 1 or inplanes != out_planes:
        downsample = nn.Sequential(
            nn.Conv2d(inplanes, out_planes, kernel_size=1, stride=stride, bias=False),
            nn.BatchNorm2d(out_planes),
        )
    layers = [block(inplanes, planes, stride, downsample)]
    layers += [block(out_planes, planes) for _ in range(1, blocks)]
    return nn.Sequential(*layers), out_planes


def _move_stride_to_1x1(stage: nn.Sequential) -> None:
    """MSRA / Caffe bottlenecks: the first block strides in its 1x1 conv instead of its 3x3."""
    first = stage[0]
    if not isinstance(first, tv_resnet.Bottleneck):
        raise ValueError("stride_in_1x1 applies to bottleneck blocks only")
    first.conv1.stride, first.conv2.stride = first.conv2.stride, (1, 1)


def _dilate_head(stage: nn.Sequential, dilation: int) -> None:
    """Stage 5 at stride 1 with its 3x3 convs dilated (padding = dilation keeps the map size), as the
    released VL-BERT's RoI head. Shapes of all weights are unchanged."""
    for block in stage:
        block.stride = 1
        if block.downsample is not None:
            block.downsample[0].stride = (1, 1)
        block.conv1.stride = (1, 1)
        # Bottleneck: the 3x3 is conv2; BasicBlock: the released code dilates its first 3x3 only.
        conv3x3 = block.conv2 if isinstance(block, tv_resnet.Bottleneck) else block.conv1
        conv3x3.stride = (1, 1)
        conv3x3.dilation = (dilation, dilation)
        conv3x3.padding = (dilation, dilation)


def _init_weights(modules: list[nn.Module]) -> None:
    # Same scheme as torchvision's ResNet, so small and standard backbones start alike.
    for module in modules:
        for m in module.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.constant_(m.weight, 1)
                nn.init.constant_(m.bias, 0)


def build_resnet_c4(cfg: Mapping[str, Any] | ResNetC4Config) -> tuple[nn.Sequential, nn.Sequential, int, int]:
    """Return (body, head, body_out_channels, head_out_channels).

    body maps an image batch [B, 3, H, W] (normalised as cfg.pixel_format says) to the stride-16
    stage-4 map [B, body_out, H/16, W/16]; head maps RoI features [R, body_out, S, S] (S = 14 after
    RoI pooling) through stage 5 (stride 2, or stride 1 dilated with head_dilation 2) and global
    average pooling to [R, head_out].
    """
    cfg = ResNetC4Config.from_dict(cfg)
    if cfg.depth is not None:
        net = tv_resnet.ResNet(*_TORCHVISION_DEPTHS[cfg.depth])   # as torchvision.models.resnet101(weights=None)
        stem = [("conv1", net.conv1), ("bn1", net.bn1), ("relu", net.relu), ("maxpool", net.maxpool)]
        stages = [net.layer1, net.layer2, net.layer3, net.layer4]
        body_out = _stage_out_channels(net.layer3)
        head_out = _stage_out_channels(net.layer4)
    else:
        block = _BLOCKS[cfg.block]
        stem_width = cfg.stage_widths[0]
        stem = [
            ("conv1", nn.Conv2d(3, stem_width, kernel_size=7, stride=2, padding=3, bias=False)),
            ("bn1", nn.BatchNorm2d(stem_width)),
            ("relu", nn.ReLU(inplace=True)),
            ("maxpool", nn.MaxPool2d(kernel_size=3, stride=2, padding=1)),
        ]
        stages = []
        inplanes = stem_width
        for i, (planes, blocks) in enumerate(zip(cfg.stage_widths, cfg.blocks_per_stage)):
            stage, inplanes = _make_stage(block, inplanes, planes, blocks, stride=1 if i == 0 else 2)
            stages.append(stage)
            if i == 2:
                body_out = inplanes
        head_out = inplanes
        _init_weights([m for _, m in stem] + stages)

    stem = [(name, nn.MaxPool2d(**STEM_POOLS[cfg.stem_pool]) if name == "maxpool" else module)
            for name, module in stem]
    if cfg.stride_in_1x1:
        for stage in stages[1:]:
            _move_stride_to_1x1(stage)
    if cfg.head_dilation != 1:
        _dilate_head(stages[3], cfg.head_dilation)

    body = ResNetC4Body(OrderedDict(stem + [("layer1", stages[0]), ("layer2", stages[1]), ("layer3", stages[2])]))
    head = nn.Sequential(OrderedDict([("layer4", stages[3]), ("avgpool", nn.AdaptiveAvgPool2d(1)),
                                      ("flatten", nn.Flatten(1))]))
    if cfg.init_weights:
        load_torchvision_resnet_weights(body, head, cfg.init_weights)
    return body, head, body_out, head_out


def _stage_out_channels(stage: nn.Sequential) -> int:
    last = stage[-1]
    final_bn = last.bn3 if hasattr(last, "bn3") else last.bn2
    return final_bn.num_features


def load_torchvision_resnet_weights(body: nn.Module, head: nn.Module, path: str | Path) -> None:
    """Load a torchvision-format ResNet state dict (conv1.*, bn1.*, layer1-4.*; fc.* ignored)."""
    state = load_torch_file(path, "a ResNet state dict")
    if isinstance(state, dict) and "state_dict" in state:
        state = state["state_dict"]
    body_sd = {k: v for k, v in state.items() if not k.startswith(("layer4.", "fc."))}
    head_sd = {k: v for k, v in state.items() if k.startswith("layer4.")}
    missing_body, unexpected_body = body.load_state_dict(body_sd, strict=False)
    missing_head, unexpected_head = head.load_state_dict(head_sd, strict=False)
    if missing_body or unexpected_body or missing_head or unexpected_head:
        raise ValueError(
            f"{path}: ResNet weights do not fit the configured backbone: missing "
            f"{sorted(missing_body + missing_head)[:8]}, unexpected {sorted(unexpected_body + unexpected_head)[:8]}"
        )


def visual_state_dict(detector_state_dict: Mapping[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    """Split a detector state dict into {"body": ..., "head": ...} for `build_resnet_c4` modules."""
    body = {k[len(DETECTOR_BODY_PREFIX):]: v for k, v in detector_state_dict.items() if k.startswith(DETECTOR_BODY_PREFIX)}
    head = {k[len(DETECTOR_HEAD_PREFIX):]: v for k, v in detector_state_dict.items() if k.startswith(DETECTOR_HEAD_PREFIX)}
    if not body or not head:
        raise ValueError(
            f"detector state dict has no '{DETECTOR_BODY_PREFIX}*' or '{DETECTOR_HEAD_PREFIX}*' entries "
            f"(found {len(body)} body and {len(head)} head keys)"
        )
    return {"body": body, "head": head}
