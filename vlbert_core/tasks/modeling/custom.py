"""Your own classification task (`tasks/custom.py`): the samples <Text, Image> and the classifier head on the
model's pooled vector (Dropout -> Linear, cross-entropy; on VL-BERT the `[CLS]` output, as the authors advise
for a new classification task, jackroos/VL-BERT issue #35)."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from vlbert_core.models.common.batch import ModelBatch, collate_samples
from vlbert_core.models.common.initialization import init_new_parameters
from vlbert_core.models.common.inputs import IGNORE_INDEX

from ..common import rois_for_key
from ..custom import image_key
from ..samples import ImageLoader, Tokens, image_and_boxes, truncate_pair


class ClsClassifierHead(nn.Module):
    """The pooled vector -> Dropout -> Linear(width, labels): one logit per label."""

    def __init__(self, hidden_size: int, num_labels: int, dropout: float = 0.1):
        super().__init__()
        self.dropout = nn.Dropout(dropout)
        self.classifier = nn.Linear(hidden_size, int(num_labels))
        init_new_parameters(self)

    def forward(self, output, batch) -> torch.Tensor:
        return self.classifier(self.dropout(output.pooled))

    @staticmethod
    def loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits, labels)


class CustomData:
    """`[CLS] text [SEP] [IMG]...` with the image's detected RoIs; the target is the label index.

    `rows` are the `ok` rows of `tasks.custom.check_rows` (id, text, label, path); a user's query
    (`CustomClassificationTask.query_data`) has label None and gets the target IGNORE_INDEX (no loss).
    """

    SPECIAL_TOKENS = 2  # [CLS] and [SEP] around the text

    def __init__(self, rows: Sequence[dict], rois: dict, rois_source: str, tokens: Tokens,
                 labels: Sequence[str], *, max_rois: int, max_text_len: int, images: ImageLoader):
        self.rows = list(rows)
        self.tokens, self.images = tokens, images
        self.max_rois, self.max_text_len = int(max_rois), int(max_text_len)
        self.label_index = {label: i for i, label in enumerate(labels)}
        self.rois_source = rois_source
        self.rois = {image_key(r["path"]): rois_for_key(rois, image_key(r["path"]), rois_source) for r in self.rows}

    def __len__(self) -> int:
        return len(self.rows)

    def sample(self, i: int) -> dict:
        row = self.rows[i]
        key = image_key(row["path"])
        record = self.rois[key]
        image, boxes = image_and_boxes(self.images, Path(row["path"]), record.boxes, self.max_rois,
                                        (record.image_w, record.image_h), f"RoI parquet {self.rois_source} key {key}")
        ids, _ = truncate_pair(self.tokens.ids(row["text"]), None, self.max_text_len - self.SPECIAL_TOKENS)
        if row["label"] is not None and row["label"] not in self.label_index:
            raise ValueError(f"custom row {row['id']}: label {row['label']!r} is not one of {list(self.label_index)}")
        target = IGNORE_INDEX if row["label"] is None else self.label_index[row["label"]]
        return {"sequence": self.tokens.sequence(ids, None, len(boxes)), "image": image, "boxes": boxes,
                "target": target, "id": row["id"], "image_key": key}

    def collate(self, samples: list[dict]) -> tuple[ModelBatch, dict]:
        extras = {"id": [s["id"] for s in samples], "image_keys": [s["image_key"] for s in samples],
                  "target": torch.tensor([s["target"] for s in samples], dtype=torch.long)}
        return collate_samples(samples), extras
