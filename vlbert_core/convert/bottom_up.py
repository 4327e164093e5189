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

import math
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
BUA_CELL_ANCHORS = "proposal_generator.anchor_generator.cell_anchors.0"


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
    embed_key = {"bua-caffe": "roi_heads.box_predictor.cls_embed.weight",
                 "detectron2-attr": "roi_heads.box_predictor.cls_embedding.weight"}[kind]
    head_out = int(_require(source, "roi_heads.box_predictor.cls_score.weight", path).shape[1])
    attribute_dims = {}
    if num_attributes is not None and embed_key in source:
        embed_dim, hidden_dim = int(source[embed_key].shape[1]), int(source[attr_key].shape[1])
        if (embed_dim, hidden_dim) != (head_out // 8, head_out // 4):   # MILVLG's fixed 256 / 512 on a narrow model
            attribute_dims = {"attribute_embed_dim": embed_dim, "attribute_hidden_dim": hidden_dim}

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
        **attribute_dims,
    }
    if num_attributes is not None:
        # Both files hold the Caffe model's weights, trained with train.prototxt's loss_attr weight 0.5.
        config["attribute_loss_weight"] = RELEASED_ATTRIBUTE_LOSS_WEIGHT
    if kind == "bua-caffe":
        # MILVLG configs/caffe/test-caffe-r101.yaml:25-36 (RPN PRE_NMS_TOPK_TEST 6000, POST_NMS_TOPK_TEST 300,
        # MIN_SIZE 16 at :9, NMS_THRESH_TEST 0.3, SCORE_THRESH_TEST -1), :40 BBOX_REG_WEIGHTS (1, 1, 1, 1),
        # TEST.DETECTIONS_PER_IMAGE 400 (:46); the same values as the original's py-faster-rcnn config.py
        # (TEST.RPN_POST_NMS_TOP_N 300, RPN_MIN_SIZE 16, TEST.NMS 0.3). The image: utils/extract_utils.py:30-52
        # (py-faster-rcnn's _get_image_blob): BGR float minus the means, cv2.resize INTER_LINEAR by
        # s = 600 / short side, or 1000 / long side when round(s * long) > 1000; boxes back by / s.
        config.update(anchor_style="caffe", box_coding="caffe_legacy", box_reg_weights=[1.0, 1.0, 1.0, 1.0],
                      rpn_post_nms_test=300, rpn_min_size=16, box_score_thresh=0.0, box_detections_per_img=400,
                      resize="cv2_float")
    else:
        # configs/VG-Detection/faster_rcnn_R_101_C4_attr_caffemaxpool.yaml over Base-RCNN-C4.yaml and
        # detectron2's defaults (ROI_BOX_HEAD.BBOX_REG_WEIGHTS 10, 10, 5, 5; RPN NMS_THRESH 0.7). Base-RCNN-C4
        # keeps POST_NMS_TOPK_TEST 1000, but every extraction script of the port sets 300
        # (demo/detectron2_mscoco_proposal_maxnms.py:244, demo_feature_extraction_attr.ipynb cell 3), as the
        # Caffe original (py-faster-rcnn TEST.RPN_POST_NMS_TOP_N 300) whose features VL-BERT and ViLBERT used:
        # 300. Their detection thresholds: NMS_THRESH_TEST 0.6, SCORE_THRESH_TEST 0.2 (maxnms.py:245-246, the
        # attribute demo cell 3). The image: ResizeShortestEdge (data/transforms/transform_gen.py:200-210, sides
        # int(side * s + 0.5)) with PIL bilinear on the uint8 image (transform.py:79-83).
        config.update(anchor_style="detectron2", box_coding="torchvision", box_reg_weights=[10.0, 10.0, 5.0, 5.0],
                      rpn_post_nms_test=300, box_nms_thresh=0.6, box_score_thresh=0.2, box_detections_per_img=100,
                      resize="pil_uint8")
    return config, num_classes


