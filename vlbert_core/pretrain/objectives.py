"""A model with its pre-training heads, computing the losses and accuracies of the active tasks: VL-BERT's
(`VLBertForPretraining`) and ViLBERT's (`ViLBertForPretraining`), on the same batches (data.PretrainBatch)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from vlbert_core.model import IMG, PretrainingHeads, VLBertModel
from vlbert_core.model.heads import load_pretraining_heads
from vlbert_core.model.inputs import IGNORE_INDEX

from .data import PretrainBatch
from .settings import PretrainSetting


TASK_NAMES = ("mlm", "mlm_text", "roi", "rel")


def soft_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Per row: -sum_c t_c log softmax(logits)_c, with each target row renormalised to sum 1."""
    targets = targets / targets.sum(-1, keepdim=True).clamp(min=1e-12)
    return -(targets * F.log_softmax(logits, dim=-1)).sum(-1)


def _targets(batch: PretrainBatch) -> dict[str, torch.Tensor]:
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
    targets = _targets(batch)
    return torch.stack([torch.zeros((), device=batch.mlm_labels.device) if targets[name] is None
                        else targets[name].sum().float() for name in TASK_NAMES])


class TaskLosses:
    """The losses and accuracies of one step's active tasks, each a sum over its targets divided by its
    normaliser (see VLBertForPretraining), and their total under "loss"."""

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

    def result(self) -> dict[str, torch.Tensor]:
        return {**self.out, "loss": torch.stack(self.losses).sum()}


