"""ViLBERT's two-stream encoder: BERT layers over the words, BERT-like layers over the regions, and co-attention
("connection") layers where each stream attends over the other, interleaved as the authors' BertEncoder does.

The text and visual layers are this project's BERT layer (models/common/encoder.py EncoderLayer), which
computes what the authors' BertLayer / BertImageLayer compute (post-LayerNorm, erf GELU, scaled dot-product
attention); only the widths differ, given by `LayerSizes`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..common.encoder import EncoderLayer, activation_fn

from .config import ViLBertConfig


@dataclass(frozen=True)
class LayerSizes:
    """One stream's widths: the fields EncoderLayer reads from a config."""

    hidden_size: int
    num_attention_heads: int
    intermediate_size: int
    hidden_act: str
    hidden_dropout_prob: float
    attention_probs_dropout_prob: float
    layer_norm_eps: float


def text_sizes(config: ViLBertConfig) -> LayerSizes:
    return LayerSizes(config.hidden_size, config.num_attention_heads, config.intermediate_size, config.hidden_act,
                      config.hidden_dropout_prob, config.attention_probs_dropout_prob, config.layer_norm_eps)


def visual_sizes(config: ViLBertConfig) -> LayerSizes:
    return LayerSizes(config.v_hidden_size, config.v_num_attention_heads, config.v_intermediate_size,
                      config.v_hidden_act, config.v_hidden_dropout_prob, config.v_attention_probs_dropout_prob,
                      config.layer_norm_eps)


class FeedForward(nn.Module):
    """A BERT layer's second half: x + Dropout(W2 act(W1 x)) -> LayerNorm."""

    def __init__(self, sizes: LayerSizes):
        super().__init__()
        self.intermediate = nn.Linear(sizes.hidden_size, sizes.intermediate_size)
        self.output = nn.Linear(sizes.intermediate_size, sizes.hidden_size)
        self.norm = nn.LayerNorm(sizes.hidden_size, eps=sizes.layer_norm_eps)
        self.dropout = nn.Dropout(sizes.hidden_dropout_prob)
        self.act = activation_fn(sizes.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x + self.dropout(self.output(self.act(self.intermediate(x)))))


