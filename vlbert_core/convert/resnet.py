"""resnet101-pt-vgbua-0000.model (the authors' ResNet-101 of bottom-up attention, converted from Caffe)
-> a torchvision-layout ResNet state dict for `ResNetC4Config.init_weights` / the VL-BERT visual network.

The published file is a plain state dict with torchvision names (conv1, bn1, layer1-4; layer4 is the
stage-5 RoI head the released VL-BERT initialises from it). Its weights expect the MSRA/Caffe layout:
stride in the 1x1 conv and BGR 0-255 pixels minus the Caffe means, i.e. a backbone config of
RELEASED_RESNET101 below.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import torch

from vlbert_core.detector.resnet_c4 import build_resnet_c4

from .accounting import ConversionError, ConversionReport, Drop, Rule, convert_state_dict
from .manifest import read_published

# The backbone config the weights belong to (released cfgs: IMAGE_NUM_LAYERS 101, IMAGE_STRIDE_IN_1x1 true,
# PIXEL_MEANS 102.9801 115.9465 122.7717, PIXEL_STDS 1 1 1; IMAGE_C5_DILATED true for VL-BERT's RoI head).
RELEASED_RESNET101 = {"depth": 101, "block": "bottleneck", "stride_in_1x1": True, "head_dilation": 2,
                      "pixel_format": "bgr255_caffe"}
RESNET_FILE = "resnet101-pt-vgbua-0000.model"
BN_COUNTER = "num_batches_tracked"

TORCHVISION_RULES = [Rule(r"(conv1|bn1)\.(weight|bias|running_mean|running_var|num_batches_tracked)", r"\1.\2"),
                     Rule(r"(layer[1-4])\.(\d+\..+)", r"\1.\2")]
TORCHVISION_DROPS = [Drop(r"fc\..+", "the ImageNet classifier of a full ResNet; the C4 network ends at stage 5's pool")]


def resnet_layout(keys: list[str], prefix: str = "") -> dict:
    """The backbone config (ResNetC4Config dict) that torchvision-named `keys` (under `prefix`) describe:
    depth 101 when the block counts are ResNet-101's, else the explicit per-stage block counts (a cut-down
    stand-in of the same key structure)."""
    counts = []
    for stage in range(1, 5):
        blocks = {int(m.group(1)) for k in keys if (m := re.match(rf"{re.escape(prefix)}layer{stage}\.(\d+)\.", k))}
        if not blocks:
            raise ConversionError(f"no {prefix}layer{stage}.* tensors: not a ResNet state dict")
        counts.append(max(blocks) + 1)
    layout = {k: v for k, v in RELEASED_RESNET101.items() if k != "depth"}
    if counts == [3, 4, 23, 3]:
        return {**layout, "depth": 101}
    return {**layout, "stage_widths": [64, 128, 256, 512], "blocks_per_stage": counts}


def resnet_target_shapes(backbone: dict) -> dict[str, tuple[int, ...]]:
    """torchvision-layout keys (body's conv1 ... layer3, head's layer4) -> shapes, of `build_resnet_c4`."""
    with torch.device("meta"):
        body, head, _, _ = build_resnet_c4(backbone)
    shapes = {k: tuple(v.shape) for k, v in body.state_dict().items()}
    shapes.update({k: tuple(v.shape) for k, v in head.state_dict().items()})
    return shapes


def convert_resnet_state(source: dict[str, torch.Tensor], *, source_name: str) -> tuple[dict, ConversionReport, dict]:
    """(torchvision-layout state dict, report, backbone config) of a resnet101-pt-vgbua state dict."""
    backbone = resnet_layout(list(source))
    target = resnet_target_shapes(backbone)
    counters = {k: "BatchNorm step counter: not in the Caffe conversion, kept at 0 (the BatchNorm is frozen)"
                for k in target if k.endswith(BN_COUNTER) and k not in source}
    state, report = convert_state_dict(source, TORCHVISION_RULES, TORCHVISION_DROPS, target,
                                       source_name=source_name, fill=counters)
    for key in counters:
        state[key] = torch.zeros((), dtype=torch.long)
    return state, report, backbone


def convert_resnet101(in_path: str | os.PathLike, out_path: str | os.PathLike) -> tuple[ConversionReport, dict]:
    """Write `out_path` (torch.save of the state dict) and `<out_path>.conversion_report.json`; returns the
    report and the backbone config the weights belong to."""
    from vlbert_core.utils import atomic_path

    state, report, backbone = convert_resnet_state(read_published(in_path, ()), source_name=str(in_path))
    out_path = Path(out_path)
    with atomic_path(out_path) as tmp:
        torch.save(state, tmp)
    report.write(report_path(out_path))
    return report, backbone


def report_path(out_path: str | os.PathLike) -> Path:
    out_path = Path(out_path)
    return out_path.with_name(out_path.name + ".conversion_report.json")
