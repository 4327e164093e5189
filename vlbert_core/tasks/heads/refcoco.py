"""The RefCOCO+ head: one binary score per RoI."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .common import init_linear, roi_outputs


class RefCOCOHead(nn.Module):
    def __init__(self, hidden_size: int, dropout: float = 0.1):
        super().__init__()
        # the released final MLP: Dropout-Linear-ReLU-Dropout-Linear
        self.mlp = nn.Sequential(nn.Dropout(dropout), nn.Linear(hidden_size, hidden_size), nn.ReLU(),
                                 nn.Dropout(dropout), nn.Linear(hidden_size, 1))
        init_linear(self)

    def forward(self, output, batch) -> torch.Tensor:
        """[B, R] logits; box slots that are not candidates are left to the caller's mask."""
        rois = roi_outputs(output.sequence_output, batch.element_kind, batch.roi_index,
                           batch.boxes.shape[1])
        return self.mlp(rois).squeeze(-1)

    @staticmethod
    def loss(logits: torch.Tensor, labels: torch.Tensor, candidate: torch.Tensor) -> torch.Tensor:
        """BCE over candidate boxes only (box 0, the whole image, and padding are not candidates)."""
        return F.binary_cross_entropy_with_logits(logits[candidate], labels[candidate])

    @staticmethod
    def predict(logits: torch.Tensor, candidate: torch.Tensor) -> torch.Tensor:
        """[B] index of the best-scoring candidate box."""
        return logits.masked_fill(~candidate, float("-inf")).argmax(dim=1)
