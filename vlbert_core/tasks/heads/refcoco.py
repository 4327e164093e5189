"""The RefCOCO+ head: one binary score per RoI."""

from __future__ import annotations

from collections import OrderedDict

import torch
import torch.nn.functional as F
from torch import nn

from vlbert_core.model.initialization import init_new_parameters

from .common import HeadTransform, check_layout, roi_outputs


class RefCOCOHead(nn.Module):
    """layout "project": Dropout-Linear-ReLU-Dropout-Linear; layout "released": the authors' final MLP,
    the MVRC head transform (Linear(h, h)-GELU) -> Dropout -> Linear(h, 1)."""

    def __init__(self, hidden_size: int, dropout: float = 0.1, layout: str = "project"):
        super().__init__()
        check_layout(layout)
        if layout == "released":
            self.mlp = nn.Sequential(OrderedDict([
                ("transform", HeadTransform(hidden_size, layer_norm_eps=None)),
                ("dropout", nn.Dropout(dropout)), ("linear", nn.Linear(hidden_size, 1))]))
        else:
            self.mlp = nn.Sequential(nn.Dropout(dropout), nn.Linear(hidden_size, hidden_size), nn.ReLU(),
                                     nn.Dropout(dropout), nn.Linear(hidden_size, 1))
        init_new_parameters(self)

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
