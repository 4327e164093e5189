"""VCR: the samples (four candidate sequences per question), and the heads (a score per candidate from the
model's pooled vector, and the auxiliary RoI classification on the visual states)."""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from vlbert_core.models.common.batch import ModelBatch, collate_samples
from vlbert_core.models.common.heads import PredictionTransform
from vlbert_core.models.common.initialization import init_new_parameters
from vlbert_core.models.common.inputs import IGNORE_INDEX, TEXT, InputSequence

from .. import vcr as vcr_lib
from ..samples import ImageLoader, Tokens, image_and_boxes, truncate_pair
from .common import check_layout


class VCRHead(nn.Module):
    """On the pooled vector (VL-BERT: its sentence readout, the `[CLS]` output by default), of width h:
    layout "project": Dropout -> Linear(h, 1); layout "released": BERT's pooler (Linear(h, h) + tanh, released
    with_pooler) first, then Dropout -> Linear(h, 1) (CLASSIFIER_TYPE 1fc); layouts "vilbert_released" and
    "vilbert_beta_released": the project's, which is ViLBERT's vil_logit."""

    def __init__(self, hidden_size: int, dropout: float = 0.1, layout: str = "project"):
        super().__init__()
        check_layout(layout)
        self.pooler = nn.Linear(hidden_size, hidden_size) if layout == "released" else None
        self.dropout = nn.Dropout(dropout)
        self.score = nn.Linear(hidden_size, 1)
        init_new_parameters(self)

    def forward(self, output, batch, num_candidates: int) -> torch.Tensor:
        """[B_questions, num_candidates] scores; rows of the batch are question-major."""
        pooled = output.pooled
        if self.pooler is not None:
            pooled = torch.tanh(self.pooler(pooled))
        scores = self.score(self.dropout(pooled)).squeeze(-1)
        return scores.view(-1, num_candidates)

    @staticmethod
    def loss(scores: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(scores, labels)


class VCRRoIClassifier(nn.Module):
    """On each box's visual state: layout "project": Dropout -> Linear; layout "released" (CNN_LOSS_TOP): the
    MVRC head transform (Linear(h, h)-GELU) first; the ViLBERT layouts: the project's (the authors' ViLBERT has no
    auxiliary RoI loss)."""

    def __init__(self, hidden_size: int, num_classes: int, dropout: float = 0.1, layout: str = "project",
                 hidden_act: str = "gelu"):
        super().__init__()
        check_layout(layout)
        self.num_classes = int(num_classes)
        self.transform = (PredictionTransform(hidden_size, hidden_act, layer_norm_eps=None) if layout == "released"
                          else None)
        self.dropout = nn.Dropout(dropout)
        self.classifier = nn.Linear(hidden_size, num_classes)
        init_new_parameters(self)

    def forward(self, output, batch) -> torch.Tensor:
        """[B, R, num_classes] logits of every box slot."""
        rois = output.visual_states
        if self.transform is not None:
            rois = self.transform(rois)
        return self.classifier(self.dropout(rois))

    @staticmethod
    def loss(logits: torch.Tensor, box_classes: torch.Tensor) -> torch.Tensor:
        """Cross entropy over boxes with a class; box 0 / padding carry IGNORE_INDEX."""
        if not bool((box_classes != IGNORE_INDEX).any()):
            return logits.sum() * 0.0
        return F.cross_entropy(logits.flatten(0, 1), box_classes.flatten(), ignore_index=IGNORE_INDEX)


class VcrData:
    """<Question, Answer, Image> (Q->A) or <Question+Answer, Rationale, Image> (QA->R) with GT boxes.

    Word positions that name an object take that object's box as their visual feature (their
    `roi_index` points at it); other words take box 0, the whole image. One sample holds the
    four candidate sequences of a question, which share the image and boxes. With `instance_mask_size`
    (the visual network's stage-5 output side), each box carries its object's segmentation mask, which the
    visual network multiplies into the RoI's stage-5 output (released VCR; box 0's mask is all ones). With
    `fixed_canvas` (short, long), every image is padded to that canvas (finetune.<vcr task>.fixed_canvas).
    """

    SPECIAL_TOKENS = 3  # [CLS] A [SEP] B [SEP]

    def __init__(self, items: Sequence[vcr_lib.VcrItem], mode: str, images_dir: str | os.PathLike,
                 tokens: Tokens, object_vocab: list[str], *, max_rois: int, max_text_len: int,
                 images: ImageLoader, with_labels: bool = True, instance_mask_size: int | None = None,
                 fixed_canvas: Sequence[int] | None = None):
        if mode not in ("q2a", "qa2r"):
            raise ValueError(f"unknown VCR mode {mode!r}")
        self.items, self.mode = list(items), mode
        self.images_dir = Path(images_dir)
        self.tokens, self.images = tokens, images
        self.object_index = {name: i for i, name in enumerate(object_vocab)}
        self.max_rois, self.max_text_len = int(max_rois), int(max_text_len)
        self.with_labels = with_labels
        self.instance_mask_size = None if instance_mask_size is None else int(instance_mask_size)
        self.fixed_canvas = None if fixed_canvas is None else tuple(int(v) for v in fixed_canvas)
        self._metadata = functools.lru_cache(maxsize=1024)(vcr_lib.load_vcr_metadata)
        self.dropped_references = 0
        if with_labels:
            unlabeled = [it.annot_id for it in self.items if vcr_lib.candidate_label(it, mode) is None]
            if unlabeled:
                raise ValueError(f"VCR {mode}: {len(unlabeled)} questions have no label, e.g. "
                                 f"{unlabeled[:3]}")

    def __len__(self) -> int:
        return len(self.items)

    def encode_candidate(self, text_a: list, text_b: list, objects: list[str],
                         num_boxes: int) -> InputSequence:
        """One candidate sequence with object references linked to their boxes."""
        ids_a, refs_a = vcr_lib.tokenize_with_refs(self.tokens.tokenizer, text_a, objects)
        ids_b, refs_b = vcr_lib.tokenize_with_refs(self.tokens.tokenizer, text_b, objects)
        budget = self.max_text_len - self.SPECIAL_TOKENS
        ids_a, ids_b = truncate_pair(ids_a, ids_b, budget)
        refs_a, refs_b = refs_a[: len(ids_a)], refs_b[: len(ids_b)]
        seq = self.tokens.sequence(ids_a, ids_b, num_boxes)
        # text layout: [CLS] A [SEP] B [SEP]
        text_refs = [vcr_lib.NO_OBJECT, *refs_a, vcr_lib.NO_OBJECT, *refs_b, vcr_lib.NO_OBJECT]
        for position, obj in enumerate(text_refs):
            assert seq.element_kind[position] == TEXT
            if obj == vcr_lib.NO_OBJECT:
                continue
            if obj + 1 < num_boxes:
                seq.roi_index[position] = obj + 1
            else:
                # the object's box was cut by max_rois; the word keeps the whole-image feature
                self.dropped_references += 1
        return seq

    def sample(self, i: int) -> dict:
        item = self.items[i]
        meta_path = self.images_dir / item.metadata_fn
        meta = self._metadata(meta_path)
        vcr_lib.check_metadata_matches(item, meta, str(meta_path))
        image, boxes = image_and_boxes(self.images, self.images_dir / item.img_fn, meta.boxes,
                                        self.max_rois, (meta.width, meta.height),
                                        f"VCR metadata {meta_path}")
        text_a, choices = vcr_lib.candidate_texts(item, self.mode)
        sequences = [self.encode_candidate(text_a, b, item.objects, len(boxes)) for b in choices]
        box_classes = torch.full((len(boxes),), IGNORE_INDEX, dtype=torch.long)
        for obj, name in enumerate(item.objects[: len(boxes) - 1]):
            box_classes[obj + 1] = self.object_index.get(name, IGNORE_INDEX)
        sample = {"sequences": sequences, "image": image, "boxes": boxes,
                  "box_classes": box_classes, "annot_id": item.annot_id, "image_key": item.img_fn}
        if self.instance_mask_size is not None:
            size = self.instance_mask_size
            masks = [np.ones((size, size), dtype=np.float32)]
            for obj in range(len(boxes) - 1):
                polygons = meta.segms[obj] if meta.segms is not None else []
                masks.append(vcr_lib.instance_mask(polygons, meta.boxes[obj], size))
            sample["instance_masks"] = torch.from_numpy(np.stack(masks))
        label = vcr_lib.candidate_label(item, self.mode)
        sample["label"] = -1 if label is None else int(label)
        return sample

    def collate(self, samples: list[dict]) -> tuple[ModelBatch, dict]:
        """Question-major rows: row 4q + k is candidate k of question q."""
        flat = [{"sequence": seq, "image": s["image"], "boxes": s["boxes"], "instance_masks": s.get("instance_masks")}
                for s in samples for seq in s["sequences"]]
        batch = collate_samples(flat, canvas=self.fixed_canvas)
        num_boxes = batch.boxes.shape[1]
        box_classes = torch.full((len(flat), num_boxes), IGNORE_INDEX, dtype=torch.long)
        for q, s in enumerate(samples):
            n = s["box_classes"].shape[0]
            box_classes[q * vcr_lib.NUM_CANDIDATES:(q + 1) * vcr_lib.NUM_CANDIDATES, :n] = s["box_classes"]
        extras = {"label": torch.tensor([s["label"] for s in samples], dtype=torch.long),
                  "box_classes": box_classes, "annot_id": [s["annot_id"] for s in samples],
                  "image_keys": [s["image_key"] for s in samples for _ in s["sequences"]]}
        return batch, extras
