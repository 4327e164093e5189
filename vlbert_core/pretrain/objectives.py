"""What every family's pre-training module (a Family's pretraining_module: the model with its pre-training heads,
computing the losses and accuracies of the active tasks, on the same batches, data.PretrainBatch) shares: the
task names, the targets of a batch, the loss book, and the registry's way to the family's module."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from vlbert_core.models.common.inputs import IGNORE_INDEX, IMG
from vlbert_core.models.registry import family

from .data import PretrainBatch
from .settings import PretrainSetting


TASK_NAMES = ("mlm", "mlm_text", "roi", "rel")


def soft_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Per row: -sum_c t_c log softmax(logits)_c, with each target row renormalised to sum 1."""
    targets = targets / targets.sum(-1, keepdim=True).clamp(min=1e-12)
    return -(targets * F.log_softmax(logits, dim=-1)).sum(-1)


def soft_target_entropy(targets: torch.Tensor) -> torch.Tensor:
    """Per row: -sum_c t_c log t_c of the renormalised target row (0 log 0 = 0). soft_cross_entropy minus it
    is the KL divergence KL(t || softmax(logits)), the value ViLBERT's code logs for its region loss."""
    targets = targets / targets.sum(-1, keepdim=True).clamp(min=1e-12)
    return -torch.special.xlogy(targets, targets).sum(-1)


def task_targets(batch: PretrainBatch) -> dict[str, torch.Tensor]:
    """Bool masks of each task's targets: MLM positions of image rows / of text rows [B, L], selected
    [IMG] elements [B, L] (None when the batch has no image), labelled relationship rows [B]."""
    inputs = batch.inputs
    has_label = batch.mlm_labels != IGNORE_INDEX
    row_has_image = inputs.has_image[:, None]
    targets = {"mlm": has_label & row_has_image, "mlm_text": has_label & ~row_has_image,
               "rel": batch.relationship_labels != IGNORE_INDEX, "roi": None}
    if batch.roi_selected is not None:
        is_img = inputs.element_kind == IMG
        targets["roi"] = torch.gather(batch.roi_selected, 1, inputs.roi_index) & is_img & inputs.attention_mask
    return targets


def target_counts(batch: PretrainBatch) -> torch.Tensor:
    """Float [len(TASK_NAMES)]: the number of targets of each task in the batch."""
    targets = task_targets(batch)
    return torch.stack([torch.zeros((), device=batch.mlm_labels.device) if targets[name] is None
                        else targets[name].sum().float() for name in TASK_NAMES])


class TaskLosses:
    """The losses and accuracies of one step's active tasks, each a sum over its targets divided by its
    normaliser (see models/vlbert/pretraining.py VLBertForPretraining), and their total under "loss"."""

    def __init__(self, normalisers: torch.Tensor):
        self.norm = dict(zip(TASK_NAMES, normalisers.unbind()))
        self.out: dict[str, torch.Tensor] = {}
        self.losses: list[torch.Tensor] = []

    def add(self, name: str, per_target_loss: torch.Tensor, correct: torch.Tensor) -> None:
        # The head runs even on zero targets (an empty input), so its parameters get a (zero) gradient
        # on every rank, as DDP requires. A task without targets anywhere gets a NaN accuracy.
        norm = self.norm[name]
        if float(norm) > 0:
            loss = per_target_loss.sum() / norm
            self.out[f"{name}_acc"] = (correct.float().sum() / norm).detach()
        else:
            loss = per_target_loss.sum() * 0.0
            self.out[f"{name}_acc"] = torch.tensor(float("nan"), device=per_target_loss.device)
        self.out[f"{name}_loss"] = loss
        self.losses.append(loss)

    def monitor(self, name: str, task: str, per_target_value: torch.Tensor) -> None:
        """A value logged beside the losses, normalised as task `task`'s loss, not in the total."""
        norm = self.norm[task]
        self.out[name] = ((per_target_value.sum() / norm) if float(norm) > 0
                          else torch.tensor(float("nan"), device=per_target_value.device)).detach()

    def result(self) -> dict[str, torch.Tensor]:
        return {**self.out, "loss": torch.stack(self.losses).sum()}


def pretraining_module(model, setting: PretrainSetting) -> nn.Module:
    """The model with the pre-training heads of its family (the registry's pretraining_module), for `setting`."""
    try:
        record = family(model.model_type)
    except ValueError as exc:
        raise ValueError(f"no pre-training for model type {model.model_type!r}: {exc}") from None
    return record.load("pretraining_module")(model, setting)
