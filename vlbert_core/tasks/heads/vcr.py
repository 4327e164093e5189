"""The VCR heads: a `[CLS]` score per candidate, and the auxiliary RoI classification."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .common import IGNORE_INDEX, cls_output, init_linear, roi_outputs


class VCRHead(nn.Module):
    def __init__(self, hidden_size: int, dropout: float = 0.1):
        super().__init__()
        self.dropout = nn.Dropout(dropout)
        self.score = nn.Linear(hidden_size, 1)
        init_linear(self)

    def forward(self, output, batch, num_candidates: int) -> torch.Tensor:
        """[B_questions, num_candidates] scores; rows of the batch are question-major."""
        scores = self.score(self.dropout(cls_output(output.sequence_output))).squeeze(-1)
        return scores.view(-1, num_candidates)

    @staticmethod
    def loss(scores: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(scores, labels)


class VCRRoIClassifier(nn.Module):
    def __init__(self, hidden_size: int, num_classes: int, dropout: float = 0.1):
        super().__init__()
        self.num_classes = int(num_classes)
        self.dropout = nn.Dropout(dropout)
        self.classifier = nn.Linear(hidden_size, num_classes)
        init_linear(self)

    def forward(self, output, batch) -> torch.Tensor:
        """[B, R, num_classes] logits of every box slot."""
        rois = roi_outputs(output.sequence_output, batch.element_kind, batch.roi_index,
                           batch.boxes.shape[1])
        return self.classifier(self.dropout(rois))

    @staticmethod
    def loss(logits: torch.Tensor, box_classes: torch.Tensor) -> torch.Tensor:
        """Cross entropy over boxes with a class; box 0 / padding carry IGNORE_INDEX."""
        if not bool((box_classes != IGNORE_INDEX).any()):
            return logits.sum() * 0.0
        return F.cross_entropy(logits.flatten(0, 1), box_classes.flatten(), ignore_index=IGNORE_INDEX)