class VLBertForPretraining(nn.Module):
    """forward(batch) -> {name: scalar tensor}: "loss" (the sum that is trained) and, for each active task,
    its loss and accuracy. Keys present = tasks active in the setting: mlm_loss/mlm_acc (captions, Task 1),
    mlm_text_loss/mlm_text_acc (text corpus), roi_loss/roi_acc (Task 2), rel_loss/rel_acc (sentence-image
    relationship).

    Each loss is a sum over the task's targets divided by `normalisers[task]` (default: the batch's own
    target count, a plain mean). Under DDP the loop passes the global count / world size, so that the
    gradients DDP averages over ranks are exactly those of one process on the global batch (a mean of
    per-rank means would weight the targets of a rank with few of them more).
    """

    def __init__(self, model: VLBertModel, setting: PretrainSetting):
        super().__init__()
        self.model = model
        self.setting = setting
        self.heads = PretrainingHeads(model.config, model.word_embeddings(), masked_roi_cls=setting.masked_roi_cls,
                                      relationship=setting.relationship)

    def load_heads(self, directory) -> dict[str, bool]:
        """The heads saved in `directory` (heads.safetensors) that this setting trains; returns which were there."""
        return load_pretraining_heads(self.heads, directory)

    def forward(self, batch: PretrainBatch, normalisers: torch.Tensor | None = None,
                roi_features: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """`normalisers`: Float [len(TASK_NAMES)] (see the class); `roi_features`: precomputed visual network
        output for frozen settings (see VLBertModel.encode)."""
        inputs = batch.inputs
        # one pass: the encoder runs its projections on the real elements only (model/encoder.py PackedLayout),
        # so short <Caption, Image> rows cost no padding up to the <Text, ∅> rows' length
        hidden = self.model.encode(inputs, roi_features=roi_features).sequence_output
        targets = _targets(batch)
        if normalisers is None:
            normalisers = target_counts(batch)
        book = TaskLosses(normalisers)
        add = book.add

        # MLM: one head pass over every masked position, reported separately for captions and text.
        any_mlm = targets["mlm"] | targets["mlm_text"]
        logits = self.heads.mlm(hidden[any_mlm]).float()
        labels = batch.mlm_labels[any_mlm]
        per_token = F.cross_entropy(logits, labels, reduction="none")
        correct = logits.argmax(-1) == labels
        row_has_image = targets["mlm"][any_mlm]
        for name, group, active in (("mlm", row_has_image, self.setting.mlm_visual),
                                    ("mlm_text", ~row_has_image, self.setting.text_corpus)):
            if active:
                add(name, per_token[group], correct[group])

        if self.heads.roi_cls is not None:
            selected = targets["roi"] if targets["roi"] is not None else torch.zeros_like(inputs.attention_mask)
            roi_logits = self.heads.roi_cls(hidden[selected]).float()
            if targets["roi"] is not None:
                sample_idx = selected.nonzero(as_tuple=True)[0]
                roi_targets = batch.roi_labels[sample_idx, inputs.roi_index[selected]]
            else:
                roi_targets = roi_logits.new_zeros(roi_logits.shape)
            add("roi", soft_cross_entropy(roi_logits, roi_targets), roi_logits.argmax(-1) == roi_targets.argmax(-1))

        if self.heads.relationship is not None:
            has_label = targets["rel"]
            rel_logits = self.heads.relationship(hidden[:, 0][has_label]).float()
            rel_labels = batch.relationship_labels[has_label]
            add("rel", F.cross_entropy(rel_logits, rel_labels, reduction="none"), rel_logits.argmax(-1) == rel_labels)

        return book.result()


class ViLBertForPretraining(nn.Module):
    """ViLBERT's two pre-training objectives on the same batches as VL-BERT's (forward as
    VLBertForPretraining's, same keys):
    - masked multi-modal modelling: MLM on the caption words (mlm_loss/mlm_acc), and each masked region's
      detector class distribution predicted from its visual state (roi_loss/roi_acc; soft cross-entropy, which
      differs from ViLBERT's KL divergence by the targets' entropy, a constant: same gradients);
    - multi-modal alignment: does the caption belong to the image, from the pooled h_IMG * h_CLS (rel_loss/
      rel_acc; the data's mismatched pairs, as for VL-BERT's setting (c)).
    The setting's switches pick which of them train, as for VL-BERT; ViLBERT has no text-only input, so a
    setting with the text corpus is refused.
    """

    def __init__(self, model, setting: PretrainSetting):
        super().__init__()
        from vlbert_core.vilbert.pretraining import ViLBertPretrainingHeads

        if setting.text_corpus:
            raise ValueError(f"pre-training setting {setting.name!r}: ViLBERT has no <Text, ∅> input; its "
                             "settings train on <Caption, Image> pairs only")
        self.model = model
        self.setting = setting
        self.heads = ViLBertPretrainingHeads(model.config, model.word_embeddings())

    def load_heads(self, directory) -> dict[str, bool]:
        """The heads saved in `directory` (heads.safetensors); returns which were there."""
        from vlbert_core.vilbert.pretraining import HEAD_NAMES

        return load_pretraining_heads(self.heads, directory, HEAD_NAMES)

    def forward(self, batch: PretrainBatch, normalisers: torch.Tensor | None = None,
                roi_features: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        from vlbert_core.vilbert.pretraining import ALIGNED_INDEX

        output = self.model.encode(batch.inputs, roi_features=roi_features)
        if normalisers is None:
            normalisers = target_counts(batch)
        book = TaskLosses(normalisers)

        if self.setting.mlm_visual:
            words = batch.mlm_labels != IGNORE_INDEX
            logits = self.heads.mlm(output.text_states[words]).float()
            labels = batch.mlm_labels[words]
            book.add("mlm", F.cross_entropy(logits, labels, reduction="none"), logits.argmax(-1) == labels)

        if self.setting.masked_roi_cls:
            selected = (torch.zeros_like(output.visual_mask) if batch.roi_selected is None
                        else batch.roi_selected & output.visual_mask)
            region_logits = self.heads.region(output.visual_states[selected]).float()
            targets = (region_logits.new_zeros(region_logits.shape) if batch.roi_labels is None
                       else batch.roi_labels[selected])
            book.add("roi", soft_cross_entropy(region_logits, targets),
                     region_logits.argmax(-1) == targets.argmax(-1))

        if self.setting.relationship:
            has_label = batch.relationship_labels != IGNORE_INDEX
            align_logits = self.heads.alignment(output.pooled[has_label]).float()
            # the data's label is 1 for a matched pair; ViLBERT's logit ALIGNED_INDEX is "matched"
            matched = batch.relationship_labels[has_label] == 1
            align_labels = torch.where(matched, ALIGNED_INDEX, 1 - ALIGNED_INDEX)
            book.add("rel", F.cross_entropy(align_logits, align_labels, reduction="none"),
                     align_logits.argmax(-1) == align_labels)
        return book.result()


# model_type -> the module that pre-trains a model of that family
PRETRAINING_MODULES = {"vlbert": VLBertForPretraining, "vilbert": ViLBertForPretraining}


def pretraining_module(model, setting: PretrainSetting) -> nn.Module:
    """The model with the pre-training heads of its family, for `setting`."""
    if model.model_type not in PRETRAINING_MODULES:
        raise ValueError(f"no pre-training for model type {model.model_type!r}; known: {list(PRETRAINING_MODULES)}")
    return PRETRAINING_MODULES[model.model_type](model, setting)
