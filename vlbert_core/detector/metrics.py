"""Box AP at IoU 0.5, PASCAL VOC style (all-point interpolation), averaged over classes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch
from torchvision.ops import box_iou


@dataclass
class ImageDetections:
    """Detections of one image: boxes [D, 4] x1y1x2y2, scores [D], labels [D] (1..K)."""

    boxes: np.ndarray
    scores: np.ndarray
    labels: np.ndarray


@dataclass
class ImageGroundTruth:
    """Ground truth of one image: boxes [G, 4] x1y1x2y2, labels [G] (1..K)."""

    boxes: np.ndarray
    labels: np.ndarray


def average_precision(is_true_positive: Sequence[bool], num_ground_truth: int) -> float:
    """All-point interpolated AP of detections already sorted by descending score.

    Precision is made monotone (each point takes the best precision at any higher recall), and
    AP is the area under that step curve: sum over recall increments of the interpolated precision.
    """
    if num_ground_truth <= 0:
        raise ValueError("average_precision: needs at least one ground-truth box")
    tp = np.asarray(is_true_positive, dtype=np.float64)
    if tp.size == 0:
        return 0.0
    cum_tp = np.cumsum(tp)
    cum_fp = np.cumsum(1.0 - tp)
    recall = cum_tp / num_ground_truth
    precision = cum_tp / (cum_tp + cum_fp)
    recall = np.concatenate([[0.0], recall, [1.0]])
    precision = np.concatenate([[0.0], precision, [0.0]])
    precision = np.maximum.accumulate(precision[::-1])[::-1]
    changed = np.where(recall[1:] != recall[:-1])[0]
    return float(np.sum((recall[changed + 1] - recall[changed]) * precision[changed + 1]))


def evaluate_ap50(
    detections: Sequence[ImageDetections],
    ground_truths: Sequence[ImageGroundTruth],
    num_classes: int,
    iou_threshold: float = 0.5,
) -> dict:
    """AP@0.5 per class (1..num_classes) and its mean over classes that have ground truth.

    Matching, per class over the whole split: detections are visited by descending score (ties
    keep image order, then the order within the image); each takes the unmatched ground-truth box
    of its image with the highest IoU if that IoU >= iou_threshold (a true positive), otherwise it
    is a false positive (including a second hit on an already matched box). Classes without any
    ground-truth box get AP None and are left out of the mean.
    """
    if len(detections) != len(ground_truths):
        raise ValueError(f"evaluate_ap50: {len(detections)} detection lists for {len(ground_truths)} images")
    per_class: dict[int, float | None] = {}
    for cls in range(1, num_classes + 1):
        entries = []  # (score, image index, detection index within image)
        gt_boxes_by_image = []
        num_gt = 0
        for img_idx, (det, gt) in enumerate(zip(detections, ground_truths)):
            gt_boxes = np.asarray(gt.boxes, dtype=np.float32).reshape(-1, 4)[np.asarray(gt.labels) == cls]
            gt_boxes_by_image.append(gt_boxes)
            num_gt += len(gt_boxes)
            det_scores = np.asarray(det.scores, dtype=np.float64)
            for det_idx in np.where(np.asarray(det.labels) == cls)[0]:
                entries.append((det_scores[det_idx], img_idx, int(det_idx)))
        if num_gt == 0:
            per_class[cls] = None
            continue
        entries.sort(key=lambda e: (-e[0], e[1], e[2]))
        matched = [np.zeros(len(b), dtype=bool) for b in gt_boxes_by_image]
        hits = []
        for _, img_idx, det_idx in entries:
            gt_boxes = gt_boxes_by_image[img_idx]
            if len(gt_boxes) == 0:
                hits.append(False)
                continue
            det_box = np.asarray(detections[img_idx].boxes, dtype=np.float32).reshape(-1, 4)[det_idx]
            ious = box_iou(torch.from_numpy(det_box[None]), torch.from_numpy(gt_boxes))[0].numpy()
            ious[matched[img_idx]] = -1.0
            best = int(np.argmax(ious))
            if ious[best] >= iou_threshold:
                matched[img_idx][best] = True
                hits.append(True)
            else:
                hits.append(False)
        per_class[cls] = average_precision(hits, num_gt)
    valid = [ap for ap in per_class.values() if ap is not None]
    return {"ap50": float(np.mean(valid)) if valid else None, "per_class": per_class}
