"""The BERT encoder layer both families stack, ported with attention through torch's
scaled_dot_product_attention, and the names of its tensors in BERT's checkpoints."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


def activation_fn(name: str):
    if name == "gelu":
        return F.gelu  # BERT's exact erf GELU
    if name in ("gelu_new", "gelu_pytorch_tanh", "gelu_fast"):
        return lambda x: F.gelu(x, approximate="tanh")
    if name == "relu":
        return F.relu
    if name in ("silu", "swish"):
        return F.silu
    raise ValueError(f"unsupported hidden_act {name!r}")


class SelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        hidden = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.query = nn.Linear(hidden, hidden)
        self.key = nn.Linear(hidden, hidden)
        self.value = nn.Linear(hidden, hidden)
        self.output = nn.Linear(hidden, hidden)
        self.attention_dropout = config.attention_probs_dropout_prob

    def _split_heads(self, x: torch.Tensor, layout: "PackedLayout | None") -> torch.Tensor:
        if layout is not None:
            x = layout.pad(x)
        batch, length, hidden = x.shape
        return x.view(batch, length, self.num_heads, hidden // self.num_heads).transpose(1, 2)

    def forward(self, hidden_states: torch.Tensor, attend: torch.Tensor,
                layout: "PackedLayout | None" = None) -> torch.Tensor:
        """hidden_states: [B, L, hidden], or with `layout` [N, hidden], the real elements of the padded batch;
        attend: Bool [B, 1, 1, L], True where a key may be attended to. Attention runs in the padded [B, L]
        layout, the projections on what they are given."""
        q, k, v = (self._split_heads(proj(hidden_states), layout) for proj in (self.query, self.key, self.value))
        context = F.scaled_dot_product_attention(
            q, k, v, attn_mask=attend, dropout_p=self.attention_dropout if self.training else 0.0,
            scale=1.0 / math.sqrt(q.shape[-1]))
        batch, _, length, _ = context.shape
        context = context.transpose(1, 2).reshape(batch, length, -1)
        return self.output(context if layout is None else layout.pack(context))


class EncoderLayer(nn.Module):
    """Post-LayerNorm BERT layer: x + Attn -> LN -> x + FFN -> LN. `config`: anything with BERT's layer fields
    (a family's config, or one stream's widths: models/vilbert/encoder.py LayerSizes)."""

    def __init__(self, config):
        super().__init__()
        self.attention = SelfAttention(config)
        self.attention_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.intermediate = nn.Linear(config.hidden_size, config.intermediate_size)
        self.output = nn.Linear(config.intermediate_size, config.hidden_size)
        self.output_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)
        self.act = activation_fn(config.hidden_act)

    def forward(self, x: torch.Tensor, attend: torch.Tensor, layout: "PackedLayout | None" = None) -> torch.Tensor:
        """x: [B, L, hidden], or [N, hidden] packed by `layout` (SelfAttention.forward)."""
        x = self.attention_norm(x + self.dropout(self.attention(x, attend, layout)))
        return self.output_norm(x + self.dropout(self.output(self.act(self.intermediate(x)))))


class PackedLayout:
    """The real elements of a padded batch [B, L, hidden] as one [N, hidden] matrix, and back.

    Everything in a layer but attention treats each element on its own, so the encoder runs it on the N real
    elements only: a batch mixing short <Caption, Image> rows with long <Text, ∅> rows pays for no padding
    there, and each weight gets its gradient from one matrix product. Attention needs the rows, and runs
    padded (its cost grows with L², small beside the projections at BERT's lengths)."""

    def __init__(self, attention_mask: torch.Tensor):
        self.batch, self.length = attention_mask.shape
        flat = attention_mask.reshape(-1)
        self.everything = bool(flat.all())
        self.index = None if self.everything else flat.nonzero(as_tuple=True)[0]

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        """[B, L, hidden] -> [N, hidden]."""
        x = x.reshape(self.batch * self.length, x.shape[-1])
        return x if self.everything else x.index_select(0, self.index)

    def pad(self, x: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [B, L, hidden], zeros at the padding."""
        if not self.everything:
            x = x.new_zeros(self.batch * self.length, x.shape[-1]).index_copy(0, self.index, x)
        return x.view(self.batch, self.length, x.shape[-1])


# The tensors of one BERT encoder layer: (name in BERT's layout, as transformers and the authors' code
# (pytorch_pretrained_bert) both name them, name in this module), each with .weight and .bias.
BERT_LAYER_TENSORS = (("attention.self.query", "attention.query"), ("attention.self.key", "attention.key"),
                      ("attention.self.value", "attention.value"), ("attention.output.dense", "attention.output"),
                      ("attention.output.LayerNorm", "attention_norm"), ("intermediate.dense", "intermediate"),
                      ("output.dense", "output"), ("output.LayerNorm", "output_norm"))


def bert_encoder_key_map(num_layers: int) -> dict[str, str]:
    """transformers BertModel state-dict key -> this module's key, for the first num_layers layers."""
    return {f"encoder.layer.{i}.{bert}.{suffix}": f"encoder.layers.{i}.{ours}.{suffix}"
            for i in range(num_layers) for bert, ours in BERT_LAYER_TENSORS for suffix in ("weight", "bias")}
