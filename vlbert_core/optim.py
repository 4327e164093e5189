"""Optimisers and learning-rate schedules of pre-training, fine-tuning and detector training.

A schedule is a function of the 0-based optimiser step that returns a multiplier of the peak lr;
`build_scheduler` turns it into torch's LambdaLR, so the multiplier is applied (and checkpointed) the
same way everywhere.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

STEP_DECAY_FACTOR = 0.1  # step decay: the lr drops 10x at each boundary


@dataclass(frozen=True)
class OptimizerSettings:
    name: str                               # "adamw" | "sgd"
    lr: float                               # the peak lr; schedules multiply it
    weight_decay: float
    momentum: float = 0.9                   # sgd only
    betas: tuple[float, float] = (0.9, 0.999)  # adamw only
    eps: float = 1e-8                       # adamw only
    # False: decay weight matrices only (BERT); True: decay every parameter (the detector's SGD)
    decay_all: bool = False
    fused: bool | None = None               # torch's fused kernels (None: torch's default)

    def __post_init__(self):
        if self.name not in ("adamw", "sgd"):
            raise ValueError(f"optimizer must be 'adamw' or 'sgd', got {self.name!r}")


def parameter_groups(module: nn.Module, weight_decay: float) -> list[dict]:
    """Weight decay on parameters with 2+ dimensions (weight matrices, embeddings) only, not on biases,
    LayerNorm or learned vectors. Order: the decayed group, then the rest, each in `named_parameters` order."""
    decay, no_decay = [], []
    for _, p in module.named_parameters():
        if p.requires_grad:
            (decay if p.ndim >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def scale_group_lr(groups: list[dict], submodule: nn.Module, lr: float) -> list[dict]:
    """Split each group: the parameters of `submodule` move to a copy of it with `lr` (schedules then
    multiply that peak as they do the others). Empty groups are dropped."""
    inside = {id(p) for p in submodule.parameters()}
    out = []
    for group in groups:
        rest = {k: v for k, v in group.items() if k != "params"}
        own = [p for p in group["params"] if id(p) not in inside]
        scaled = [p for p in group["params"] if id(p) in inside]
        out += [{**rest, "params": own}] if own else []
        out += [{**rest, "params": scaled, "lr": lr}] if scaled else []
    return out


def build_optimizer(module: nn.Module, settings: OptimizerSettings,
                    lr_scales: Sequence[tuple[nn.Module, float]] = ()) -> torch.optim.Optimizer:
    """The optimiser over `module`'s trainable parameters; each (submodule, scale) of `lr_scales`
    trains at `scale` x settings.lr."""
    if settings.decay_all:
        groups = [{"params": [p for p in module.parameters() if p.requires_grad]}]
        weight_decay = settings.weight_decay
    else:
        groups = parameter_groups(module, settings.weight_decay)
        weight_decay = 0.0  # every group sets its own
    for submodule, scale in lr_scales:
        if scale != 1.0:
            groups = scale_group_lr(groups, submodule, settings.lr * float(scale))
    if settings.name == "adamw":
        return torch.optim.AdamW(groups, lr=settings.lr, betas=settings.betas, eps=settings.eps,
                                 weight_decay=weight_decay, fused=settings.fused)
    return torch.optim.SGD(groups, lr=settings.lr, momentum=settings.momentum, weight_decay=weight_decay,
                           fused=settings.fused)


def build_scheduler(optimizer: torch.optim.Optimizer,
                    lr_factor: Callable[[int], float]) -> torch.optim.lr_scheduler.LambdaLR:
    """lr of step s = peak lr x lr_factor(s); call `.step()` after each optimiser step."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)


def warmup_linear_decay(step: int, total_steps: int, warmup_steps: int) -> float:
    """Linear warm-up to 1 over `warmup_steps` (the first step already at 1/warmup_steps), then linear
    decay to 0 at `total_steps` (BERT's schedule)."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    return max(0.0, (total_steps - step) / max(1, total_steps - warmup_steps))


def warmup_step_decay(step: int, warmup_steps: int, decay_steps: Sequence[int]) -> float:
    """Linear warm-up as in `warmup_linear_decay`, then x0.1 at each of `decay_steps`."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    return STEP_DECAY_FACTOR ** sum(1 for s in decay_steps if step >= s)


def detectron_step_decay(step: int, warmup_steps: int, decay_steps: Sequence[int],
                         warmup_start_factor: float) -> float:
    """x0.1 at each of `decay_steps`, times Detectron's linear warm-up from `warmup_start_factor` to 1
    over `warmup_steps` (the first step at exactly `warmup_start_factor`)."""
    factor = STEP_DECAY_FACTOR ** sum(1 for s in decay_steps if step >= s)
    if step < warmup_steps:
        alpha = step / warmup_steps
        factor *= warmup_start_factor * (1 - alpha) + alpha
    return factor
