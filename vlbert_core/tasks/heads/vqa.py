"""The VQA head: answer logits from the `[MASK]` output, BCE on soft scores."""

from __future__ import annotations

from collections import OrderedDict

import torch
import torch.nn.functional as F
from torch import nn

from vlbert_core.model.initialization import init_new_parameters

from .common import HeadTransform, check_layout, mask_output


class VQAHead(nn.Module):
    """layout "project": Dropout-Linear(h, 2h)-GELU-LayerNorm-Dropout-Linear(2h, answers);
    layout "released" (the authors' CLASSIFIER_TYPE 'mlm'): BERT's head transform (Linear(h, h)-GELU-
    LayerNorm) -> Dropout -> Linear(h, answers)."""

    def __init__(self, hidden_size: int, num_answers: int, mask_id: int, dropout: float = 0.1,
                 layer_norm_eps: float = 1e-12, layout: str = "project"):
        super().__init__()
        check_layout(layout)
        self.mask_id = int(mask_id)
        self.num_answers = int(num_answers)
        if layout == "released":
            self.classifier = nn.Sequential(OrderedDict([
                ("transform", HeadTransform(hidden_size, layer_norm_eps=layer_norm_eps)),
                ("dropout", nn.Dropout(dropout)), ("linear", nn.Linear(hidden_size, num_answers))]))
        else:
            # the released '2fc' classifier widens to 1024 for hidden 768; 2 x hidden keeps that ratio roughly
            inner = 2 * hidden_size
            self.classifier = nn.Sequential(
                nn.Dropout(dropout), nn.Linear(hidden_size, inner), nn.GELU(),
                nn.LayerNorm(inner, eps=layer_norm_eps), nn.Dropout(dropout),
                nn.Linear(inner, num_answers))
        init_new_parameters(self)

    def forward(self, output, batch) -> torch.Tensor:
        return self.classifier(mask_output(output.sequence_output, batch.input_ids, self.mask_id))

    def loss(self, logits: torch.Tensor, soft_targets: torch.Tensor) -> torch.Tensor:
        return F.binary_cross_entropy_with_logits(logits, soft_targets) * soft_targets.shape[1]
