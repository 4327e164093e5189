"""Which detections become an image's RoIs: the rule of the paper (DESIGN §4, 'RoIs')."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torchvision.ops import batched_nms, nms

from .faster_rcnn import inclusive_corners, legacy_nms_threshold


@dataclass
class SelectedRoIs:
    """RoIs of one image, sorted by score (descending).

    boxes [N, 4] float32 x1,y1,x2,y2; scores [N] float32; class_ids [N] int64 in 1..K (the class
    whose score and box were kept); class_scores [N, K+1] float32, the softmax over background (0)
    and the K classes of the proposal each box came from.
    """

    boxes: torch.Tensor
    scores: torch.Tensor
    class_ids: torch.Tensor
    class_scores: torch.Tensor
    proposals: torch.Tensor | None = None   # [N] int64: the proposal each box came from (its RoI feature's row)

    def __len__(self) -> int:
        return int(self.boxes.shape[0])


def select_rois(
    boxes_per_class: torch.Tensor,
    class_scores: torch.Tensor,
    *,
    score_threshold: float = 0.5,
    min_boxes: int = 10,
    max_boxes: int = 100,
    nms_iou: float,
    legacy_iou: bool = False,
) -> SelectedRoIs:
    """Select the RoIs of one image from per-class detections.

    Inputs: boxes_per_class [P, K, 4] (the box regressed for each proposal and foreground class
    1..K, in column k-1) and class_scores [P, K+1] (softmax; column 0 = background).

    Candidates are all (proposal p, class k >= 1) pairs, with score class_scores[p, k].
    Ranking: by score descending; equal scores are ordered by proposal index, then class index
    (a stable sort of the candidates laid out proposal-major), so the result is deterministic.
    1. Per-class NMS over all candidates at IoU `nms_iou`, visiting candidates in that ranking.
    2. Keep the survivors with score > score_threshold (strictly greater).
    3. If fewer than min_boxes pass, take the first min_boxes survivors in ranking order whatever
       their scores; if there are fewer survivors than that, add NMS-suppressed candidates in
       ranking order, so N == min_boxes whenever P*K >= min_boxes (otherwise N == P*K).
    4. Keep at most max_boxes, the best-ranked. The output is in ranking order.
    Each kept box carries the full class-score row of its proposal.
    `legacy_iou`: IoU with inclusive corners (areas and overlaps with +1), as Caffe's NMS computes it
    (detectors with box_coding caffe_legacy, faster_rcnn.py).

    NMS runs on the shortest ranking prefix that decides the answer: greedy NMS suppresses a
    candidate only through better-ranked ones, so survivors of a prefix are survivors of the whole.
    """
    if boxes_per_class.dim() != 3 or boxes_per_class.shape[-1] != 4:
        raise ValueError(f"select_rois: boxes_per_class must be [P, K, 4], got {tuple(boxes_per_class.shape)}")
    num_proposals, num_fg = boxes_per_class.shape[:2]
    if class_scores.shape != (num_proposals, num_fg + 1):
        raise ValueError(
            f"select_rois: class_scores must be [P, K+1] = [{num_proposals}, {num_fg + 1}], got {tuple(class_scores.shape)}"
        )
    if not 1 <= min_boxes <= max_boxes:
        raise ValueError(f"select_rois: need 1 <= min_boxes <= max_boxes, got {min_boxes}, {max_boxes}")

    cand_boxes = boxes_per_class.reshape(-1, 4).float()
    cand_scores = class_scores[:, 1:].reshape(-1).float()
    cand_classes = torch.arange(1, num_fg + 1, device=cand_scores.device).repeat(num_proposals)
    cand_proposals = torch.arange(num_proposals, device=cand_scores.device).repeat_interleave(num_fg)
    total = cand_scores.numel()
    nms_boxes = inclusive_corners(cand_boxes) if legacy_iou else cand_boxes
    nms_iou = legacy_nms_threshold(nms_iou) if legacy_iou else nms_iou

    order = torch.sort(cand_scores, descending=True, stable=True).indices
    num_passing = int((cand_scores > score_threshold).sum())

    # Prefix of the ranking on which to run NMS: must contain every passing candidate and enough
    # survivors for the min_boxes top-up; grown geometrically until it does.
    prefix = min(total, max(num_passing, min_boxes))
    while True:
        idx = order[:prefix]
        # Ranks as NMS scores: strictly decreasing, so NMS visits candidates in our ranking order
        # whatever its own sort does with ties.
        rank_scores = torch.arange(prefix, 0, -1, dtype=torch.float32, device=cand_scores.device)
        keep = batched_nms(nms_boxes[idx], rank_scores, cand_classes[idx], nms_iou)
        keep = torch.sort(keep).values  # positions in the prefix == ranking order
        if keep.numel() >= min_boxes or prefix == total:
            break
        prefix = min(total, prefix * 2)

    survivors = idx[keep]
    passing = survivors[cand_scores[survivors] > score_threshold]
    if passing.numel() >= min_boxes:
        chosen = passing[:max_boxes]
    elif survivors.numel() >= min_boxes:
        chosen = survivors[:min_boxes]
    else:
        is_survivor = torch.zeros(total, dtype=torch.bool, device=cand_scores.device)
        is_survivor[survivors] = True
        suppressed = order[~is_survivor[order]]
        chosen = torch.cat([survivors, suppressed[: min_boxes - survivors.numel()]])
        rank = torch.empty_like(order)
        rank[order] = torch.arange(total, device=order.device)
        chosen = chosen[torch.argsort(rank[chosen])]
    return SelectedRoIs(
        boxes=cand_boxes[chosen],
        scores=cand_scores[chosen],
        class_ids=cand_classes[chosen],
        class_scores=class_scores[cand_proposals[chosen]].float(),
        proposals=cand_proposals[chosen],
    )


def select_rois_bottom_up(
    proposal_boxes: torch.Tensor,
    class_scores: torch.Tensor,
    *,
    score_threshold: float = 0.2,
    min_boxes: int = 10,
    max_boxes: int = 100,
    nms_iou: float = 0.3,
    legacy_iou: bool = True,
) -> SelectedRoIs:
    """The RoI rule of the released bottom-up-attention features (Anderson et al.'s tools/generate_tsv.py,
    which VL-BERT's and ViLBERT's precomputed features used; MILVLG utils/extract_utils.py:62-81).

    Inputs: proposal_boxes [P, 4] (the RPN's boxes, not the regressed ones: generate_tsv keeps "the original
    boxes"), class_scores [P, K+1] (softmax, background 0). For each class k >= 1, NMS at `nms_iou` over all
    proposals scored by class k; a proposal's confidence is its best class score among the classes it
    survived. Proposals with confidence >= score_threshold are kept; fewer than min_boxes: the min_boxes most
    confident, more than max_boxes: the max_boxes most confident. Each kept box's class is its arg-max
    foreground class and its score that class's score (objects_id / objects_conf of the source). The output
    is sorted by confidence (stable; the source keeps proposal order when 10..100 pass, our schema sorts).
    `legacy_iou`: Caffe's NMS with +1 areas (MILVLG bua/caffe/modeling/layers/csrc/nms/nms_cpu.cpp:22).
    """
    num_proposals, num_columns = class_scores.shape
    if proposal_boxes.shape != (num_proposals, 4):
        raise ValueError(f"select_rois_bottom_up: proposal_boxes must be [{num_proposals}, 4], got "
                         f"{tuple(proposal_boxes.shape)}")
    if not 1 <= min_boxes <= max_boxes:
        raise ValueError(f"select_rois_bottom_up: need 1 <= min_boxes <= max_boxes, got {min_boxes}, {max_boxes}")
    boxes = proposal_boxes.float()
    scores = class_scores.float()
    nms_boxes = inclusive_corners(boxes) if legacy_iou else boxes
    nms_iou = legacy_nms_threshold(nms_iou) if legacy_iou else nms_iou
    max_conf = torch.zeros(num_proposals, dtype=scores.dtype, device=scores.device)
    for k in range(1, num_columns):
        keep = nms(nms_boxes, scores[:, k], nms_iou)
        max_conf[keep] = torch.maximum(max_conf[keep], scores[keep, k])
    order = torch.sort(max_conf, descending=True, stable=True).indices
    passing = int((max_conf >= score_threshold).sum())
    chosen = order[:min(max(passing, min_boxes), max_boxes)]
    foreground = scores[chosen, 1:]
    best, best_class = foreground.max(dim=1) if len(chosen) else (foreground.new_zeros(0), chosen.new_zeros(0))
    return SelectedRoIs(boxes=boxes[chosen], scores=best, class_ids=best_class + 1, class_scores=scores[chosen],
                        proposals=chosen)