# The RoI rule of the features VL-BERT used (bottom-up-attention tools/generate_tsv.py; MILVLG
# bua/caffe/config.py:29-31 MIN_BOXES 10, MAX_BOXES 100, CONF_THRESH 0.2, and utils/extract_utils.py:62-75:
# NMS 0.3 per class over the proposals, a proposal's score its best surviving class score, kept >= 0.2,
# 10..100 by score): the `rois:` section that reproduces it (detector.select.select_rois_bottom_up).
RELEASED_ROIS = {"rule": "bottom_up", "min_boxes": 10, "max_boxes": 100, "score_threshold": 0.2, "nms_iou": 0.3}


def _objectness_fg_minus_bg(tensor: torch.Tensor) -> torch.Tensor:
    """Caffe's rpn_cls_score has 2A channels viewed as (2, A): background scores of the A anchors,
    then foreground. softmax([bg, fg])[fg] = sigmoid(fg - bg), so our one-logit sigmoid objectness
    takes fg - bg (weights and biases alike)."""
    num_anchors = tensor.shape[0] // 2
    return tensor[num_anchors:] - tensor[:num_anchors]


def _prepend_background_box(tensor: torch.Tensor) -> torch.Tensor:
    """detectron2's class-specific bbox_pred has no background rows (airsplay fast_rcnn.py:339-341: K * 4
    outputs, row block k = class k); torchvision's predictor has 4 in front, which nothing reads
    (run_detector drops class 0's boxes): zeros."""
    return torch.cat([tensor.new_zeros((4,) + tuple(tensor.shape[1:])), tensor])


def _background_last_to_first(tensor: torch.Tensor) -> torch.Tensor:
    """airsplay's detectron2 puts background LAST: cls_score has K + 1 rows with background at K
    (fast_rcnn.py:31-32 'gt_classes in [0, K], K = background', :90 `scores[:, :-1]`), its attribute
    head embeds the arg-max over all K + 1 (:366-367, so embedding row K is background's) and its
    attr_score has 'no attribute' last (the demos read `pred_attr_logits[..., :-1]`). Ours have
    background / no attribute at 0 (select.py, extract.py, AttributePredictor): the last row moves to
    the front, the others keep their order (their class k is our k + 1)."""
    return torch.cat([tensor[-1:], tensor[:-1]])


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
    # MILVLG keeps Caffe's order, background / no attribute at 0 (bua/caffe/modeling/fast_rcnn.py:142
    # `scores[:, 1:]`, utils/extract_utils.py:77-81 `[:, 1:]` for objects and attributes; NUM_CLASSES 1601 and
    # bbox_pred with background rows, fast_rcnn.py:245-247): as they are.
    background: Callable | None = None if kind == "bua-caffe" else _background_last_to_first
    rules += [
        Rule(r"proposal_generator\.rpn_head\.conv\.(weight|bias)", r"rpn.head.conv.0.0.\1"),
        Rule(r"proposal_generator\.rpn_head\.objectness_logits\.(weight|bias)", r"rpn.head.cls_logits.\1", objectness),
        Rule(r"proposal_generator\.rpn_head\.anchor_deltas\.(weight|bias)", r"rpn.head.bbox_pred.\1"),
        Rule(r"roi_heads\.box_predictor\.cls_score\.(weight|bias)", r"roi_heads.box_predictor.cls_score.\1",
             background),
        Rule(r"roi_heads\.box_predictor\.bbox_pred\.(weight|bias)", r"roi_heads.box_predictor.bbox_pred.\1", bbox_pred),
    ]
    attribute_names = {"bua-caffe": ("cls_embed", "attr_linear1", "attr_linear2"),
                       "detectron2-attr": ("cls_embedding", "fc_attr", "attr_score")}[kind]
    for src, dst in zip(attribute_names, ("cls_embedding", "fc_attr", "attr_score")):
        rules.append(Rule(rf"roi_heads\.box_predictor\.{src}\.(weight|bias)", rf"roi_heads.attribute_predictor.{dst}.\1",
                          None if dst == "fc_attr" else background))
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
    check_cell_anchors(tensors, config, in_path)
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


