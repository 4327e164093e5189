"""BERT's initialisation of the parameters that do not come from a checkpoint (VL-BERT's new
embeddings, the pre-training heads and the task heads)."""

from __future__ import annotations

from torch import nn

INIT_STD = 0.02  # BERT's initializer_range


def init_new_parameters(module: nn.Module, std: float = INIT_STD) -> None:
    """Linear and Embedding weights ~ N(0, std), biases 0, LayerNorm 1 and 0, in `module.modules()`
    order (the order fixes which random numbers each weight takes)."""
    for m in module.modules():
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=std)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, std=std)
        elif isinstance(m, nn.LayerNorm):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)
