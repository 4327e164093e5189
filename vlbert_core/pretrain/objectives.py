"""VL-BERT with its pre-training heads, computing the losses and accuracies of the active tasks."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from vlbert_core.model import IMG, PretrainingHeads, VLBertModel

from .data import PretrainBatch
from .masking import IGNORE_INDEX
from .settings import PretrainSetting


def soft_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean over rows of -sum_c t_c log softmax(logits)_c, with each target row renormalised to sum 1."""
    targets = targets / targets.sum(-1, keepdim=True).clamp(min=1e-12)
    return -(targets * F.log_softmax(logits, dim=-1)).sum(-1).mean()


class VLBertForPretraining(nn.Module):
    """forward(batch) -> {name: scalar tensor}: "loss" (the sum that is trained) and, for each active task,
    its loss and accuracy. Keys present = tasks active in the setting (and present in the batch):
    mlm_loss/mlm_acc (captions, Task 1), mlm_text_loss/mlm_text_acc (text corpus), roi_loss/roi_acc (Task 2),
    rel_loss/rel_acc (sentence-image relationship)."""

    def __init__(self, model: VLBertModel, setting: PretrainSetting):
        super().__init__()
        self.model = model
        self.setting = setting
        self.heads = PretrainingHeads(model.config, model.word_embeddings(), masked_roi_cls=setting.masked_roi_cls,
                                      relationship=setting.relationship)

    def forward(self, batch: PretrainBatch) -> dict[str, torch.Tensor]:
        inputs = batch.inputs
        hidden = self.model(inputs).sequence_output
        out: dict[str, torch.Tensor] = {}
        losses: list[torch.Tensor] = []

        # MLM: one head pass over every masked position, reported separately for captions and text.
        target_pos = batch.mlm_labels != IGNORE_INDEX
        logits = self.heads.mlm(hidden[target_pos]).float()
        labels = batch.mlm_labels[target_pos]
        per_token = F.cross_entropy(logits, labels, reduction="none") if labels.numel() else logits.sum(-1)
        correct = (logits.argmax(-1) == labels).float()
        row_has_image = inputs.has_image[:, None].expand_as(batch.mlm_labels)[target_pos]
        for name, group in (("mlm", row_has_image), ("mlm_text", ~row_has_image)):
            if name == "mlm" and not self.setting.mlm_visual:
                continue
            if name == "mlm_text" and not self.setting.text_corpus:
                continue
            if bool(group.any()):
                loss = per_token[group].mean()
                out[f"{name}_acc"] = correct[group].mean().detach()
            else:  # no word drawn for masking in this batch: a zero that keeps the head in the graph
                loss = logits.sum() * 0.0
                out[f"{name}_acc"] = torch.tensor(float("nan"), device=hidden.device)
            out[f"{name}_loss"] = loss
            losses.append(loss)

        if self.heads.roi_cls is not None:
            is_img = inputs.element_kind == IMG
            selected = torch.gather(batch.roi_selected, 1, inputs.roi_index) & is_img & inputs.attention_mask
            roi_logits = self.heads.roi_cls(hidden[selected]).float()
            sample_idx = selected.nonzero(as_tuple=True)[0]
            targets = batch.roi_labels[sample_idx, inputs.roi_index[selected]]
            if roi_logits.shape[0]:
                loss = soft_cross_entropy(roi_logits, targets)
                out["roi_acc"] = (roi_logits.argmax(-1) == targets.argmax(-1)).float().mean().detach()
            else:
                loss = self.heads.roi_cls(hidden[:, :1]).sum() * 0.0
                out["roi_acc"] = torch.tensor(float("nan"), device=hidden.device)
            out["roi_loss"] = loss
            losses.append(loss)

        if self.heads.relationship is not None:
            has_label = batch.relationship_labels != IGNORE_INDEX
            rel_logits = self.heads.relationship(hidden[:, 0][has_label]).float()
            rel_labels = batch.relationship_labels[has_label]
            loss = F.cross_entropy(rel_logits, rel_labels)
            out["rel_loss"] = loss
            out["rel_acc"] = (rel_logits.argmax(-1) == rel_labels).float().mean().detach()
            losses.append(loss)

        out["loss"] = torch.stack(losses).sum()
        return out