CELL_ANCHORS_KEY = re.compile(r"proposal_generator\.anchor_generator\.cell_anchors\.\d+")


def check_cell_anchors(tensors: dict[str, torch.Tensor], config: dict[str, Any], in_path: Path) -> None:
    """A file that stores its cell anchors (MILVLG's DefaultAnchorGenerator reads them from the checkpoint)
    must hold the ones our generator computes from the converted config, in the same order: the RPN head's
    channel a scores anchor a, so another order pairs every objectness and delta channel with the wrong box.
    The buffer is then dropped (conversion_rules)."""
    from ..detector.faster_rcnn import build_anchor_generator

    stored = {k: v for k, v in tensors.items() if CELL_ANCHORS_KEY.fullmatch(k)}
    if not stored:
        return
    ours = build_anchor_generator(config).cell_anchors[0].double()
    if len(stored) != 1:
        raise ConversionError(f"{in_path}: {len(stored)} cell-anchor buffers ({', '.join(sorted(stored))}); our RPN "
                              "reads one feature map")
    (key, theirs), = stored.items()
    theirs = theirs.double()
    if tuple(theirs.shape) != tuple(ours.shape):
        raise ConversionError(f"{in_path}: {key} is {tuple(theirs.shape)}, but the config's anchors "
                              f"(anchor_style {config.get('anchor_style')}) are {tuple(ours.shape)}")
    difference = float((theirs - ours).abs().max())
    if difference > 1e-3:
        raise ConversionError(f"{in_path}: {key} differs from the anchors our generator computes "
                              f"(anchor_style {config.get('anchor_style')}, sizes {config.get('anchor_sizes')}, ratios "
                              f"{config.get('aspect_ratios')}) by up to {difference:.4g} px: the file's RPN was "
                              "trained on other anchors or another order")


# ---- the published layouts at any size, with reproducible random values (golden tests, convert.verify) ----

