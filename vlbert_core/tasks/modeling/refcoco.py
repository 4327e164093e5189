"""RefCOCO+: the samples <Query, Image> with one binary target per candidate box, and the
head (one binary score per RoI)."""

from __future__ import annotations

import os
from collections import OrderedDict
from pathlib import Path

import numpy as np

import torch
import torch.nn.functional as F
from torch import nn

from vlbert_core.models.common.batch import ModelBatch, collate_samples
from vlbert_core.models.common.heads import PredictionTransform
from vlbert_core.models.common.initialization import init_new_parameters

from ..common import rois_for_key
from ..refcoco import POSITIVE_IOU, RefcocoData, box_iou
from ..samples import ImageLoader, Tokens, image_and_boxes, truncate_pair
from .common import PADDED_REGION_SCORE, VILBERT_LAYOUTS, check_layout


class RefCOCOHead(nn.Module):
    """On each box's visual state: layout "project": Dropout-Linear-ReLU-Dropout-Linear; layout "released": the authors' final MLP,
    the MVRC head transform (Linear(h, h)-GELU) -> Dropout -> Linear(h, 1); layout "vilbert_released" (ViLBERT's
    vision_logit, in both ViLBERT releases): Dropout -> Linear(h, 1), PADDED_REGION_SCORE added at padded box
    slots as the authors do."""

    def __init__(self, hidden_size: int, dropout: float = 0.1, layout: str = "project", hidden_act: str = "gelu"):
        super().__init__()
        check_layout(layout)
        if layout == "released":
            self.mlp = nn.Sequential(OrderedDict([
                ("transform", PredictionTransform(hidden_size, hidden_act, layer_norm_eps=None)),
                ("dropout", nn.Dropout(dropout)), ("linear", nn.Linear(hidden_size, 1))]))
        elif layout in VILBERT_LAYOUTS:
            self.mlp = nn.Sequential(OrderedDict([("dropout", nn.Dropout(dropout)),
                                                  ("linear", nn.Linear(hidden_size, 1))]))
        else:
            self.mlp = nn.Sequential(nn.Dropout(dropout), nn.Linear(hidden_size, hidden_size), nn.ReLU(),
                                     nn.Dropout(dropout), nn.Linear(hidden_size, 1))
        self.score_padding = layout in VILBERT_LAYOUTS
        init_new_parameters(self)

    def forward(self, output, batch) -> torch.Tensor:
        """[B, R] logits; box slots that are not candidates are left to the caller's mask."""
        logits = self.mlp(output.visual_states).squeeze(-1)
        if self.score_padding:
            logits = logits + (~output.visual_mask).to(logits.dtype) * PADDED_REGION_SCORE
        return logits

    @staticmethod
    def loss(logits: torch.Tensor, labels: torch.Tensor, candidate: torch.Tensor) -> torch.Tensor:
        """BCE over candidate boxes only (padding, and box 0, the whole image, unless it is one, are not)."""
        return F.binary_cross_entropy_with_logits(logits[candidate], labels[candidate])

    @staticmethod
    def predict(logits: torch.Tensor, candidate: torch.Tensor) -> torch.Tensor:
        """[B] index of the best-scoring candidate box."""
        return logits.masked_fill(~candidate, float("-inf")).argmax(dim=1)


def candidate_boxes(num_boxes: int, whole_image_candidate: bool) -> torch.Tensor:
    """Bool [num_boxes]: which of an image's boxes (box 0 the whole image, then its RoIs) the loss and the
    prediction's argmax consider: every RoI, and box 0 only with `whole_image_candidate` (the authors' code
    argmaxes over all boxes, box 0 included; finetune.refcoco.whole_image_candidate)."""
    if num_boxes < 1:
        raise ValueError(f"a RefCOCO+ image has box 0 (the whole image) at least, got {num_boxes} boxes")
    candidate = torch.ones(num_boxes, dtype=torch.bool)
    candidate[0] = bool(whole_image_candidate)
    return candidate


