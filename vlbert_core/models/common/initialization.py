"""Where a model's parameters come from: copied from a checkpoint (`copy_tensors`, shapes checked), or BERT's
initialisation for those that do not come from one (VL-BERT's new embeddings, the pre-training heads and the
task heads)."""

from __future__ import annotations

from typing import Mapping

import torch
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


def copy_tensors(module: nn.Module, source: Mapping[str, torch.Tensor], mapping: Mapping[str, str], *, where: str,
                 required: bool = True) -> list[str]:
    """Copy source[src] into `module`'s state tensor `dst` for each (src, dst) of `mapping`, in place.

    Every shape is checked first, so that a wrong checkpoint fails naming `where` and the key and leaves the
    module as it was. A `src` missing from `source` is an error when `required`, else skipped. Returns the
    `dst` keys copied."""
    own = module.state_dict()
    unknown = sorted(dst for dst in mapping.values() if dst not in own)
    if unknown:
        raise KeyError(f"{where}: the model has no tensors {unknown[:8]}")
    missing = [src for src in mapping if src not in source]
    if missing and required:
        raise ValueError(f"{where} lacks {missing[:8]}")
    pairs = [(src, dst) for src, dst in mapping.items() if src in source]
    for src, dst in pairs:
        if tuple(source[src].shape) != tuple(own[dst].shape):
            raise ValueError(f"{where}: {src} has shape {tuple(source[src].shape)}, the model expects "
                             f"{tuple(own[dst].shape)}")
    with torch.no_grad():
        for src, dst in pairs:
            own[dst].copy_(source[src])
    return [dst for _, dst in pairs]