class BiAttention(nn.Module):
    """The regions' queries attend over the words and the words' queries over the regions, in bi_hidden_size
    wide heads (the authors' BertBiAttention: their query1/key1/value1 project the regions, query2/key2/value2
    the words)."""

    def __init__(self, config: ViLBertConfig):
        super().__init__()
        bi = config.bi_hidden_size
        self.num_heads = config.bi_num_attention_heads
        self.visual_query = nn.Linear(config.v_hidden_size, bi)
        self.visual_key = nn.Linear(config.v_hidden_size, bi)
        self.visual_value = nn.Linear(config.v_hidden_size, bi)
        self.text_query = nn.Linear(config.hidden_size, bi)
        self.text_key = nn.Linear(config.hidden_size, bi)
        self.text_value = nn.Linear(config.hidden_size, bi)
        # as the authors: the words' attention over the regions drops with the visual stream's rate, the regions'
        # attention over the words with the text stream's
        self.text_attention_dropout = config.v_attention_probs_dropout_prob
        self.visual_attention_dropout = config.attention_probs_dropout_prob

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        return x.view(batch, length, self.num_heads, width // self.num_heads).transpose(1, 2)

    def _attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attend: torch.Tensor,
                dropout: float) -> torch.Tensor:
        q, k, v = self._heads(query), self._heads(key), self._heads(value)
        context = F.scaled_dot_product_attention(q, k, v, attn_mask=attend, dropout_p=dropout if self.training else 0.0,
                                                 scale=1.0 / math.sqrt(q.shape[-1]))
        batch, _, length, _ = context.shape
        return context.transpose(1, 2).reshape(batch, length, -1)

    def forward(self, visual: torch.Tensor, visual_attend: torch.Tensor, text: torch.Tensor,
                text_attend: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """visual [B, R, v_hidden], text [B, T, hidden]; *_attend Bool [B, 1, 1, length], True on the keys that may
        be attended to. Returns (the regions' context [B, R, bi], the words' context [B, T, bi])."""
        visual_context = self._attend(self.visual_query(visual), self.text_key(text), self.text_value(text),
                                      text_attend, self.visual_attention_dropout)
        text_context = self._attend(self.text_query(text), self.visual_key(visual), self.visual_value(visual),
                                    visual_attend, self.text_attention_dropout)
        return visual_context, text_context


class CoAttentionLayer(nn.Module):
    """One co-attention layer (the authors' BertConnectionLayer): BiAttention, then per stream the projection of
    its context back to the stream's width with a residual LayerNorm, then the stream's feed-forward block."""

    def __init__(self, config: ViLBertConfig):
        super().__init__()
        self.attention = BiAttention(config)
        self.visual_attention_output = nn.Linear(config.bi_hidden_size, config.v_hidden_size)
        self.visual_attention_norm = nn.LayerNorm(config.v_hidden_size, eps=config.layer_norm_eps)
        self.visual_dropout = nn.Dropout(config.v_hidden_dropout_prob)
        self.text_attention_output = nn.Linear(config.bi_hidden_size, config.hidden_size)
        self.text_attention_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.text_dropout = nn.Dropout(config.hidden_dropout_prob)
        self.visual_feed_forward = FeedForward(visual_sizes(config))
        self.text_feed_forward = FeedForward(text_sizes(config))

    def forward(self, visual: torch.Tensor, visual_attend: torch.Tensor, text: torch.Tensor,
                text_attend: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        visual_context, text_context = self.attention(visual, visual_attend, text, text_attend)
        visual = self.visual_attention_norm(visual + self.visual_dropout(self.visual_attention_output(visual_context)))
        text = self.text_attention_norm(text + self.text_dropout(self.text_attention_output(text_context)))
        return self.visual_feed_forward(visual), self.text_feed_forward(text)


class ViLBertEncoder(nn.Module):
    """num_hidden_layers text layers, v_num_hidden_layers visual layers and one co-attention layer per
    (v_biattention_id[k], t_biattention_id[k]) pair.

    Before co-attention layer k, the text stream runs its layers up to (not including) t_biattention_id[k] and
    the visual stream its layers up to v_biattention_id[k]; after the last one each stream runs its remaining
    layers. Released (t ids 6..11, v ids 0..5, 12 and 6 layers): text layers 0-5, co-attention 0, then
    (text layer 6 + k - 1, visual layer k - 1, co-attention k) for k = 1..5, then text layer 11 and visual layer 5.
    """

    def __init__(self, config: ViLBertConfig):
        super().__init__()
        self.text_layers = nn.ModuleList(EncoderLayer(text_sizes(config)) for _ in range(config.num_hidden_layers))
        self.visual_layers = nn.ModuleList(EncoderLayer(visual_sizes(config))
                                           for _ in range(config.v_num_hidden_layers))
        self.coattention_layers = nn.ModuleList(CoAttentionLayer(config)
                                                for _ in range(config.num_coattention_layers))
        self.t_biattention_id = list(config.t_biattention_id)
        self.v_biattention_id = list(config.v_biattention_id)
        self.with_coattention = config.with_coattention

    def forward(self, text: torch.Tensor, text_mask: torch.Tensor, visual: torch.Tensor,
                visual_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """text [B, T, hidden] with text_mask Bool [B, T]; visual [B, R, v_hidden] with visual_mask Bool [B, R].
        Returns the last text and visual states."""
        text_attend = text_mask[:, None, None, :].to(torch.bool)
        visual_attend = visual_mask[:, None, None, :].to(torch.bool)
        t_start = v_start = 0
        for k, (v_end, t_end) in enumerate(zip(self.v_biattention_id, self.t_biattention_id)):
            for layer in self.text_layers[t_start:t_end]:
                text = layer(text, text_attend)
            for layer in self.visual_layers[v_start:v_end]:
                visual = layer(visual, visual_attend)
            if self.with_coattention:
                visual, text = self.coattention_layers[k](visual, visual_attend, text, text_attend)
            t_start, v_start = t_end, v_end
        for layer in self.text_layers[t_start:]:
            text = layer(text, text_attend)
        for layer in self.visual_layers[v_start:]:
            visual = layer(visual, visual_attend)
        return text, visual
