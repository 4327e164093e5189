"""Pre-training heads: MLM (tied to the word embeddings), masked RoI classification, sentence-image relation."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn

from vlbert_core.utils import load_safetensors, save_safetensors

from .bert_init import load_bert_mlm_head_state, load_bert_state_dict
from .config import VLBertConfig
from .encoder import activation_fn
from .initialization import INIT_STD, copy_tensors, init_new_parameters

# The pre-training heads of a model directory, beside model.safetensors (which holds the model alone): what
# continued pre-training starts from and what the MLM accuracy of a model is measured with. Keys are
# PretrainingHeads' own (mlm.*, roi_cls.*, relationship.*); a head the run did not have is absent.
HEADS_FILE = "heads.safetensors"
HEAD_NAMES = ("mlm", "roi_cls", "relationship")


class PredictionTransform(nn.Module):
    """BERT's prediction-head transform: dense -> activation -> LayerNorm; without the LayerNorm
    (`layer_norm_eps` None) the released MVRC head's transform, which the authors' RefCOCO+ and VCR heads reuse."""

    def __init__(self, hidden_size: int, hidden_act: str, layer_norm_eps: float | None):
        super().__init__()
        self.dense = nn.Linear(hidden_size, hidden_size)
        self.act = activation_fn(hidden_act)
        self.layer_norm = None if layer_norm_eps is None else nn.LayerNorm(hidden_size, eps=layer_norm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.act(self.dense(x))
        return x if self.layer_norm is None else self.layer_norm(x)


class _TiedDecoder(torch.autograd.Function):
    """logits = x W^T + b, as nn.functional.linear, with the weight gradient computed in W's own layout.

    The weight is the word-embedding matrix, whose lookup also sends it a gradient. linear's backward hands
    autograd the vocabulary x hidden weight gradient as a transposed view, which autograd cannot add the
    lookup's gradient to in place: it allocates and writes a third vocabulary x hidden matrix every step.
    Computed here as the contiguous g^T x, the sum is in place; the values are the same products.
    """

    @staticmethod
    @torch.amp.custom_fwd(device_type="cuda")  # backward under the forward's autocast state, as linear's
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        return torch.addmm(bias, x, weight.t())

    @staticmethod
    @torch.amp.custom_bwd(device_type="cuda")
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        # Under CPU autocast (bf16) the forward's addmm ran in the grad's dtype while the saved weight is
        # fp32: the products run in the grad's dtype, as linear's backward does, and each gradient comes
        # back in its input's dtype. Without autocast every cast below is a no-op.
        compute = grad.dtype
        grad_x = (grad @ weight.to(compute)).to(x.dtype) if ctx.needs_input_grad[0] else None
        grad_weight = (grad.t() @ x.to(compute)).to(weight.dtype) if ctx.needs_input_grad[1] else None
        grad_bias = grad.sum(0).to(weight.dtype) if ctx.needs_input_grad[2] else None
        return grad_x, grad_weight, grad_bias


class MLMHead(nn.Module):
    """Vocabulary logits; the decoder matrix is the (shared) word-embedding matrix plus its own bias."""

    def __init__(self, config: VLBertConfig, word_embeddings: nn.Embedding):
        super().__init__()
        self.transform = PredictionTransform(config.hidden_size, config.hidden_act, config.layer_norm_eps)
        self.bias = nn.Parameter(torch.zeros(config.vocab_size))
        # Kept out of this module's parameters (a plain attribute) so the tied matrix is owned once,
        # by the model's embeddings.
        self.__dict__["_word_embeddings"] = word_embeddings

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., H] -> logits [..., vocab]. Callers pass only the positions that have a label (the
        decoder is most of the head's cost), as efficient BERT pre-training does."""
        x = self.transform(hidden)
        return _TiedDecoder.apply(x.reshape(-1, x.shape[-1]), self._word_embeddings.weight,
                                  self.bias).reshape(*x.shape[:-1], self.bias.shape[0])

    def load_bert_state(self, state: dict[str, torch.Tensor]) -> None:
        """BERT's cls.predictions.* weights with that prefix stripped (those the checkpoint has)."""
        copy_tensors(self, state, {"transform.dense.weight": "transform.dense.weight",
                                   "transform.dense.bias": "transform.dense.bias",
                                   "transform.LayerNorm.weight": "transform.layer_norm.weight",
                                   "transform.LayerNorm.bias": "transform.layer_norm.bias", "bias": "bias"},
                     where="BERT MLM head", required=False)


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


def save_pretraining_heads(heads: PretrainingHeads, directory: str | os.PathLike) -> None:
    """Write `heads` to directory/heads.safetensors (the tied MLM decoder stays with the word embeddings)."""
    save_safetensors(heads.state_dict(), Path(directory) / HEADS_FILE)


def read_pretraining_heads(directory: str | os.PathLike,
                           head_names: tuple[str, ...] = HEAD_NAMES) -> dict[str, dict[str, torch.Tensor]]:
    """{head name: its state dict} of directory/heads.safetensors, for the heads it holds; {} without the
    file (a model directory written before heads were saved, or by fine-tuning). `head_names`: the family's
    heads (VL-BERT's by default; vlbert_core.vilbert.pretraining.HEAD_NAMES for ViLBERT's)."""
    path = Path(directory) / HEADS_FILE
    if not path.is_file():
        return {}
    heads: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in load_safetensors(path).items():
        name, _, rest = key.partition(".")
        if name not in head_names or not rest:
            raise ValueError(f"{path}: key {key!r} belongs to no pre-training head {head_names}")
        heads.setdefault(name, {})[rest] = value
    return heads


def load_pretraining_heads(heads: nn.Module, directory: str | os.PathLike,
                           head_names: tuple[str, ...] = HEAD_NAMES) -> dict[str, bool]:
    """Copy the heads saved in `directory` into `heads` (the heads both have, shapes checked); returns which of
    `heads`' heads were loaded. A saved head `heads` lacks is left out (its setting does not train it)."""
    saved = read_pretraining_heads(directory, head_names)
    loaded = {}
    for name in head_names:
        module = getattr(heads, name)
        if module is None:
            continue
        state = saved.get(name)
        loaded[name] = state is not None
        if state is None:
            continue
        own = module.state_dict()
        if set(own) != set(state):
            raise ValueError(f"{Path(directory) / HEADS_FILE}: head {name!r} has keys {sorted(state)}, the model's "
                             f"has {sorted(own)}")
        copy_tensors(module, state, {key: key for key in state}, where=f"{Path(directory) / HEADS_FILE} head {name!r}")
    return loaded
