"""VL-BERT's pre-training heads: MLM (tied to the word embeddings, models/common/heads.py), masked RoI
classification, sentence-image relation."""

from __future__ import annotations

import torch
from torch import nn

from ..common.bert_init import load_bert_mlm_head_state, load_bert_state_dict
from ..common.heads import MLMHead, PredictionTransform
from ..common.initialization import INIT_STD, copy_tensors, init_new_parameters
from .config import VLBertConfig

# PretrainingHeads' heads, their key prefixes in heads.safetensors
HEAD_NAMES = ("mlm", "roi_cls", "relationship")


class MaskedRoIClassificationHead(nn.Module):
    """Class logits (detector classes incl. background) from the [IMG] outputs."""

    def __init__(self, config: VLBertConfig):
        super().__init__()
        self.transform = PredictionTransform(config.hidden_size, config.hidden_act,
                                             config.layer_norm_eps if config.roi_cls_layer_norm else None)
        self.classifier = nn.Linear(config.hidden_size, config.num_object_classes)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.transform(hidden))


class RelationshipHead(nn.Module):
    """Matched / mismatched caption-image logits from [CLS] through BERT's pooler (dense + tanh)."""

    def __init__(self, config: VLBertConfig):
        super().__init__()
        self.pooler = nn.Linear(config.hidden_size, config.hidden_size)
        self.classifier = nn.Linear(config.hidden_size, 2)

    def forward(self, cls_hidden: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.tanh(self.pooler(cls_hidden)))

    def load_bert_pooler(self, bert_state: dict[str, torch.Tensor]) -> bool:
        if "pooler.dense.weight" not in bert_state:
            return False
        copy_tensors(self, bert_state, {"pooler.dense.weight": "pooler.weight", "pooler.dense.bias": "pooler.bias"},
                     where="BERT pooler")
        return True


class PretrainingHeads(nn.Module):
    """The heads of the active pre-training tasks (only those, so DDP sees no unused parameters)."""

    def __init__(self, config: VLBertConfig, word_embeddings: nn.Embedding, *, masked_roi_cls: bool,
                 relationship: bool):
        super().__init__()
        self.mlm = MLMHead(config, word_embeddings)
        self.roi_cls = MaskedRoIClassificationHead(config) if masked_roi_cls else None
        self.relationship = RelationshipHead(config) if relationship else None
        init_new_parameters(self, INIT_STD)

    def load_from_bert(self, spec: str) -> dict[str, bool]:
        """BERT's cls.predictions (if the checkpoint has them) and pooler weights; returns what was loaded."""
        loaded = {"mlm": False, "pooler": False}
        mlm_state = load_bert_mlm_head_state(spec)
        if mlm_state:
            self.mlm.load_bert_state(mlm_state)
            loaded["mlm"] = True
        if self.relationship is not None:
            loaded["pooler"] = self.relationship.load_bert_pooler(load_bert_state_dict(spec))
        return loaded
