"""The VCR heads: a `[CLS]` score per candidate, and the auxiliary RoI classification."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from vlbert_core.model.initialization import init_new_parameters

from .common import IGNORE_INDEX, HeadTransform, check_layout, cls_output, roi_outputs


class VCRHead(nn.Module):
    """layout "project": Dropout -> Linear(h, 1) on the `[CLS]` output; layout "released": BERT's pooler
    (Linear(h, h) + tanh, released with_pooler) first, then Dropout -> Linear(h, 1) (CLASSIFIER_TYPE 1fc)."""

    def __init__(self, hidden_size: int, dropout: float = 0.1, layout: str = "project"):
        super().__init__()
        check_layout(layout)
        self.pooler = nn.Linear(hidden_size, hidden_size) if layout == "released" else None
        self.dropout = nn.Dropout(dropout)
        self.score = nn.Linear(hidden_size, 1)
        init_new_parameters(self)

    def forward(self, output, batch, num_candidates: int) -> torch.Tensor:
        """[B_questions, num_candidates] scores; rows of the batch are question-major."""
        pooled = cls_output(output.sequence_output)
        if self.pooler is not None:
            pooled = torch.tanh(self.pooler(pooled))
        scores = self.score(self.dropout(pooled)).squeeze(-1)
        return scores.view(-1, num_candidates)

    @staticmethod
    def loss(scores: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(scores, labels)


class VCRRoIClassifier(nn.Module):
    """layout "project": Dropout -> Linear; layout "released" (CNN_LOSS_TOP): the MVRC head transform
    (Linear(h, h)-GELU) first."""

    def __init__(self, hidden_size: int, num_classes: int, dropout: float = 0.1, layout: str = "project"):
        super().__init__()
        check_layout(layout)
        self.num_classes = int(num_classes)
        self.transform = HeadTransform(hidden_size, layer_norm_eps=None) if layout == "released" else None
        self.dropout = nn.Dropout(dropout)
        self.classifier = nn.Linear(hidden_size, num_classes)
        init_new_parameters(self)

    def forward(self, output, batch) -> torch.Tensor:
        """[B, R, num_classes] logits of every box slot."""
        rois = roi_outputs(output.sequence_output, batch.element_kind, batch.roi_index,
                           batch.boxes.shape[1])
        if self.transform is not None:
            rois = self.transform(rois)
        return self.classifier(self.dropout(rois))

    @staticmethod
    def loss(logits: torch.Tensor, box_classes: torch.Tensor) -> torch.Tensor:
        """Cross entropy over boxes with a class; box 0 / padding carry IGNORE_INDEX."""
        if not bool((box_classes != IGNORE_INDEX).any()):
            return logits.sum() * 0.0
        return F.cross_entropy(logits.flatten(0, 1), box_classes.flatten(), ignore_index=IGNORE_INDEX)
