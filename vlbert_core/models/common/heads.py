"""What the families' pre-training heads share: BERT's prediction transform, the MLM head (tied to the word
embeddings), heads.safetensors and its reader / writer, and where a family's caption-image head lives
(`AlignmentReadout`). Each family's own heads: models/<family>/heads.py."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from vlbert_core.utils import load_safetensors, save_safetensors

from .encoder import activation_fn
from .initialization import copy_tensors

# The pre-training heads of a model directory, beside model.safetensors (which holds the model alone): what
# continued pre-training starts from and what the MLM accuracy of a model is measured with. Keys are
# the family's heads module's own (VL-BERT: mlm.*, roi_cls.*, relationship.*); a head the run did not have is absent.
HEADS_FILE = "heads.safetensors"


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

    def __init__(self, config, word_embeddings: nn.Embedding):
        """`config`: a family's (hidden_size, hidden_act, layer_norm_eps, vocab_size)."""
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


def save_pretraining_heads(heads: nn.Module, directory: str | os.PathLike) -> None:
    """Write `heads` to directory/heads.safetensors (the tied MLM decoder stays with the word embeddings)."""
    save_safetensors(heads.state_dict(), Path(directory) / HEADS_FILE)


def read_pretraining_heads(directory: str | os.PathLike,
                           head_names: tuple[str, ...]) -> dict[str, dict[str, torch.Tensor]]:
    """{head name: its state dict} of directory/heads.safetensors, for the heads it holds; {} without the
    file (a model directory written before heads were saved, or by fine-tuning). `head_names`: the family's
    heads (models/<family>/heads.py HEAD_NAMES)."""
    path = Path(directory) / HEADS_FILE
    if not path.is_file():
        return {}
    from .pretrained import check_finite_tensors

    state = load_safetensors(path)
    check_finite_tensors(state, path)   # a NaN weight is refused naming the tensor and the file
    heads: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in state.items():
        name, _, rest = key.partition(".")
        if name not in head_names or not rest:
            raise ValueError(f"{path}: key {key!r} belongs to no pre-training head {head_names}")
        heads.setdefault(name, {})[rest] = value
    return heads


def load_pretraining_heads(heads: nn.Module, directory: str | os.PathLike,
                           head_names: tuple[str, ...]) -> dict[str, bool]:
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


@dataclass(frozen=True)
class AlignmentReadout:
    """Where a family's pre-training "does this caption describe this image" head lives and what it reads (a
    Family's alignment_readout, which zero-shot retrieval reads).

    head: its name in heads.safetensors; head_names: the family's heads (its HEAD_NAMES); build: the head module
    from the model config; vector: what it reads from the EncoderOutput; matched_index: its logit of "matched"."""

    head: str
    head_names: tuple[str, ...]
    build: Callable[[Any], nn.Module]
    vector: Callable[[Any], torch.Tensor]
    matched_index: int
