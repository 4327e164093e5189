"""VL-BERT's encoder: one stack of BERT layers over the interleaved sequence, run on its real elements only."""

from __future__ import annotations

import torch
from torch import nn

from ..common.encoder import EncoderLayer, PackedLayout
from .config import VLBertConfig


class VLBertEncoder(nn.Module):
    def __init__(self, config: VLBertConfig):
        super().__init__()
        self.layers = nn.ModuleList(EncoderLayer(config) for _ in range(config.num_hidden_layers))

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """x [B, L, hidden] -> [B, L, hidden]; the outputs at padding (attention_mask False) are zeros."""
        attend = attention_mask[:, None, None, :].to(torch.bool)
        layout = PackedLayout(attention_mask)
        x = layout.pack(x)
        for layer in self.layers:
            x = layer(x, attend, layout)
        return layout.pad(x)