def released_layout(kind: str, *, stem: int = 64, planes=(64, 128, 256, 512), blocks=(3, 4, 23, 3),
                    rpn_hidden: int = 512, num_anchors: int = 12, num_classes: int = 1600, num_attributes: int = 400,
                    embed_dim: int | None = None, hidden_dim: int | None = None) -> dict[str, tuple[int, ...]]:
    """Key -> shape of a published file of `kind` (defaults: the published ResNet-101, 535 keys): the
    detectron2 modules both ports are (norm inside each conv, res5 in the RoI head), the RPN head (Caffe:
    2A objectness channels, detectron2: A), the box predictor (bua-caffe's bbox_pred with background rows,
    detectron2's without) and the attribute head (embedding and fc widths: head width / 8 and / 4 unless given;
    MILVLG's code fixes 256 and 512)."""
    shapes: dict[str, tuple[int, ...]] = {}

    def conv(name, out_ch, in_ch, k):
        shapes[f"{name}.weight"] = (out_ch, in_ch, k, k)
        for part in BN_PARTS.split("|"):
            shapes[f"{name}.norm.{part}"] = (out_ch,)

    conv("backbone.stem.conv1", stem, 3, 7)
    in_ch = stem
    for prefix, width, count in zip(("backbone.res2", "backbone.res3", "backbone.res4", "roi_heads.res5"), planes, blocks):
        out_ch = width * 4
        for i in range(count):
            if i == 0:
                conv(f"{prefix}.0.shortcut", out_ch, in_ch, 1)
            conv(f"{prefix}.{i}.conv1", width, in_ch if i == 0 else out_ch, 1)
            conv(f"{prefix}.{i}.conv2", width, width, 3)
            conv(f"{prefix}.{i}.conv3", out_ch, width, 1)
        in_ch = out_ch
    body_out, head_out = planes[2] * 4, planes[3] * 4
    embed_dim = head_out // 8 if embed_dim is None else embed_dim
    hidden_dim = head_out // 4 if hidden_dim is None else hidden_dim
    caffe = kind == "bua-caffe"
    rpn = "proposal_generator.rpn_head"
    objectness = num_anchors * (2 if caffe else 1)
    shapes.update({
        f"{rpn}.conv.weight": (rpn_hidden, body_out, 3, 3), f"{rpn}.conv.bias": (rpn_hidden,),
        f"{rpn}.objectness_logits.weight": (objectness, rpn_hidden, 1, 1), f"{rpn}.objectness_logits.bias": (objectness,),
        f"{rpn}.anchor_deltas.weight": (num_anchors * 4, rpn_hidden, 1, 1), f"{rpn}.anchor_deltas.bias": (num_anchors * 4,),
    })
    box_outputs = (num_classes + 1) * 4 if caffe else num_classes * 4
    pred = "roi_heads.box_predictor"
    embed, fc, score = ("cls_embed", "attr_linear1", "attr_linear2") if caffe else ("cls_embedding", "fc_attr", "attr_score")
    shapes.update({
        f"{pred}.cls_score.weight": (num_classes + 1, head_out), f"{pred}.cls_score.bias": (num_classes + 1,),
        f"{pred}.bbox_pred.weight": (box_outputs, head_out), f"{pred}.bbox_pred.bias": (box_outputs,),
        f"{pred}.{embed}.weight": (num_classes + 1, embed_dim),
        f"{pred}.{fc}.weight": (hidden_dim, head_out + embed_dim), f"{pred}.{fc}.bias": (hidden_dim,),
        f"{pred}.{score}.weight": (num_attributes + 1, hidden_dim), f"{pred}.{score}.bias": (num_attributes + 1,),
    })
    return shapes


def random_released_weights(shapes: dict[str, tuple[int, ...]], seed: int, *, logit_gain: float = 2.0,
                            objectness_gain: float = 2.0) -> dict[str, torch.Tensor]:
    """Trained-like random float32 values for a released layout, reproducible from `seed`: one
    torch.Generator(seed), keys in sorted order, each drawn as torch.randn(shape) (running_var and norm
    weights as torch.rand(shape)) and then scaled: convs He (sqrt(2 / fan_in)), norm weights 0.75..1.25
    (0.1..0.4 on the last conv of a block and on shortcuts, so 33 residual blocks stay finite; the stem's
    He scale / 64 for the 0..255 pixels), biases and
    means 0.1, variances 0.5..1, RPN deltas and box deltas 0.01 / sqrt(fan_in), objectness `objectness_gain` / sqrt(fan_in),
    class and attribute logits `logit_gain` / sqrt(fan_in) (so a few classes pass the 0.2 threshold)."""
    generator = torch.Generator().manual_seed(int(seed))
    out: dict[str, torch.Tensor] = {}
    for key in sorted(shapes):
        shape = shapes[key]
        uniform = key.endswith(("running_var", "norm.weight"))
        draw = torch.rand(shape, generator=generator) if uniform else torch.randn(shape, generator=generator)
        fan_in = math.prod(shape[1:]) if len(shape) > 1 else 1
        if key.endswith("norm.weight"):
            value = draw * 0.3 + 0.1 if (".conv3." in key or ".shortcut." in key) else draw * 0.5 + 0.75
        elif key.endswith("running_var"):
            value = draw * 0.5 + 0.5
        elif key.endswith(("norm.bias", "running_mean")):
            value = draw * 0.1
        elif "anchor_deltas" in key or "bbox_pred" in key:
            value = draw * (0.01 if key.endswith("bias") else 0.01 / math.sqrt(fan_in))
        elif "objectness_logits" in key:
            # MILVLG ranks proposals by the fp32 softmax probability, which ties at 1.0 from a logit difference
            # of ~17 on: its golden file draws objectness_gain 0.2
            value = draw * (0.1 if key.endswith("bias") else objectness_gain / math.sqrt(fan_in))
        elif any(name in key for name in ("cls_score", "attr_score", "attr_linear2")):
            value = draw * (0.1 if key.endswith("bias") else logit_gain / math.sqrt(fan_in))
        elif "cls_embed" in key:
            value = draw
        elif key.endswith("bias"):
            value = draw * 0.01
        elif key == "backbone.stem.conv1.weight":
            value = draw * math.sqrt(2.0 / fan_in) / 64.0   # Caffe pixels are 0..255 minus the means
        else:
            value = draw * math.sqrt(2.0 / fan_in)
        out[key] = value.float().contiguous()
    return out


