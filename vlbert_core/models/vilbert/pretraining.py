"""ViLBERT's pre-training module (its Family's pretraining_module) and where its caption-image head lives (its
Family's alignment_readout)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from vlbert_core.pretrain.data import PretrainBatch
from vlbert_core.pretrain.objectives import TaskLosses, soft_cross_entropy, soft_target_entropy, target_counts
from vlbert_core.pretrain.settings import PretrainSetting

from ..common.heads import AlignmentReadout, load_pretraining_heads
from ..common.inputs import IGNORE_INDEX
from .heads import ALIGNED_INDEX, HEAD_NAMES, AlignmentHead, ViLBertPretrainingHeads
from .model import ViLBertModel


class ViLBertForPretraining(nn.Module):
    """ViLBERT's two pre-training objectives on the same batches as VL-BERT's (forward as
    VLBertForPretraining's, models/vlbert/pretraining.py, same keys):
    - masked multi-modal modelling: MLM on the caption words (mlm_loss/mlm_acc), and each masked region's
      detector class distribution predicted from its visual state (roi_loss/roi_acc; soft cross-entropy, which
      differs from ViLBERT's KL divergence by the targets' entropy, a constant: same gradients; the KL, the
      value the authors' code logs, is logged beside it as roi_kl);
    - multi-modal alignment: does the caption belong to the image, from the pooled h_IMG * h_CLS (rel_loss/
      rel_acc; the data's mismatched pairs, as for VL-BERT's setting (c)).
    The setting's switches pick which of them train, as for VL-BERT; ViLBERT has no text-only input, so a
    setting with the text corpus is refused.
    """

    def __init__(self, model: ViLBertModel, setting: PretrainSetting):
        super().__init__()
        if setting.text_corpus:
            raise ValueError(f"pre-training setting {setting.name!r}: ViLBERT has no <Text, ∅> input; its "
                             "settings train on <Caption, Image> pairs only")
        self.model = model
        self.setting = setting
        self.heads = ViLBertPretrainingHeads(model.config, model.word_embeddings())

    def load_heads(self, directory) -> dict[str, bool]:
        """The heads saved in `directory` (heads.safetensors); returns which were there."""
        return load_pretraining_heads(self.heads, directory, HEAD_NAMES)

    def forward(self, batch: PretrainBatch, normalisers: torch.Tensor | None = None,
                roi_features: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
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
            cross_entropy = soft_cross_entropy(region_logits, targets)
            book.add("roi", cross_entropy, region_logits.argmax(-1) == targets.argmax(-1))
            book.monitor("roi_kl", "roi", cross_entropy.detach() - soft_target_entropy(targets))

        if self.setting.relationship:
            has_label = batch.relationship_labels != IGNORE_INDEX
            align_logits = self.heads.alignment(output.pooled[has_label]).float()
            # the data's label is 1 for a matched pair; ViLBERT's logit ALIGNED_INDEX is "matched"
            matched = batch.relationship_labels[has_label] == 1
            align_labels = torch.where(matched, ALIGNED_INDEX, 1 - ALIGNED_INDEX)
            book.add("rel", F.cross_entropy(align_logits, align_labels, reduction="none"),
                     align_logits.argmax(-1) == align_labels)
        return book.result()


def pooled_vector(output) -> torch.Tensor:
    return output.pooled


# Zero-shot retrieval reads the alignment head (AlignmentHead) on the pooled h_IMG * h_CLS; its ALIGNED_INDEX (0, the
# authors' convention) = matched.
ALIGNMENT_READOUT = AlignmentReadout("alignment", HEAD_NAMES, AlignmentHead, pooled_vector, matched_index=ALIGNED_INDEX)
