"""The R-C4 Faster R-CNN: ResNet stages 1-4 as backbone, RoI pooling 14x14 at stride 16, stage 5 as head.

By default the detector follows torchvision's conventions (this project trains it that way). Options of
the `detector:` config section reproduce the Caffe Faster R-CNN of bottom-up attention (Anderson et al.
2018) so that its published weights, converted by `vlbert_core.convert.bottom_up`, detect as they did
there (docs/bottom-up-detector.md lists each convention and where the source has it):

  anchor_style       torchvision (default): torchvision's AnchorGenerator (zero-centred, rounded cell
                     anchors, stride inferred from the padded batch). caffe: py-faster-rcnn's
                     `generate_anchors` (base window (0, 0, 15, 15), ratios then scales, rounded widths,
                     scales = anchor_sizes / 16) at a fixed stride of 16. detectron2: detectron2's
                     DefaultAnchorGenerator (sizes outer, ratios inner, zero-centred, not rounded) at a
                     fixed stride of 16.
  box_coding         torchvision (default) | caffe_legacy: widths = x2 - x1 + 1 in box encoding and
                     decoding, boxes clipped to [0, W - 1] x [0, H - 1], proposals filtered by a
                     minimum side in original-image pixels (rpn_min_size) before the pre-NMS top-n,
                     and IoU with +1 areas in the NMS of the RPN and of the RoI selection.
  box_reg_weights    the RoI head's delta weights (default 10, 10, 5, 5; the Caffe weights predict
                     raw deltas: 1, 1, 1, 1).
  rpn_head_channels  width of the RPN's 3x3 conv (default: the body's width; Caffe: 512).
  rpn_nms_thresh, rpn_min_size
                     the RPN's NMS IoU (default 0.7) and minimum proposal side (default 0: torchvision's
                     1e-3 px; caffe_legacy only: 16 px of the original image).
  roi_pooler         roi_align (default: RoIAlign, sampling ratio 2) | roi_pool (Caffe's ROIPooling,
                     torchvision.ops.RoIPool at 1/16); output 14x14 either way.
  size_divisible     the transform pads a batch to a multiple of this (default 32; Caffe: 1, no padding
                     beyond the largest image of the batch).
  resize             torchvision (default: GeneralizedRCNNTransform's bilinear on the normalised float image,
                     sides floor(side * s)) | pil_uint8 (detectron2's ResizeShortestEdge: PIL bilinear on the
                     uint8 image, sides int(side * s + 0.5); airsplay's port) | cv2_float (py-faster-rcnn's
                     _get_image_blob: cv2.resize INTER_LINEAR on the float image minus the means, scale
                     min_size / short side unless round(s * long side) > max_size, sides rounded, and boxes
                     mapped back by 1 / s; the Caffe original and MILVLG's port).
  num_attributes     optional: adds the bottom-up attribute head (AttributePredictor, in
                     AttributeRoIHeads) with num_attributes + 1 outputs ("no attribute" at 0).
  attribute_loss_weight
                     the weight of its training loss (default 0: not trained; Caffe: 0.5).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torchvision.models.detection import FasterRCNN
from torchvision.models.detection._utils import BoxCoder
from torchvision.models.detection.anchor_utils import AnchorGenerator
from torchvision.models.detection.faster_rcnn import FastRCNNPredictor
from torchvision.models.detection.image_list import ImageList
from torchvision.models.detection.roi_heads import RoIHeads, fastrcnn_loss
from torchvision.models.detection.rpn import RegionProposalNetwork, RPNHead
from torchvision.models.detection.transform import GeneralizedRCNNTransform
from torchvision.ops import MultiScaleRoIAlign, RoIPool, batched_nms, clip_boxes_to_image, remove_small_boxes
from torchvision.ops.misc import Conv2dNormActivation

from vlbert_core.typed_settings import read_fields

from .pixels import get_pixel_format, normalise_pixels
from .resnet_c4 import FEATURE_STRIDE, ROI_OUTPUT_SIZE, ROI_SAMPLING_RATIO, ResNetC4Config, build_resnet_c4

# Anchor sizes that cover objects from ~1/8 to the whole of a 128-px image; real configs with
# 600-px images set `detector.anchor_sizes` (e.g. [32, 64, 128, 256, 512]).
DEFAULT_ANCHOR_SIZES = (16, 32, 64, 128)
DEFAULT_ASPECT_RATIOS = (0.5, 1.0, 2.0)
CAFFE_ANCHOR_BASE_SIZE = 16     # py-faster-rcnn's reference window (0, 0, 15, 15)

ANCHOR_STYLES = ("torchvision", "caffe", "detectron2")
BOX_CODINGS = ("torchvision", "caffe_legacy")
ROI_POOLERS = ("roi_align", "roi_pool")
RESIZES = ("torchvision", "pil_uint8", "cv2_float")


# ---- anchors ----------------------------------------------------------------------------------------

def caffe_cell_anchors(ratios: Sequence[float], scales: Sequence[float],
                       base_size: int = CAFFE_ANCHOR_BASE_SIZE) -> Tensor:
    """py-faster-rcnn's `generate_anchors`: the reference window (0, 0, base-1, base-1) reshaped to each
    aspect ratio (h / w) at constant area, widths and heights rounded, then each of those scaled by
    each scale; corners are inclusive (width = x2 - x1 + 1). Order: ratio outer, scale inner.
    Returns [len(ratios) * len(scales), 4] float32."""
    base = np.array([0.0, 0.0, base_size - 1.0, base_size - 1.0])

    def whctrs(anchor):
        w, h = anchor[2] - anchor[0] + 1, anchor[3] - anchor[1] + 1
        return w, h, anchor[0] + 0.5 * (w - 1), anchor[1] + 0.5 * (h - 1)

    def mkanchors(ws, hs, x_ctr, y_ctr):
        return np.stack([x_ctr - 0.5 * (ws - 1), y_ctr - 0.5 * (hs - 1),
                         x_ctr + 0.5 * (ws - 1), y_ctr + 0.5 * (hs - 1)], axis=1)

    w, h, x_ctr, y_ctr = whctrs(base)
    ratios = np.asarray(ratios, dtype=np.float64)
    ws = np.round(np.sqrt(w * h / ratios))
    hs = np.round(ws * ratios)
    ratio_anchors = mkanchors(ws, hs, x_ctr, y_ctr)
    out = []
    for anchor in ratio_anchors:
        w, h, x_ctr, y_ctr = whctrs(anchor)
        scales_arr = np.asarray(scales, dtype=np.float64)
        out.append(mkanchors(w * scales_arr, h * scales_arr, x_ctr, y_ctr))
    return torch.from_numpy(np.concatenate(out)).float()


def detectron2_cell_anchors(sizes: Sequence[float], ratios: Sequence[float]) -> Tensor:
    """detectron2's DefaultAnchorGenerator cell anchors: for each size (outer) and ratio h / w (inner)
    a box of area size**2 centred on 0, not rounded. [len(sizes) * len(ratios), 4] float32."""
    out = []
    for size in sizes:
        for ratio in ratios:
            w = math.sqrt(size * size / ratio)
            h = ratio * w
            out.append([-w / 2.0, -h / 2.0, w / 2.0, h / 2.0])
    return torch.tensor(out, dtype=torch.float32)


class FixedStrideAnchorGenerator(AnchorGenerator):
    """torchvision's AnchorGenerator with given cell anchors, shifted by a fixed feature stride (as
    Caffe's proposal layer and detectron2 do) rather than the stride inferred from the padded batch,
    which is not 16 when no padding rounds the image size to a multiple of 16."""

    def __init__(self, cell_anchors: Tensor, sizes: Sequence[int], aspect_ratios: Sequence[float], stride: int):
        super().__init__(sizes=(tuple(sizes),), aspect_ratios=(tuple(aspect_ratios),))
        if cell_anchors.shape != (len(sizes) * len(aspect_ratios), 4):
            raise ValueError(f"FixedStrideAnchorGenerator: {tuple(cell_anchors.shape)} cell anchors for "
                             f"{len(sizes)} sizes x {len(aspect_ratios)} ratios")
        self.cell_anchors = [cell_anchors]
        self.stride = int(stride)

    def forward(self, image_list: ImageList, feature_maps: list[Tensor]) -> list[Tensor]:
        grid_sizes = [list(feature_map.shape[-2:]) for feature_map in feature_maps]
        dtype, device = feature_maps[0].dtype, feature_maps[0].device
        stride = torch.tensor(self.stride, dtype=torch.int64, device=device)
        self.set_cell_anchors(dtype, device)
        per_map = self.grid_anchors(grid_sizes, [[stride, stride]] * len(grid_sizes))
        return [torch.cat(per_map) for _ in image_list.image_sizes]


@dataclass(frozen=True)
class DetectorSettings:
    """The numbers of the `detector:` config section (and of a detector checkpoint's saved config) that
    build_detector reads, typed once: a missing key or a value of the wrong kind names the key. The
    conventions (anchor_style, box_coding, roi_pooler, the backbone) are checked where they are used."""

    min_size: int
    max_size: int
    rpn_post_nms_train: int
    rpn_post_nms_test: int
    box_batch_size_per_image: int
    rpn_pre_nms_train: int | None = None      # default max(2000, rpn_post_nms_train)
    rpn_pre_nms_test: int | None = None       # default max(1000, rpn_post_nms_test)
    rpn_nms_thresh: float = 0.7
    rpn_head_channels: int | None = None      # None: torchvision's RPNHead at the body's width
    rpn_min_size: float | None = None         # box_coding caffe_legacy only
    box_score_thresh: float = 0.05
    box_nms_thresh: float = 0.5
    box_detections_per_img: int = 100
    box_reg_weights: tuple[float, ...] = (10.0, 10.0, 5.0, 5.0)
    anchor_sizes: tuple[int, ...] = DEFAULT_ANCHOR_SIZES
    aspect_ratios: tuple[float, ...] = DEFAULT_ASPECT_RATIOS
    num_attributes: int | None = None
    attribute_loss_weight: float = 0.0
    size_divisible: int = 32
    resize: str = "torchvision"

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any], where: str = "detector") -> "DetectorSettings":
        return cls(**read_fields(cls, cfg, where))


def build_anchor_generator(cfg: Mapping[str, Any]) -> AnchorGenerator:
    style = cfg.get("anchor_style", "torchvision")
    settings = DetectorSettings.from_config(cfg)
    sizes, ratios = settings.anchor_sizes, settings.aspect_ratios
    if style == "torchvision":
        return AnchorGenerator(sizes=(sizes,), aspect_ratios=(ratios,))
    if style == "caffe":
        cell = caffe_cell_anchors(ratios, [s / CAFFE_ANCHOR_BASE_SIZE for s in sizes])
    elif style == "detectron2":
        cell = detectron2_cell_anchors(sizes, ratios)
    else:
        raise ValueError(f"detector.anchor_style={style!r}: expected one of {list(ANCHOR_STYLES)}")
    return FixedStrideAnchorGenerator(cell, sizes, ratios, FEATURE_STRIDE)


# ---- legacy (+1) box coding ----------------------------------------------------------------------------

class LegacyBoxCoder(BoxCoder):
    """py-faster-rcnn's bbox_transform / bbox_transform_inv: a box's width is x2 - x1 + 1 and its centre
    x1 + 0.5 * width; a decoded box is centre -/+ 0.5 * width (so x2 is not reduced by 1 again, as in
    the source). dw, dh are clamped at log(1000 / 16) as torchvision and the PyTorch ports do."""

    def encode_single(self, reference_boxes: Tensor, proposals: Tensor) -> Tensor:
        wx, wy, ww, wh = (float(w) for w in self.weights)
        widths = proposals[:, 2] - proposals[:, 0] + 1.0
        heights = proposals[:, 3] - proposals[:, 1] + 1.0
        ctr_x = proposals[:, 0] + 0.5 * widths
        ctr_y = proposals[:, 1] + 0.5 * heights
        gt_widths = reference_boxes[:, 2] - reference_boxes[:, 0] + 1.0
        gt_heights = reference_boxes[:, 3] - reference_boxes[:, 1] + 1.0
        gt_ctr_x = reference_boxes[:, 0] + 0.5 * gt_widths
        gt_ctr_y = reference_boxes[:, 1] + 0.5 * gt_heights
        return torch.stack([wx * (gt_ctr_x - ctr_x) / widths, wy * (gt_ctr_y - ctr_y) / heights,
                            ww * torch.log(gt_widths / widths), wh * torch.log(gt_heights / heights)], dim=1)

    def decode_single(self, rel_codes: Tensor, boxes: Tensor) -> Tensor:
        boxes = boxes.to(rel_codes.dtype)
        widths = boxes[:, 2] - boxes[:, 0] + 1.0
        heights = boxes[:, 3] - boxes[:, 1] + 1.0
        ctr_x = boxes[:, 0] + 0.5 * widths
        ctr_y = boxes[:, 1] + 0.5 * heights
        wx, wy, ww, wh = (float(w) for w in self.weights)
        dx = rel_codes[:, 0::4] / wx
        dy = rel_codes[:, 1::4] / wy
        dw = torch.clamp(rel_codes[:, 2::4] / ww, max=self.bbox_xform_clip)
        dh = torch.clamp(rel_codes[:, 3::4] / wh, max=self.bbox_xform_clip)
        pred_ctr_x = dx * widths[:, None] + ctr_x[:, None]
        pred_ctr_y = dy * heights[:, None] + ctr_y[:, None]
        pred_w = torch.exp(dw) * widths[:, None]
        pred_h = torch.exp(dh) * heights[:, None]
        return torch.stack([pred_ctr_x - 0.5 * pred_w, pred_ctr_y - 0.5 * pred_h,
                            pred_ctr_x + 0.5 * pred_w, pred_ctr_y + 0.5 * pred_h], dim=2).flatten(1)


def clip_boxes_legacy(boxes: Tensor, size: tuple[int, int]) -> Tensor:
    """py-faster-rcnn's clip_boxes: x in [0, W - 1], y in [0, H - 1] (inclusive pixel corners)."""
    height, width = size
    x = boxes[..., 0::2].clamp(min=0, max=width - 1)
    y = boxes[..., 1::2].clamp(min=0, max=height - 1)
    return torch.stack([x[..., 0], y[..., 0], x[..., 1], y[..., 1]], dim=-1)


def inclusive_corners(boxes: Tensor) -> Tensor:
    """Boxes whose torchvision IoU equals the legacy IoU of `boxes` (areas and overlaps with +1):
    x2 + 1, y2 + 1. Legacy NMS is torchvision's NMS on these (the source suppresses at IoU >=
    threshold, torchvision at > threshold: only exact ties differ)."""
    return torch.cat([boxes[..., :2], boxes[..., 2:] + 1.0], dim=-1)


def legacy_nms_threshold(threshold: float) -> float:
    """The threshold at which torchvision's NMS (suppress at IoU > t, the fp32 IoU compared in double)
    suppresses as Caffe's and MILVLG's `nms_cpu` do (IoU >= t, both in fp32): the largest float32 below
    float32(t). Near-grid boxes (a random or young RPN's proposals are anchors shifted by 16 px) meet
    IoU == 0.7f exactly."""
    return float(np.nextafter(np.float32(threshold), np.float32(0.0)))


def uses_legacy_boxes(model: nn.Module) -> bool:
    """Whether a detector built by build_detector uses caffe_legacy box coding."""
    return isinstance(model.roi_heads.box_coder, LegacyBoxCoder)


def first_nms_survivors(boxes: Tensor, scores: Tensor, idxs: Tensor, iou_threshold: float, k: int) -> Tensor:
    """batched_nms(boxes, scores, idxs, iou_threshold)[:k], without the NMS over every box.

    Greedy NMS keeps or drops a box by the boxes scored above it alone, so the k best survivors are found
    among the best-scored boxes: NMS runs on the top 2k boxes (then 4k, ...) until k of them survive. An
    RPN keeps 300 of its 2,000 pre-NMS proposals in training (100 of 1,000 at test time); NMS over all of
    them, serial on the CPU, was a quarter of a detector training step at the default config
    (docs/benchmarks.md, "What 1,200 s took").

    Survivors of equal score come in index order. (batched_nms sorts its survivors again when it has more
    than 1,000 boxes on the CPU, with a sort that leaves the order of equal scores unspecified.)
    """
    def by_score_then_index(keep: Tensor) -> Tensor:
        keep = keep.sort().values
        return keep[torch.sort(scores[keep], descending=True, stable=True).indices]

    order = torch.sort(scores, descending=True, stable=True).indices   # equal scores by index, as NMS takes them
    size = 2 * k
    while 0 < size < order.numel():
        top = order[:size]
        keep = top[batched_nms(boxes[top], scores[top], idxs[top], iou_threshold)]
        if keep.numel() >= k:
            return by_score_then_index(keep)[:k]
        size *= 2
    return by_score_then_index(batched_nms(boxes, scores, idxs, iou_threshold))[:k]


class TopProposalsRPN(RegionProposalNetwork):
    """torchvision's RPN, whose NMS stops once it has the post-NMS top-n proposals (first_nms_survivors);
    it proposes the same boxes."""

    @classmethod
    def like(cls, rpn: RegionProposalNetwork, **kwargs) -> "TopProposalsRPN":
        """This class with `rpn`'s modules and settings (FasterRCNN builds torchvision's own)."""
        return cls(rpn.anchor_generator, rpn.head, rpn.proposal_matcher.high_threshold,
                   rpn.proposal_matcher.low_threshold, rpn.fg_bg_sampler.batch_size_per_image,
                   rpn.fg_bg_sampler.positive_fraction, rpn._pre_nms_top_n, rpn._post_nms_top_n, rpn.nms_thresh,
                   rpn.score_thresh, **kwargs)

    def filter_proposals(self, proposals: Tensor, objectness: Tensor, image_shapes: list[tuple[int, int]],
                         num_anchors_per_level: list[int]) -> tuple[list[Tensor], list[Tensor]]:
        # torchvision's RegionProposalNetwork.filter_proposals but for its NMS (a test compares the two)
        num_images = proposals.shape[0]
        objectness = objectness.detach().reshape(num_images, -1)
        levels = torch.cat([torch.full((n,), level, dtype=torch.int64, device=proposals.device)
                            for level, n in enumerate(num_anchors_per_level)]).reshape(1, -1).expand_as(objectness)
        top_n_idx = self._get_top_n_idx(objectness, num_anchors_per_level)
        batch_idx = torch.arange(num_images, device=proposals.device)[:, None]
        objectness, levels = objectness[batch_idx, top_n_idx], levels[batch_idx, top_n_idx]
        proposals = proposals[batch_idx, top_n_idx]
        final_boxes, final_scores = [], []
        for boxes, scores, level, shape in zip(proposals, torch.sigmoid(objectness), levels, image_shapes):
            boxes = clip_boxes_to_image(boxes, shape)
            keep = remove_small_boxes(boxes, self.min_size)
            boxes, scores, level = boxes[keep], scores[keep], level[keep]
            keep = torch.where(scores >= self.score_thresh)[0]
            boxes, scores, level = boxes[keep], scores[keep], level[keep]
            keep = first_nms_survivors(boxes, scores, level, self.nms_thresh, self.post_nms_top_n())
            final_boxes.append(boxes[keep])
            final_scores.append(scores[keep])
        return final_boxes, final_scores


class LegacyRegionProposalNetwork(TopProposalsRPN):
    """torchvision's RPN with py-faster-rcnn's proposal layer: decode (legacy), clip to [0, W-1], drop
    proposals with a side (+1) under rpn_min_size original-image pixels, take the pre-NMS top-n by
    objectness, NMS with +1 areas, keep the post-NMS top-n. Training losses are torchvision's."""

    def __init__(self, *args, min_size_original: float, **kwargs):
        super().__init__(*args, **kwargs)
        self.min_size_original = float(min_size_original)
        self._image_scales: list[float] | None = None

    def forward(self, images: ImageList, features, targets=None):
        # The image scales (resized / original, PixelFormatTransform) of this batch, for filter_proposals.
        self._image_scales = getattr(images, "image_scales", None)
        try:
            return super().forward(images, features, targets)
        finally:
            self._image_scales = None

    def filter_proposals(self, proposals: Tensor, objectness: Tensor, image_shapes: list[tuple[int, int]],
                         num_anchors_per_level: list[int]) -> tuple[list[Tensor], list[Tensor]]:
        num_images = proposals.shape[0]
        objectness = objectness.detach().reshape(num_images, -1)
        scales = self._image_scales or [1.0] * num_images
        final_boxes, final_scores = [], []
        for boxes, logits, shape, scale in zip(proposals, objectness, image_shapes, scales):
            boxes = clip_boxes_legacy(boxes, shape)
            min_side = self.min_size_original * scale
            keep = ((boxes[:, 2] - boxes[:, 0] + 1 >= min_side) & (boxes[:, 3] - boxes[:, 1] + 1 >= min_side))
            boxes, logits = boxes[keep], logits[keep]
            # Ranked by the fp32 probability, as Caffe's proposal layer and MILVLG's port rank (softmax fg
            # score): near 1 the probabilities tie where the logits do not, and the ties go by anchor index.
            probs = torch.sigmoid(logits.float())
            order = torch.sort(probs, descending=True, stable=True).indices[: self.pre_nms_top_n()]
            boxes, probs = boxes[order], probs[order]
            keep = first_nms_survivors(inclusive_corners(boxes), probs, torch.zeros_like(order),
                                       legacy_nms_threshold(self.nms_thresh), self.post_nms_top_n())
            final_boxes.append(boxes[keep])
            final_scores.append(probs[keep])
        return final_boxes, final_scores


# ---- heads ---------------------------------------------------------------------------------------------

class WideRPNHead(RPNHead):
    """torchvision's RPNHead (same module names, so the same state-dict keys) with a 3x3 conv of
    `hidden_channels` outputs instead of `in_channels` (bottom-up attention: 1024 -> 512)."""

    def __init__(self, in_channels: int, num_anchors: int, hidden_channels: int):
        super().__init__(in_channels, num_anchors)
        self.conv = nn.Sequential(Conv2dNormActivation(in_channels, hidden_channels, kernel_size=3, norm_layer=None))
        self.cls_logits = nn.Conv2d(hidden_channels, num_anchors, kernel_size=1, stride=1)
        self.bbox_pred = nn.Conv2d(hidden_channels, num_anchors * 4, kernel_size=1, stride=1)
        for layer in self.modules():
            if isinstance(layer, nn.Conv2d):
                nn.init.normal_(layer.weight, std=0.01)
                nn.init.constant_(layer.bias, 0)


class SingleMapRoIPool(nn.Module):
    """Caffe's ROIPooling (Fast R-CNN max pooling over rounded RoI bins; torchvision.ops.RoIPool) on the
    one stride-16 map, called like MultiScaleRoIAlign by torchvision's RoIHeads."""

    def __init__(self, output_size: int = ROI_OUTPUT_SIZE, spatial_scale: float = 1.0 / FEATURE_STRIDE):
        super().__init__()
        self.pool = RoIPool(output_size, spatial_scale)

    def forward(self, features: Mapping[str, Tensor], boxes: list[Tensor], image_shapes=None) -> Tensor:
        return self.pool(features["0"], boxes)


class AttributePredictor(nn.Module):
    """Bottom-up attention's attribute head: an embedding of each RoI's object class (background
    included) is concatenated to its pooled feature, then Linear -> ReLU -> Linear gives
    num_attributes + 1 logits (0 = no attribute). Caffe: cls_embedding (Embed 1601 -> 256, no bias),
    concat_pool5, fc_attr (2304 -> 512), relu_attr, attr_score (512 -> 401); the widths are the
    feature width / 8 and / 4, as the PyTorch ports build them. The class is the ground truth's in
    training (AttributeRoIHeads) and the arg-max of the class scores at test time (predict_attributes)."""

    def __init__(self, in_channels: int, num_classes_with_background: int, num_attributes: int,
                 embed_dim: int | None = None, hidden_dim: int | None = None):
        super().__init__()
        # MILVLG's port fixes 256 and 512 whatever the width (bua/caffe/modeling/fast_rcnn.py:255-257):
        # embed_dim / hidden_dim (config attribute_embed_dim / attribute_hidden_dim) say so for a narrow model.
        embed_dim = in_channels // 8 if embed_dim is None else int(embed_dim)
        hidden_dim = in_channels // 4 if hidden_dim is None else int(hidden_dim)
        self.cls_embedding = nn.Embedding(num_classes_with_background, embed_dim)
        self.fc_attr = nn.Linear(in_channels + embed_dim, hidden_dim)
        self.attr_score = nn.Linear(hidden_dim, num_attributes + 1)
        # The output layer as Caffe's filler (gaussian std 0.01, zero bias). The embedding and fc_attr keep
        # PyTorch's initialisation: Caffe's std 0.01 on all three suits its 2,048-wide features; on a narrow
        # head it leaves the product of two 0.01-scaled layers, and 150 steps of the world's detector
        # learned nothing (colour accuracy at chance).
        nn.init.normal_(self.attr_score.weight, std=0.01)
        nn.init.zeros_(self.attr_score.bias)

    def forward(self, pooled: Tensor, classes: Tensor) -> Tensor:
        """pooled [N, C] RoI features, classes [N] int64 (0 = background) -> [N, num_attributes + 1] logits."""
        embedded = self.cls_embedding(classes)
        return self.attr_score(F.relu(self.fc_attr(torch.cat([pooled.flatten(1), embedded], dim=1))))


# Slots per object for attribute labels (bottom-up attention: 16, padded with IGNORE_ATTRIBUTE).
MAX_ATTRIBUTES_PER_OBJECT = 16
IGNORE_ATTRIBUTE = -1
# Caffe train.prototxt: loss_attr loss_weight 0.5.
RELEASED_ATTRIBUTE_LOSS_WEIGHT = 0.5


def attribute_loss(logits: Tensor, labels: Tensor) -> Tensor:
    """Bottom-up attention's attribute loss (before its loss weight), as its PyTorch port computes it.

    logits [N, A + 1] of N foreground RoIs; labels [N, S]: each RoI's attribute ids (1..A), padded with
    IGNORE_ATTRIBUTE. Every label slot is a softmax cross-entropy over all A + 1 outputs, weighted by
    1 / (the RoI's number of attributes), so each RoI with attributes counts once; the sum is divided
    by the number of such RoIs. A RoI with no attribute ("no attribute" is output 0, never a target
    here) adds nothing. Zero, still connected to `logits`, when no RoI has an attribute."""
    if logits.shape[0] != labels.shape[0]:
        raise ValueError(f"attribute_loss: {logits.shape[0]} RoIs of logits, {labels.shape[0]} of labels")
    valid = labels != IGNORE_ATTRIBUTE                                               # [N, S]
    per_roi = valid.sum(dim=1)                                                       # [N]
    slots = logits[:, None, :].expand(-1, labels.shape[1], -1).reshape(-1, logits.shape[1])
    losses = F.cross_entropy(slots, labels.reshape(-1), reduction="none", ignore_index=IGNORE_ATTRIBUTE)
    weights = (valid.float() / per_roi.clamp(min=1)[:, None].float()).reshape(-1)
    rois_with_attributes = int((per_roi > 0).sum())
    return (losses * weights).sum() / max(rois_with_attributes, 1)


class AttributeRoIHeads(RoIHeads):
    """torchvision's RoIHeads with bottom-up attention's attribute head. Training adds `loss_attribute`
    (attribute_loss x loss_weight) on the sampled foreground RoIs, each with its matched ground-truth
    object's class and attributes (targets' `attributes`, [G, S] ids padded with IGNORE_ATTRIBUTE).
    Detection (eval) is torchvision's; predict_attributes gives the attributes of given boxes."""

    def __init__(self, heads: RoIHeads, attribute_predictor: AttributePredictor, loss_weight: float):
        super().__init__(heads.box_roi_pool, heads.box_head, heads.box_predictor,
                         heads.proposal_matcher.high_threshold, heads.proposal_matcher.low_threshold,
                         heads.fg_bg_sampler.batch_size_per_image, heads.fg_bg_sampler.positive_fraction,
                         heads.box_coder.weights, heads.score_thresh, heads.nms_thresh, heads.detections_per_img)
        self.box_coder = heads.box_coder  # keeps a LegacyBoxCoder
        self.attribute_predictor = attribute_predictor
        self.attribute_loss_weight = float(loss_weight)

    def forward(self, features, proposals, image_shapes, targets=None):
        if not self.training or self.attribute_loss_weight == 0:
            return super().forward(features, proposals, image_shapes, targets)
        if targets is None or any("attributes" not in t for t in targets):
            raise ValueError("AttributeRoIHeads: training with attribute_loss_weight > 0 needs targets with "
                             "'attributes' ([G, S] attribute ids padded with -1)")
        proposals, matched_idxs, labels, regression_targets = self.select_training_samples(proposals, targets)
        pooled = self.box_head(self.box_roi_pool(features, proposals, image_shapes))
        class_logits, box_regression = self.box_predictor(pooled)
        loss_classifier, loss_box_reg = fastrcnn_loss(class_logits, box_regression, labels, regression_targets)
        foreground = torch.cat(labels) > 0
        gt_attributes = torch.cat([t["attributes"][idx] if len(t["attributes"]) else
                                   torch.full((len(idx), MAX_ATTRIBUTES_PER_OBJECT), IGNORE_ATTRIBUTE,
                                              dtype=torch.int64, device=idx.device)
                                   for t, idx in zip(targets, matched_idxs)])
        logits = self.attribute_predictor(pooled.flatten(1)[foreground], torch.cat(labels)[foreground])
        loss_attribute = attribute_loss(logits, gt_attributes[foreground]) * self.attribute_loss_weight
        return [], {"loss_classifier": loss_classifier, "loss_box_reg": loss_box_reg, "loss_attribute": loss_attribute}


# ---- transform -----------------------------------------------------------------------------------------

def released_resize_scale(height: int, width: int, min_size: int, max_size: int, mode: str) -> tuple[float, int, int]:
    """(scale, new height, new width) of the released resizes (module docstring, `resize`).
    pil_uint8: detectron2's ResizeShortestEdge.get_transform (airsplay transform_gen.py:200-210);
    cv2_float: py-faster-rcnn's _get_image_blob (MILVLG utils/extract_utils.py:43-49), the sides as
    cv2.resize(fx=fy=scale) rounds them (cvRound: half to even)."""
    short, long = min(height, width), max(height, width)
    if mode == "pil_uint8":
        scale = min_size * 1.0 / short
        new_h, new_w = (min_size, scale * width) if height < width else (scale * height, min_size)
        if max(new_h, new_w) > max_size:
            shrink = max_size * 1.0 / max(new_h, new_w)
            new_h, new_w = new_h * shrink, new_w * shrink
        return scale, int(new_h + 0.5), int(new_w + 0.5)
    if mode == "cv2_float":
        scale = float(min_size) / float(short)
        if np.round(scale * long) > max_size:
            scale = float(max_size) / float(long)
        return scale, int(round(height * scale)), int(round(width * scale))
    raise ValueError(f"released_resize_scale: mode {mode!r}")


def cv2_linear_resize(image: Tensor, new_h: int, new_w: int, scale: float) -> Tensor:
    """cv2.resize(image, None, fx=scale, fy=scale, interpolation=INTER_LINEAR) of a float [C, H, W] image:
    the source of output pixel d is (d + 0.5) / scale - 0.5, clamped to the border pixels (no antialias)."""
    def taps(out_size: int, in_size: int) -> tuple[Tensor, Tensor, Tensor]:
        src = (torch.arange(out_size, dtype=torch.float64) + 0.5) * (1.0 / scale) - 0.5
        low = torch.floor(src)
        frac = src - low
        low = low.long()
        frac = torch.where(low < 0, torch.zeros_like(frac), frac)
        low = low.clamp(min=0)
        frac = torch.where(low >= in_size - 1, torch.zeros_like(frac), frac)
        low = low.clamp(max=in_size - 1)
        high = (low + 1).clamp(max=in_size - 1)
        return low.to(image.device), high.to(image.device), frac.to(image.dtype).to(image.device)

    y0, y1, fy = taps(new_h, image.shape[-2])
    x0, x1, fx = taps(new_w, image.shape[-1])
    rows = image[:, y0, :] * (1 - fy)[:, None] + image[:, y1, :] * fy[:, None]
    return rows[:, :, x0] * (1 - fx) + rows[:, :, x1] * fx


class PixelFormatTransform(GeneralizedRCNNTransform):
    """torchvision's resize-and-batch transform, normalising as the backbone's `pixel_format` says
    (torchvision's own normalisation knows neither BGR nor the 0-255 scale of Caffe weights). The
    ImageList it returns also carries `image_scales` (resized / original height per image, or the
    scale itself for cv2_float), which Caffe's minimum proposal size is measured with, and
    `to_original` ([sx, sy, sx, sy] per image: a box in the resized frame times it is in the original
    image's pixels). `resize` (module docstring) picks the resize; the default is torchvision's own."""

    def __init__(self, min_size: int, max_size: int, pixel_format: str, size_divisible: int = 32,
                 resize: str = "torchvision"):
        fmt = get_pixel_format(pixel_format)
        super().__init__(min_size, max_size, image_mean=list(fmt.mean), image_std=list(fmt.std),
                         size_divisible=size_divisible)
        if resize not in RESIZES:
            raise ValueError(f"detector.resize={resize!r}: expected one of {list(RESIZES)}")
        self.pixel_format = pixel_format
        self.resize_mode = resize
        self._scales: list[float] = []

    def normalize(self, image):
        if self.resize_mode != "torchvision":
            return image  # resize() normalises, in the order the source does
        return normalise_pixels(image, self.pixel_format)

    def resize(self, image, target=None):
        if self.resize_mode == "torchvision":
            return super().resize(image, target)
        height, width = int(image.shape[-2]), int(image.shape[-1])
        scale, new_h, new_w = released_resize_scale(height, width, int(self.min_size[-1]), int(self.max_size),
                                                    self.resize_mode)
        fmt = get_pixel_format(self.pixel_format)
        mean = torch.tensor(fmt.mean, dtype=torch.float32, device=image.device).view(3, 1, 1)
        std = torch.tensor(fmt.std, dtype=torch.float32, device=image.device).view(3, 1, 1)
        if self.resize_mode == "pil_uint8":
            from PIL import Image

            # our input is uint8 / 255 (images.to_unit_float): back to the uint8 image the source resizes
            pixels = (image.float() * 255.0).round().clamp(0, 255).to(torch.uint8).permute(1, 2, 0).cpu().numpy()
            resized = np.asarray(Image.fromarray(pixels).resize((new_w, new_h), Image.BILINEAR))
            out = torch.from_numpy(resized.copy()).permute(2, 0, 1).to(image.device).float()
            out = out.flip(0) if fmt.bgr else out
            out = (out * (fmt.scale / 255.0) - mean) / std
        else:
            pixels = (image.float() * 255.0).round() if fmt.scale == 255.0 else image.float()
            pixels = pixels.flip(0) if fmt.bgr else pixels
            out = cv2_linear_resize((pixels - mean) / std, new_h, new_w, scale)
        self._scales.append(scale)
        if target is not None and "boxes" in target:
            from torchvision.models.detection.transform import resize_boxes

            target["boxes"] = resize_boxes(target["boxes"], (height, width), (new_h, new_w))
        return out, target

    def forward(self, images, targets=None):
        original_sizes = [(int(img.shape[-2]), int(img.shape[-1])) for img in images]
        self._scales = []
        image_list, targets = super().forward(images, targets)
        if self.resize_mode == "cv2_float":
            image_list.image_scales = list(self._scales)
            image_list.to_original = [[1.0 / s, 1.0 / s] * 2 for s in self._scales]
        else:
            image_list.image_scales = [resized[0] / original[0] for resized, original in
                                       zip(image_list.image_sizes, original_sizes)]
            image_list.to_original = [[original[1] / resized[1], original[0] / resized[0]] * 2 for resized, original
                                      in zip(image_list.image_sizes, original_sizes)]
        return image_list, targets


# ---- the detector --------------------------------------------------------------------------------------

def build_detector(cfg: Mapping[str, Any], num_classes: int) -> FasterRCNN:
    """Faster R-CNN with the C4 body as its single-map ('0') backbone and stage 5 as box head.

    `cfg` is the config's `detector:` section. `num_classes` counts foreground classes; the
    predictor has num_classes + 1 outputs, 0 being background.
    Keys read: backbone, min_size, max_size, rpn_post_nms_train, rpn_post_nms_test,
    box_batch_size_per_image, and optionally anchor_sizes, aspect_ratios, rpn_pre_nms_train,
    rpn_pre_nms_test, box_score_thresh, box_nms_thresh, box_detections_per_img and the conventions
    of the module docstring (anchor_style, box_coding, box_reg_weights, rpn_head_channels,
    rpn_nms_thresh, rpn_min_size, roi_pooler, size_divisible, num_attributes, attribute_loss_weight).
    """
    if num_classes < 1:
        raise ValueError(f"build_detector: num_classes must be >= 1, got {num_classes}")
    for key in ("backbone", "min_size", "max_size", "rpn_post_nms_train", "rpn_post_nms_test",
                "box_batch_size_per_image"):
        if key not in cfg:
            raise KeyError(f"detector config lacks key '{key}'")
    box_coding = cfg.get("box_coding", "torchvision")
    if box_coding not in BOX_CODINGS:
        raise ValueError(f"detector.box_coding={box_coding!r}: expected one of {list(BOX_CODINGS)}")
    roi_pooler = cfg.get("roi_pooler", "roi_align")
    if roi_pooler not in ROI_POOLERS:
        raise ValueError(f"detector.roi_pooler={roi_pooler!r}: expected one of {list(ROI_POOLERS)}")
    settings = DetectorSettings.from_config(cfg)
    box_reg_weights = settings.box_reg_weights
    if len(box_reg_weights) != 4 or min(box_reg_weights) <= 0:
        raise ValueError(f"detector.box_reg_weights={list(box_reg_weights)}: expected 4 positive numbers")

    backbone_cfg = ResNetC4Config.from_dict(cfg["backbone"])
    body, head, body_out, head_out = build_resnet_c4(backbone_cfg)
    body.out_channels = body_out  # FasterRCNN reads backbone.out_channels

    anchor_generator = build_anchor_generator(cfg)
    num_anchors = anchor_generator.num_anchors_per_location()[0]
    roi_align = MultiScaleRoIAlign(featmap_names=["0"], output_size=ROI_OUTPUT_SIZE,
                                   sampling_ratio=ROI_SAMPLING_RATIO)
    # The predictor is initialised before the RPN head, the order in which torchvision's FasterRCNN drew
    # them when it built the RPN head itself: a detector trained from the same seed stays the same.
    predictor = FastRCNNPredictor(head_out, num_classes + 1)
    rpn_head = WideRPNHead(body_out, num_anchors, settings.rpn_head_channels) \
        if settings.rpn_head_channels is not None else RPNHead(body_out, num_anchors)

    post_train, post_test = settings.rpn_post_nms_train, settings.rpn_post_nms_test
    pre_train = max(2000, post_train) if settings.rpn_pre_nms_train is None else settings.rpn_pre_nms_train
    pre_test = max(1000, post_test) if settings.rpn_pre_nms_test is None else settings.rpn_pre_nms_test
    rpn_nms_thresh = settings.rpn_nms_thresh
    model = FasterRCNN(
        body,
        num_classes=None,
        min_size=settings.min_size,
        max_size=settings.max_size,
        rpn_anchor_generator=anchor_generator,
        rpn_head=rpn_head,
        rpn_pre_nms_top_n_train=pre_train,
        rpn_pre_nms_top_n_test=pre_test,
        rpn_post_nms_top_n_train=post_train,
        rpn_post_nms_top_n_test=post_test,
        rpn_nms_thresh=rpn_nms_thresh,
        box_roi_pool=roi_align,  # FasterRCNN accepts only this type; roi_pool replaces it below
        box_head=head,
        box_predictor=predictor,
        box_batch_size_per_image=settings.box_batch_size_per_image,
        box_score_thresh=settings.box_score_thresh,
        box_nms_thresh=settings.box_nms_thresh,
        box_detections_per_img=settings.box_detections_per_img,
        bbox_reg_weights=box_reg_weights,
    )
    if roi_pooler == "roi_pool":
        model.roi_heads.box_roi_pool = SingleMapRoIPool()
    if box_coding == "caffe_legacy":
        model.rpn = LegacyRegionProposalNetwork.like(
            model.rpn, min_size_original=0.0 if settings.rpn_min_size is None else settings.rpn_min_size)
        model.rpn.box_coder = LegacyBoxCoder((1.0, 1.0, 1.0, 1.0))
        model.roi_heads.box_coder = LegacyBoxCoder(box_reg_weights)
    elif settings.rpn_min_size is not None:
        raise ValueError("detector.rpn_min_size applies with box_coding: caffe_legacy only")
    else:
        model.rpn = TopProposalsRPN.like(model.rpn)
    if settings.num_attributes is not None:
        model.roi_heads = AttributeRoIHeads(
            model.roi_heads, AttributePredictor(head_out, num_classes + 1, settings.num_attributes,
                                                cfg.get("attribute_embed_dim"), cfg.get("attribute_hidden_dim")),
            settings.attribute_loss_weight)
    model.transform = PixelFormatTransform(settings.min_size, settings.max_size, backbone_cfg.pixel_format,
                                           settings.size_divisible, settings.resize)
    return model


def predict_attributes(model: FasterRCNN, features: Mapping[str, Tensor], boxes: list[Tensor],
                       image_shapes: list[tuple[int, int]]) -> Tensor:
    """Attribute probabilities [sum N, num_attributes + 1] (softmax, 0 = no attribute) of `boxes`
    (in the resized-image frame of `image_shapes`), from a detector with an attribute head."""
    heads = model.roi_heads
    if not hasattr(heads, "attribute_predictor"):
        raise ValueError("predict_attributes: this detector has no attribute head (detector.num_attributes)")
    pooled = heads.box_head(heads.box_roi_pool(features, boxes, image_shapes))
    class_logits, _ = heads.box_predictor(pooled)
    return F.softmax(heads.attribute_predictor(pooled.flatten(1), class_logits.argmax(dim=1)), dim=-1)
