"""The bottom-up-attention detector (Anderson et al. 2018) -> our detector checkpoint.

Entry point (the `bottom-up` subcommand of `python -m vlbert_core.convert` calls it):

    convert_bottom_up(in_path, out_path, *, source=None, objects_vocab=None, attributes_vocab=None,
                      report_path=None) -> ConversionReport

  in_path           a published PyTorch conversion of the Caffe ResNet-101 C4 Faster R-CNN trained on
                    Visual Genome (1,600 object classes + background, 400 attributes + "no attribute"):
                    - `bua-caffe-frcn-r101_with_attributes.pth` (MILVLG/bottom-up-attention.pytorch,
                      renamed `bua-caffe-frcn-r101-k10-100.pth` there since 2021; the fix-36 variant
                      `..._fix36.pth` / `-k36.pth` has the same layout): source "bua-caffe";
                    - `faster_rcnn_from_caffe_attr.pkl` (airsplay/py-bottom-up-attention, a detectron2
                      pickle {"model": {name: numpy array}}; also `..._attr_original.pkl`): source
                      "detectron2-attr".
  out_path          our detector checkpoint (train.load_detector's format; `detector.weights`).
  source            "bua-caffe" | "detectron2-attr"; None: ".pkl" files are detectron2-attr, others
                    bua-caffe.
  objects_vocab     optional `objects_vocab.txt` (1,600 lines, the class names of the label order,
                    e.g. MILVLG's evaluation/objects_vocab.txt); without it classes are named by index.
  attributes_vocab  optional `attributes_vocab.txt` (400 lines), stored as the checkpoint's `attributes`.
  report_path       optional JSON: every source key mapped (to which target) or dropped (why), and
                    the target keys filled (why).

The file is read without running code from it (torch.load weights_only=True; pickles with the
restricted unpickler). Every source tensor must match a rule or a deliberate drop, every target tensor
must be produced, shapes must agree; otherwise ConversionError names the key. The architecture (stage
widths and block counts, RPN width, class and attribute counts) is read from the tensor shapes, so a
file of another depth or class count converts to the detector it describes.

The checkpoint's `config` holds the source's conventions (faster_rcnn.py; docs/bottom-up-detector.md):
Caffe max pool, stride in the 1x1 convs, stage 5 at stride 1 dilated by 2, BGR 0-255 minus the Caffe
means, 600/1000 px, ROIPooling 14x14 at 1/16, RPN 3x3 conv of 512, 12 anchors (sizes 64-512, ratios
0.5/1/2), NMS 0.7 in the RPN (6,000 -> 300 proposals at test time), 0.3 per class; for bua-caffe also
py-faster-rcnn's anchors and +1 box coding with raw (weight 1) deltas, for detectron2-attr detectron2's
anchors and coding with weights 10, 10, 5, 5.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Callable

import torch

from ..detector.faster_rcnn import RELEASED_ATTRIBUTE_LOSS_WEIGHT
from ..utils import atomic_path, get_logger
from .accounting import ConversionError, ConversionReport, Drop, Rule, convert_state_dict
from .manifest import read_published

log = get_logger(__name__)

SOURCES = ("bua-caffe", "detectron2-attr")
PUBLISHED_FILES = {
    "bua-caffe": ("bua-caffe-frcn-r101_with_attributes.pth", "bua-caffe-frcn-r101-k10-100.pth"),
    "detectron2-attr": ("faster_rcnn_from_caffe_attr.pkl", "faster_rcnn_from_caffe_attr_original.pkl"),
}
BN_PARTS = "weight|bias|running_mean|running_var"
RESNET101 = {"stem": 64, "planes": [64, 128, 256, 512], "blocks": [3, 4, 23, 3]}
# The anchors of both sources' configs: Caffe proposal layer scales (4, 8, 16, 32) x base 16, ratios
# 0.5, 1, 2 (test.prototxt); detectron2 ANCHOR_GENERATOR.SIZES [[64, 128, 256, 512]], default ratios.
ANCHOR_SIZES = [64, 128, 256, 512]
ASPECT_RATIOS = [0.5, 1.0, 2.0]


def detect_source(path: str | os.PathLike) -> str:
    return "detectron2-attr" if Path(path).suffix in (".pkl", ".pickle") else "bua-caffe"


def _read_source(path: Path) -> dict[str, torch.Tensor]:
    """The tensor dict: under "model" (detectron2 checkpoints) or at the top level (a bare state dict)."""
    try:
        return read_published(path, ("model",))
    except ValueError as wrapped_error:
        try:
            return read_published(path, ())
        except ValueError:
            raise wrapped_error from None


def _require(source: dict[str, torch.Tensor], key: str, path: Path) -> torch.Tensor:
    if key not in source:
        raise ConversionError(f"{path}: key {key!r} is missing; this is not a bottom-up-attention C4 detector")
    return source[key]


def _stage_layout(source: dict[str, torch.Tensor], prefix: str, path: Path) -> tuple[int, int]:
    """(planes, blocks) of the stage whose blocks are `prefix`.<i>."""
    pattern = re.compile(re.escape(prefix) + r"\.(\d+)\.")
    indices = {int(m.group(1)) for key in source if (m := pattern.match(key))}
    if not indices or indices != set(range(len(indices))):
        raise ConversionError(f"{path}: blocks {sorted(indices)} under {prefix!r}; expected 0..n-1")
    planes = _require(source, f"{prefix}.0.conv1.weight", path).shape[0]
    return int(planes), len(indices)


def infer_config(source: dict[str, torch.Tensor], kind: str, path: Path) -> tuple[dict[str, Any], int]:
    """The detector config section (faster_rcnn.build_detector keys) and the number of foreground
    classes described by a source state dict of kind `kind`."""
    stem = int(_require(source, "backbone.stem.conv1.weight", path).shape[0])
    layouts = [_stage_layout(source, f"backbone.res{s}", path) for s in (2, 3, 4)]
    layouts.append(_stage_layout(source, "roi_heads.res5", path))
    planes = [p for p, _ in layouts]
    blocks = [b for _, b in layouts]
    if stem == RESNET101["stem"] and planes == RESNET101["planes"] and blocks == RESNET101["blocks"]:
        backbone: dict[str, Any] = {"depth": 101, "block": "bottleneck"}
    else:
        if stem != planes[0]:
            raise ConversionError(f"{path}: stem width {stem} differs from stage-2 planes {planes[0]}; our C4 "
                                  "builder ties them (torchvision layout)")
        backbone = {"stage_widths": planes, "blocks_per_stage": blocks, "block": "bottleneck"}
    backbone.update(stride_in_1x1=True, head_dilation=2, pixel_format="bgr255_caffe", stem_pool="caffe")

    rpn_conv = _require(source, "proposal_generator.rpn_head.conv.weight", path)
    objectness = _require(source, "proposal_generator.rpn_head.objectness_logits.weight", path)
    num_anchors = objectness.shape[0] // (2 if kind == "bua-caffe" else 1)
    if num_anchors != len(ANCHOR_SIZES) * len(ASPECT_RATIOS):
        raise ConversionError(f"{path}: proposal_generator.rpn_head.objectness_logits.weight has "
                              f"{objectness.shape[0]} outputs, expected {len(ANCHOR_SIZES) * len(ASPECT_RATIOS)} "
                              f"anchors{' x 2 (background, foreground)' if kind == 'bua-caffe' else ''}")
    num_classes = int(_require(source, "roi_heads.box_predictor.cls_score.weight", path).shape[0]) - 1
    attr_key = {"bua-caffe": "roi_heads.box_predictor.attr_linear2.weight",
                "detectron2-attr": "roi_heads.box_predictor.attr_score.weight"}[kind]
    num_attributes = int(source[attr_key].shape[0]) - 1 if attr_key in source else None

    config: dict[str, Any] = {
        "backbone": backbone,
        "min_size": 600, "max_size": 1000,
        "anchor_sizes": list(ANCHOR_SIZES), "aspect_ratios": list(ASPECT_RATIOS),
        "rpn_head_channels": int(rpn_conv.shape[0]),
        "rpn_pre_nms_train": 12000, "rpn_post_nms_train": 2000,
        "rpn_pre_nms_test": 6000,
        "rpn_nms_thresh": 0.7,
        "roi_pooler": "roi_pool",
        "size_divisible": 1,
        "box_batch_size_per_image": 64,
        "box_nms_thresh": 0.3,
        "num_attributes": num_attributes,
    }
    if num_attributes is not None:
        # Both files hold the Caffe model's weights, trained with train.prototxt's loss_attr weight 0.5.
        config["attribute_loss_weight"] = RELEASED_ATTRIBUTE_LOSS_WEIGHT
    if kind == "bua-caffe":
        # test.prototxt + py-faster-rcnn config.py (TEST.RPN_POST_NMS_TOP_N 300, RPN_MIN_SIZE 16,
        # BBOX_NORMALIZE_TARGETS_PRECOMPUTED: the snapshot's bbox_pred predicts raw deltas).
        # test_net: every score (thresh -inf), at most 400 detections per image.
        config.update(anchor_style="caffe", box_coding="caffe_legacy", box_reg_weights=[1.0, 1.0, 1.0, 1.0],
                      rpn_post_nms_test=300, rpn_min_size=16, box_score_thresh=0.0, box_detections_per_img=400)
    else:
        # configs/VG-Detection/faster_rcnn_R_101_C4_attr_caffemaxpool.yaml over Base-RCNN-C4.yaml and
        # detectron2's defaults (POST_NMS_TOPK_TEST 1000, ROI_BOX_HEAD.BBOX_REG_WEIGHTS 10, 10, 5, 5).
        config.update(anchor_style="detectron2", box_coding="torchvision", box_reg_weights=[10.0, 10.0, 5.0, 5.0],
                      rpn_post_nms_test=1000, box_score_thresh=0.05, box_detections_per_img=100)
    return config, num_classes


def _objectness_fg_minus_bg(tensor: torch.Tensor) -> torch.Tensor:
    """Caffe's rpn_cls_score has 2A channels viewed as (2, A): background scores of the A anchors,
    then foreground. softmax([bg, fg])[fg] = sigmoid(fg - bg), so our one-logit sigmoid objectness
    takes fg - bg (weights and biases alike)."""
    num_anchors = tensor.shape[0] // 2
    return tensor[num_anchors:] - tensor[:num_anchors]


def _prepend_background_box(tensor: torch.Tensor) -> torch.Tensor:
    """detectron2's class-specific bbox_pred has no background rows; torchvision's predictor has 4 in
    front, which nothing reads (run_detector drops class 0's boxes): zeros."""
    return torch.cat([tensor.new_zeros((4,) + tuple(tensor.shape[1:])), tensor])


def conversion_rules(kind: str) -> tuple[list[Rule], list[Drop]]:
    """detectron2 key names (both sources are detectron2 modules) -> our detector's."""
    rules = [
        Rule(r"backbone\.stem\.conv1\.weight", "backbone.conv1.weight"),
        Rule(rf"backbone\.stem\.conv1\.norm\.({BN_PARTS})", r"backbone.bn1.\1"),
    ]
    for src_prefix, dst_prefix in [(r"backbone\.res2", "backbone.layer1"), (r"backbone\.res3", "backbone.layer2"),
                                   (r"backbone\.res4", "backbone.layer3"), (r"roi_heads\.res5", "roi_heads.box_head.layer4")]:
        rules += [
            Rule(rf"{src_prefix}\.(\d+)\.conv([123])\.weight", rf"{dst_prefix}.\1.conv\2.weight"),
            Rule(rf"{src_prefix}\.(\d+)\.conv([123])\.norm\.({BN_PARTS})", rf"{dst_prefix}.\1.bn\2.\3"),
            Rule(rf"{src_prefix}\.0\.shortcut\.weight", rf"{dst_prefix}.0.downsample.0.weight"),
            Rule(rf"{src_prefix}\.0\.shortcut\.norm\.({BN_PARTS})", rf"{dst_prefix}.0.downsample.1.\1"),
        ]
    objectness: Callable | None = _objectness_fg_minus_bg if kind == "bua-caffe" else None
    bbox_pred: Callable | None = None if kind == "bua-caffe" else _prepend_background_box
    rules += [
        Rule(r"proposal_generator\.rpn_head\.conv\.(weight|bias)", r"rpn.head.conv.0.0.\1"),
        Rule(r"proposal_generator\.rpn_head\.objectness_logits\.(weight|bias)", r"rpn.head.cls_logits.\1", objectness),
        Rule(r"proposal_generator\.rpn_head\.anchor_deltas\.(weight|bias)", r"rpn.head.bbox_pred.\1"),
        Rule(r"roi_heads\.box_predictor\.cls_score\.(weight|bias)", r"roi_heads.box_predictor.cls_score.\1"),
        Rule(r"roi_heads\.box_predictor\.bbox_pred\.(weight|bias)", r"roi_heads.box_predictor.bbox_pred.\1", bbox_pred),
    ]
    attribute_names = {"bua-caffe": ("cls_embed", "attr_linear1", "attr_linear2"),
                       "detectron2-attr": ("cls_embedding", "fc_attr", "attr_score")}[kind]
    for src, dst in zip(attribute_names, ("cls_embedding", "fc_attr", "attr_score")):
        rules.append(Rule(rf"roi_heads\.box_predictor\.{src}\.(weight|bias)", rf"roi_heads.attribute_predictor.{dst}.\1"))
    drops = [
        Drop(r".*\.num_batches_tracked", "BatchNorm's update counter: not a weight, and our BatchNorm layers start "
                                          "their own at 0"),
        Drop(r"proposal_generator\.anchor_generator\.cell_anchors\.\d+",
             "anchors are not weights: our generator computes the same cell anchors from the config (anchor_style)"),
    ]
    return rules, drops


def _categories(num_classes: int, objects_vocab: str | os.PathLike | None) -> list[dict[str, Any]]:
    if objects_vocab is None:
        return [{"id": i, "name": f"vg_class_{i}"} for i in range(1, num_classes + 1)]
    names = _read_vocab(objects_vocab, num_classes, "objects")
    return [{"id": i, "name": name} for i, name in enumerate(names, start=1)]


def _read_vocab(path: str | os.PathLike, expected: int, what: str) -> list[str]:
    lines = [line.strip() for line in Path(path).read_text().splitlines() if line.strip()]
    if len(lines) != expected:
        raise ConversionError(f"{path}: {len(lines)} {what} names, the weights have {expected}")
    return lines


def convert_bottom_up(in_path: str | os.PathLike, out_path: str | os.PathLike, *, source: str | None = None,
                      objects_vocab: str | os.PathLike | None = None,
                      attributes_vocab: str | os.PathLike | None = None,
                      report_path: str | os.PathLike | None = None) -> ConversionReport:
    """Convert a published bottom-up-attention detector to our checkpoint (see the module docstring)."""
    from ..detector.faster_rcnn import build_detector

    in_path, out_path = Path(in_path), Path(out_path)
    kind = source or detect_source(in_path)
    if kind not in SOURCES:
        raise ValueError(f"bottom-up source {kind!r}: expected one of {list(SOURCES)}")
    tensors = _read_source(in_path)
    config, num_classes = infer_config(tensors, kind, in_path)
    with torch.device("meta"):
        target = build_detector(config, num_classes).state_dict()
    target_shapes = {k: tuple(v.shape) for k, v in target.items()}
    counters = {k: "BatchNorm's update counter, not in the source: 0" for k in target if k.endswith("num_batches_tracked")}
    rules, drops = conversion_rules(kind)
    state_dict, report = convert_state_dict(tensors, rules, drops, target_shapes, source_name=str(in_path),
                                            fill=counters)
    for key in report.filled:
        state_dict[key] = torch.zeros((), dtype=torch.long)
    state_dict = {k: v.float() if v.is_floating_point() else v for k, v in state_dict.items()}
    checkpoint: dict[str, Any] = {
        "config": config,
        "categories": _categories(num_classes, objects_vocab),
        "num_classes": num_classes,
        "state_dict": {k: state_dict[k] for k in target},
        "converted_from": {"file": in_path.name, "source": kind,
                           "num_mapped": len(report.mapped), "num_dropped": len(report.dropped)},
    }
    if attributes_vocab is not None:
        if config["num_attributes"] is None:
            raise ConversionError(f"{in_path}: attributes_vocab given, but the weights have no attribute head")
        checkpoint["attributes"] = _read_vocab(attributes_vocab, config["num_attributes"], "attribute")
    with atomic_path(out_path) as tmp:
        torch.save(checkpoint, tmp)
    if report_path is not None:
        report.write(report_path)
    log.info("%s (%s) -> %s: %d tensors mapped, %d dropped, %d filled; %d classes, %s attributes",
             in_path, kind, out_path, len(report.mapped), len(report.dropped), len(report.filled),
             num_classes, config["num_attributes"])
    return report