def write_released_file(kind: str, tensors: dict[str, torch.Tensor], path: str | os.PathLike) -> Path:
    """Write `tensors` as the published file of `kind` is stored and as the port's checkpointer reads it:
    detectron2-attr a pickle {"model": {name: numpy array}, "__author__": ...} (airsplay
    detectron2/checkpoint/detection_checkpoint.py `_load_file`), bua-caffe torch.save({"model": state dict})."""
    import pickle

    from ..detector.faster_rcnn import caffe_cell_anchors

    path = Path(path)
    if kind == "bua-caffe" and BUA_CELL_ANCHORS not in tensors:
        # MILVLG's DefaultAnchorGenerator is built from SIZES [[4, 8, 16, 32]] (test-caffe-r101.yaml:6) and reads
        # its cell anchors from the checkpoint's buffer: without it every anchor is 4-32 px and no proposal
        # survives RPN_MIN_SIZE 16. The file carries py-faster-rcnn's generate_anchors (scales 4-32 x base 16).
        tensors = {**tensors, BUA_CELL_ANCHORS: caffe_cell_anchors(ASPECT_RATIOS, [s / 16 for s in ANCHOR_SIZES])}
    if kind == "detectron2-attr":
        with open(path, "wb") as f:
            pickle.dump({"model": {k: v.numpy() for k, v in tensors.items()}, "__author__": "vlbert_core"}, f)
    else:
        torch.save({"model": dict(tensors)}, path)
    return path


# ---- per-stage comparison with a port's own run (convert.verify's bottom-up layouts) ----------------------

# Per image i, the reference NPZ holds img<i>/<precision>/<stage> (precision fp32, and fp64 for the port's own
# rounding) in the port's order of classes: input, res4, proposals, pooled, features, class_logits,
# box_deltas, class_scores, attribute_logits (airsplay) or attribute_scores (MILVLG), and the kept RoIs:
# kept_ids (proposal rows), kept_boxes (original pixels), kept_classes (0-based foreground), kept_scores.
REFERENCE_STAGES = ("input", "res4", "proposals", "pooled", "features", "class_logits", "box_deltas", "class_scores")
# The selection each port's extraction path applies (their scripts; docs/bottom-up-detector.md).
PORT_SELECTION = {
    # airsplay demo_feature_extraction_attr.ipynb: fast_rcnn_inference_single_image, score 0.2, NMS 0.6, at most
    # 100 (our select_rois on the regressed per-class boxes, the same rule above 10)
    "detectron2-attr": {"rule": "per_class", "score_threshold": 0.2, "min_boxes": 10, "max_boxes": 100,
                        "nms_iou": 0.6},
    "bua-caffe": RELEASED_ROIS,
}


def _nan_max(a: float, b: float) -> float:
    """max of two numbers where nan means "not measured"."""
    return b if math.isnan(a) else a if math.isnan(b) else max(a, b)


