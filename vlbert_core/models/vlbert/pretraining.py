"""VL-BERT's pre-training module (its Family's pretraining_module) and where its caption-image head lives
(its Family's alignment_readout)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from vlbert_core.pretrain.data import PretrainBatch
from vlbert_core.pretrain.objectives import TaskLosses, soft_cross_entropy, target_counts, task_targets
from vlbert_core.pretrain.settings import PretrainSetting

from ..common.heads import AlignmentReadout, load_pretraining_heads
from .heads import HEAD_NAMES, PretrainingHeads, RelationshipHead
from .model import VLBertModel


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
        return load_pretraining_heads(self.heads, directory, HEAD_NAMES)

    def forward(self, batch: PretrainBatch, normalisers: torch.Tensor | None = None,
                roi_features: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """`normalisers`: Float [len(TASK_NAMES)] (see the class); `roi_features`: precomputed visual network
        output for frozen settings (see VLBertModel.encode)."""
        inputs = batch.inputs
        # one pass: the encoder runs its projections on the real elements only (common/encoder.py PackedLayout),
        # so short <Caption, Image> rows cost no padding up to the <Text, ∅> rows' length
        hidden = self.model.encode(inputs, roi_features=roi_features).sequence_output
        targets = task_targets(batch)
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


def cls_state(output) -> torch.Tensor:
    """[B, width]: the text state at position 0, the `[CLS]` element (EncoderOutput.text_states follows input_ids)."""
    return output.text_states[:, 0]


# Zero-shot retrieval reads the sentence-image relationship head (RelationshipHead) on the `[CLS]` output, which
# pre-training reads as the state at position 0 (VLBertForPretraining); label 1 = matched (pretrain/data.py:
# relationship 1 for a true pair, 0 for a mismatched one).
ALIGNMENT_READOUT = AlignmentReadout("relationship", HEAD_NAMES, RelationshipHead, cls_state, matched_index=1)