class RefcocoSamples:
    """<Query, Image> with one binary target per candidate box (IoU > 0.5 with the referred box).

    Track `gt`: every instance box of the image; track `det`: the detected RoIs of the image.
    An expression without a ground-truth box (`gt_box` None: a user's query) gets no positive box.
    `whole_image_candidate`: box 0, the whole image (0, 0, w - 1, h - 1), is a candidate too, labelled by its
    IoU like the others, as in the authors' code (finetune.refcoco.whole_image_candidate); otherwise it is
    input only.
    """

    SPECIAL_TOKENS = 2  # [CLS] expression [SEP]

    def __init__(self, data: RefcocoData, track: str, images_dir: str | os.PathLike, tokens: Tokens,
                 *, max_rois: int, max_text_len: int, images: ImageLoader,
                 rois: dict | None = None, rois_source: str = "", whole_image_candidate: bool = False):
        if track not in ("gt", "det"):
            raise ValueError(f"unknown RefCOCO+ track {track!r} (expected 'gt' or 'det')")
        if track == "det" and rois is None:
            raise ValueError("the detected-regions track needs the RoI records")
        self.data, self.track = data, track
        self.images_dir = Path(images_dir)
        self.tokens, self.images = tokens, images
        self.max_rois, self.max_text_len = int(max_rois), int(max_text_len)
        self.whole_image_candidate = bool(whole_image_candidate)
        self.candidates: dict[int, np.ndarray] = {}
        for expr in data.expressions:
            if expr.image_id in self.candidates:
                continue
            if track == "gt":
                boxes = data.image_boxes[expr.image_id]
            else:
                boxes = rois_for_key(rois, expr.image_key, rois_source).boxes
            if len(boxes) == 0:
                raise ValueError(f"RefCOCO+ {track} track: image {expr.image_key} has no candidate box")
            self.candidates[expr.image_id] = np.asarray(boxes, dtype=np.float32)[: self.max_rois - 1]

    def __len__(self) -> int:
        return len(self.data.expressions)

    def box(self, i: int, index: int) -> np.ndarray:
        """Box `index` of expression i's image in original pixels: 0 the whole image, k its (k-1)-th candidate."""
        expr = self.data.expressions[i]
        if index == 0:
            return np.array([0.0, 0.0, expr.image_w - 1, expr.image_h - 1], dtype=np.float32)
        return self.candidates[expr.image_id][index - 1]

    def sample(self, i: int) -> dict:
        expr = self.data.expressions[i]
        candidates = self.candidates[expr.image_id]
        image, boxes = image_and_boxes(
            self.images, self.images_dir / self.data.image_files[expr.image_id], candidates,
            self.max_rois, (expr.image_w, expr.image_h),
            f"RefCOCO+ image {expr.image_key}")
        ids, _ = truncate_pair(self.tokens.ids(expr.sentence), None, self.max_text_len - self.SPECIAL_TOKENS)
        labels = torch.zeros(len(boxes))
        if expr.gt_box is not None:
            every_box = np.concatenate([self.box(i, 0)[None], candidates])
            labels[:] = torch.from_numpy((box_iou(every_box, expr.gt_box)[:, 0] > POSITIVE_IOU).astype(np.float32))
        candidate = candidate_boxes(len(boxes), self.whole_image_candidate)
        labels[~candidate] = 0.0
        return {"sequence": self.tokens.sequence(ids, None, len(boxes)), "image": image,
                "boxes": boxes, "labels": labels, "candidate": candidate, "index": i,
                "image_key": f"{expr.image_key}/{self.track}"}

    def collate(self, samples: list[dict]) -> tuple[ModelBatch, dict]:
        batch = collate_samples(samples)
        num_boxes = batch.boxes.shape[1]
        labels = torch.zeros(len(samples), num_boxes)
        candidate = torch.zeros(len(samples), num_boxes, dtype=torch.bool)
        for row, s in enumerate(samples):
            labels[row, : len(s["labels"])] = s["labels"]
            candidate[row, : len(s["candidate"])] = s["candidate"]
        return batch, {"labels": labels, "candidate": candidate,
                       "index": [s["index"] for s in samples],
                       "image_keys": [s["image_key"] for s in samples]}