def match_kept_rois(our_boxes, our_classes, their_boxes, their_classes, atol: float = 1e-2):
    """For each RoI the port kept, the row of ours with the same class and a box within `atol` px; None when
    the two are not the same set (a count, class or box differs). Kept RoIs are matched by box, not by
    proposal row: proposals whose objectness ties to fp32 rounding swap rows from one CPU's kernels to
    another's."""
    import numpy as np

    our_boxes, their_boxes = np.asarray(our_boxes).reshape(-1, 4), np.asarray(their_boxes).reshape(-1, 4)
    our_classes, their_classes = np.asarray(our_classes), np.asarray(their_classes)
    if len(our_boxes) != len(their_boxes):
        return None
    rows = []
    for box, cls in zip(their_boxes, their_classes):
        same = np.flatnonzero((our_classes == cls) & (np.abs(our_boxes - box).max(axis=1, initial=0) <= atol))
        if len(same) != 1:
            return None
        rows.append(int(same[0]))
    return np.array(rows, dtype=np.int64) if sorted(rows) == list(range(len(our_boxes))) else None


def compare_with_port(checkpoint: str | os.PathLike, kind: str, reference: str | os.PathLike,
                      images: list[str | os.PathLike], *, config_override: dict[str, Any] | None = None,
                      workdir: str | os.PathLike | None = None) -> dict[str, Any]:
    """Convert `checkpoint` (a file of `kind`'s layout), run our detector on `images` and compare every stage
    with the port's run in `reference` (REFERENCE_STAGES). Returns {"stages": [{stage, abs, rel, port_abs,
    port_rel}], "kept": [lines], "same_kept_boxes": bool}; rel = abs / max |port fp64| (or fp32)."""
    import tempfile

    import numpy as np

    from ..detector.extract import detector_stages
    from ..detector.images import decode_image, to_unit_float
    from ..detector.select import select_rois, select_rois_bottom_up
    from ..detector.train import load_detector

    d2 = kind == "detectron2-attr"
    ref = np.load(reference)
    with tempfile.TemporaryDirectory(dir=workdir) as tmp:
        converted = Path(tmp) / "detector.pt"
        convert_bottom_up(checkpoint, converted, source=kind)
        saved = torch.load(converted, weights_only=False)
        for key, value in (config_override or {}).items():
            if isinstance(value, dict):
                saved["config"].setdefault(key, {}).update(value)
            else:
                saved["config"][key] = value
        torch.save(saved, converted)
        model, _ = load_detector(converted)

    def ours_order(array):
        return np.concatenate([array[:, -1:], array[:, :-1]], axis=1) if d2 else array

    worst: dict[str, list[float]] = {}

    def record(stage, ours, theirs, theirs64):
        ours, theirs = np.asarray(ours, np.float64), np.asarray(theirs, np.float64)
        if ours.shape != theirs.shape:
            raise ConversionError(f"{stage}: ours {ours.shape}, the port's {theirs.shape}")
        reference64 = theirs if theirs64 is None else np.asarray(theirs64, np.float64)
        scale = max(float(np.abs(reference64).max()) if reference64.size else 0.0, 1e-30)
        # nan: the reference has no float64 run of this stage (the kept RoIs), not an agreement
        port = float(np.abs(theirs - reference64).max()) if theirs64 is not None and theirs.size else float("nan")
        err = float(np.abs(ours - theirs).max()) if theirs.size else 0.0
        row = worst.setdefault(stage, [0.0, 0.0, float("nan"), float("nan")])
        row[:] = [max(row[0], err), max(row[1], err / scale), _nan_max(row[2], port), _nan_max(row[3], port / scale)]

    kept_lines, same_all = [], True
    threads = torch.get_num_threads()
    torch.set_num_threads(1)   # the reference runs' split of the sums: another one reorders near-tied proposals
    try:
        per_image = [{k: v.double().numpy() for k, v in detector_stages(model, [to_unit_float(decode_image(p))])[0].items()}
                     for p in images]
    finally:
        torch.set_num_threads(threads)
    for i, path in enumerate(images):
        def get(name, precision="fp32"):
            key = f"img{i}/{precision}/{name}"
            return ref[key] if key in ref else None
        stages = per_image[i]
        # per-proposal stages on the rows whose proposal is the same box for us and the port (fp32 and fp64)
        same_row = np.abs(stages["proposals"] - get("proposals")).max(axis=1) < 1e-2
        if get("proposals", "fp64") is not None:
            same_row &= np.abs(get("proposals", "fp64") - get("proposals")).max(axis=1) < 1e-2
        kept_lines.append(f"{Path(path).name}: {int((~same_row).sum())} of {len(same_row)} proposals differ "
                          "(near-tied RPN scores); the per-proposal stages compare the others")
        for name in REFERENCE_STAGES:
            theirs = get(name)
            if theirs is None:
                continue
            ours = stages[name]
            if name not in ("input", "res4"):
                ours, theirs = ours[same_row], theirs[same_row]
                theirs64 = None if get(name, "fp64") is None else get(name, "fp64")[same_row]
                if name in ("class_logits", "class_scores"):
                    theirs, theirs64 = ours_order(theirs), None if theirs64 is None else ours_order(theirs64)
                if name == "box_deltas" and d2:
                    ours = ours[:, 4:]
                record(name, ours, theirs, theirs64)
                continue
            if name == "box_deltas" and d2:
                ours = ours[:, 4:]    # the 4 zero background rows in front
            if name in ("class_logits", "class_scores"):
                theirs, theirs64 = ours_order(theirs), None if get(name, "fp64") is None else ours_order(get(name, "fp64"))
            else:
                theirs64 = get(name, "fp64")
            record(name, ours, theirs, theirs64)
        attr = "attribute_logits" if d2 else "attribute_scores"
        if get(attr) is not None:
            theirs, theirs64 = get(attr)[same_row], None if get(attr, "fp64") is None else get(attr, "fp64")[same_row]
            record(attr, stages[attr][same_row], ours_order(theirs) if d2 else theirs,
                   None if theirs64 is None else (ours_order(theirs64) if d2 else theirs64))
        scores = torch.from_numpy(stages["class_scores"]).float()
        rule = {k: v for k, v in PORT_SELECTION[kind].items() if k != "rule"}
        if PORT_SELECTION[kind]["rule"] == "per_class":
            selected = select_rois(torch.from_numpy(stages["boxes_per_class"]).float(), scores, **rule)
        else:
            selected = select_rois_bottom_up(torch.from_numpy(stages["proposals_original"]).float(), scores, **rule)
        ours_ids, their_ids = selected.proposals.numpy(), get("kept_ids")
        if their_ids is None:
            continue
        order = match_kept_rois(selected.boxes.numpy(), selected.class_ids.numpy() - 1, get("kept_boxes"),
                                get("kept_classes"))
        same = order is not None
        # the port's MILVLG path keeps proposal order; airsplay's and ours sort by score
        in_order = same and (not d2 or bool((np.diff(order) > 0).all()))
        same_all &= same
        kept_lines.append(f"{Path(path).name}: {len(ours_ids)} kept, the port {len(their_ids)}; same boxes and "
                          f"classes: {same}" + (f", same order: {in_order}" if d2 and same else ""))
        if same:
            record("kept_boxes", selected.boxes.numpy()[order], get("kept_boxes"), None)
            record("kept_scores", selected.scores.numpy()[order], get("kept_scores"), None)
            record("kept_features", stages["features"][ours_ids[order]], get("features")[their_ids],
                   None if get("features", "fp64") is None else get("features", "fp64")[their_ids])
    rows = [{"stage": k, "abs": v[0], "rel": v[1], "port_abs": v[2], "port_rel": v[3]} for k, v in worst.items()]
    return {"stages": rows, "kept": kept_lines, "same_kept_boxes": same_all}
