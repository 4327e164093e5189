"""ViLBERT's pre-training heads (the authors' BertPreTrainingHeads): masked words, masked regions, and whether the
caption belongs to the image.

- `mlm`: BERT's MLM head on the text states (models/common/heads.py MLMHead: transform + LayerNorm, decoder
  tied to the word embeddings, own bias);
- `region`: the class distribution of a masked region from its visual state: transform (dense, activation,
  LayerNorm at v_hidden_size) then Linear(v_hidden_size, num_object_classes), the detector's classes incl.
  background (the authors' imagePredictions over v_target_size 1601 Visual Genome classes, trained with KL against
  the detector's class scores);
- `alignment`: 2 logits from the fused pooled vector (`EncoderOutput.pooled`) through dropout; index
  ALIGNED_INDEX = 0 means "this caption describes this image", 1 a caption drawn from another image (the authors'
  label convention: random_cap gives 0 to the true caption, 1 to a random one).

Saved to heads.safetensors beside the model (models/common/heads.py's file name and writer), keys mlm.*, region.*,
alignment.*.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn

from ..common.bert_init import load_bert_mlm_head_state
from ..common.heads import HEADS_FILE, MLMHead, PredictionTransform, load_pretraining_heads
from ..common.initialization import INIT_STD, init_new_parameters
from .config import ViLBertConfig

ALIGNED_INDEX = 0        # alignment logit index of "the caption belongs to the image"
HEAD_NAMES = ("mlm", "region", "alignment")


class RegionHead(nn.Module):
    """[N, v_hidden] -> [N, num_object_classes] logits. The transform's activation is hidden_act, as the authors'
    BertImgPredictionHeadTransform takes it (their v_hidden_act is ignored there)."""

    def __init__(self, config: ViLBertConfig):
        super().__init__()
        self.transform = PredictionTransform(config.v_hidden_size, config.hidden_act, config.layer_norm_eps)
        self.decoder = nn.Linear(config.v_hidden_size, config.num_object_classes)

    def forward(self, visual_states: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.transform(visual_states))


class AlignmentHead(nn.Module):
    """[N, bi_hidden] fused pooled vectors -> [N, 2] logits (ALIGNED_INDEX: caption and image match). The
    dropout is the authors' fixed 0.1, here BERT's hidden_dropout_prob (0.1 in the released config)."""

    def __init__(self, config: ViLBertConfig):
        super().__init__()
        self.dropout = nn.Dropout(config.hidden_dropout_prob)
        self.classifier = nn.Linear(config.bi_hidden_size, 2)

    def forward(self, pooled: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.dropout(pooled))


class ViLBertPretrainingHeads(nn.Module):
    def __init__(self, config: ViLBertConfig, word_embeddings: nn.Embedding):
        super().__init__()
        # MLMHead reads hidden_size, hidden_act, layer_norm_eps and vocab_size, which ViLBertConfig has too
        self.mlm = MLMHead(config, word_embeddings)
        self.region = RegionHead(config)
        self.alignment = AlignmentHead(config)
        init_new_parameters(self, INIT_STD)

    def load_from_bert(self, spec: str) -> bool:
        """BERT's cls.predictions.* into the MLM head, if the checkpoint has them; returns whether it had."""
        state = load_bert_mlm_head_state(spec)
        if state:
            self.mlm.load_bert_state(state)
        return bool(state)


def load_vilbert_pretraining_heads(heads: ViLBertPretrainingHeads, directory: str | os.PathLike) -> None:
    """Copy directory/heads.safetensors (written by save_pretraining_heads) into `heads`: every head, every key,
    shapes checked."""
    loaded = load_pretraining_heads(heads, directory, HEAD_NAMES)
    missing = [name for name, present in loaded.items() if not present]
    if missing:
        raise ValueError(f"{Path(directory) / HEADS_FILE}: not ViLBERT's pre-training heads {HEAD_NAMES}: "
                         f"{missing} missing")
