"""What every task head shares: where a head reads its vector in a model's `EncoderOutput`, and the head layouts.

A head never looks inside a model family's sequence: sentence-level heads read `output.pooled`, region-level
heads `output.visual_states`, and an answer head reads the vector `answer_vector` picks (vlbert_core/models/common/output.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from vlbert_core.models.common.config import TASK_HEAD_LAYOUTS
from vlbert_core.models.common.output import ANSWER_READOUTS, HeadSpec


def mask_output(text_states: torch.Tensor, input_ids: torch.Tensor, mask_id: int) -> torch.Tensor:
    """[B, width]: the text state at the single `[MASK]` token of each sequence."""
    is_mask = input_ids == mask_id
    counts = is_mask.sum(dim=1)
    if not bool((counts == 1).all()):
        bad = (counts != 1).nonzero().flatten().tolist()
        raise ValueError(f"each sequence must hold exactly one [MASK]; samples {bad} hold "
                         f"{counts[bad].tolist()}")
    return text_states[is_mask]


def answer_width(spec: HeadSpec) -> int:
    """The width of the vector `answer_vector` gives a head on a model with this spec."""
    return spec.text_width if spec.answer_readout == "mask" else spec.pooled_width


def answer_vector(output, batch, readout: str, mask_id: int) -> torch.Tensor:
    """[B, width]: what an answer-vocabulary head reads (HeadSpec.answer_readout): the `[MASK]` text state
    (VL-BERT's VQA) or the pooled vector (ViLBERT's h_IMG * h_CLS)."""
    if readout == "mask":
        return mask_output(output.text_states, batch.input_ids, mask_id)
    if readout == "pooled":
        return output.pooled
    raise ValueError(f"answer readout must be one of {ANSWER_READOUTS}, got {readout!r}")


HEAD_LAYOUTS = TASK_HEAD_LAYOUTS
VILBERT_RELEASED = "vilbert_released"
VILBERT_BETA_RELEASED = "vilbert_beta_released"
VILBERT_LAYOUTS = (VILBERT_RELEASED, VILBERT_BETA_RELEASED)   # ViLBERT's released heads, either release


def check_layout(layout: str) -> None:
    if layout not in HEAD_LAYOUTS:
        raise ValueError(f"task head layout must be one of {HEAD_LAYOUTS}, got {layout!r}")


class TwoLayerClassifier(nn.Module):
    """Linear(in, inner) -> GELU (erf) -> LayerNorm -> Linear(inner, out), no dropout inside: the classifier of
    ViLBERT's released answer heads (vilbert-multi-task's SimpleClassifier: VQA, GQA, NLVR2)."""

    def __init__(self, in_width: int, inner_width: int, out_width: int, layer_norm_eps: float = 1e-12):
        super().__init__()
        self.dense = nn.Linear(in_width, inner_width)
        self.layer_norm = nn.LayerNorm(inner_width, eps=layer_norm_eps)
        self.linear = nn.Linear(inner_width, out_width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(self.layer_norm(F.gelu(self.dense(x))))


# what the authors' VILBertForVLTasks adds to a padded region's score (vision_logit): -10000, not -inf
PADDED_REGION_SCORE = -10000.0
