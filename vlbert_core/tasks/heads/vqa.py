"""The VQA head: answer logits from the `[MASK]` output, BCE on soft scores."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .common import init_linear, mask_output


class VQAHead(nn.Module):
    def __init__(self, hidden_size: int, num_answers: int, mask_id: int, dropout: float = 0.1,
                 layer_norm_eps: float = 1e-12):
        super().__init__()
        self.mask_id = int(mask_id)
        self.num_answers = int(num_answers)
        # the released classifier widens to 2048 for hidden 768; 2 x hidden keeps that ratio roughly
        inner = 2 * hidden_size
        self.classifier = nn.Sequential(
            nn.Dropout(dropout), nn.Linear(hidden_size, inner), nn.GELU(),
            nn.LayerNorm(inner, eps=layer_norm_eps), nn.Dropout(dropout),
            nn.Linear(inner, num_answers))
        init_linear(self)

    def forward(self, output, batch) -> torch.Tensor:
        return self.classifier(mask_output(output.sequence_output, batch.input_ids, self.mask_id))

    def loss(self, logits: torch.Tensor, soft_targets: torch.Tensor) -> torch.Tensor:
        return F.binary_cross_entropy_with_logits(logits, soft_targets) * soft_targets.shape[1]
