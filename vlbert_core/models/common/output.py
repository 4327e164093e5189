"""What every model family gives the task heads, and what a task head needs to know of the model under it.

A family's `encode(batch, roi_features=None, rows_per_image=1)` returns an `EncoderOutput` (or a subclass with
the family's own extras: `VLBertOutput` keeps the whole interleaved sequence); its `head_spec()` returns a
`HeadSpec`. The task heads (vlbert_core/tasks/modeling/) read nothing else, so one task class serves every
family: a sentence-level head reads `pooled`, a region-level head reads `visual_states`, a head that answers at
a word (VL-BERT's VQA `[MASK]`) reads `text_states` where `HeadSpec.answer_readout` says so.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# HeadSpec.answer_readout: where an answer-vocabulary head (VQA) reads its vector
ANSWER_READOUTS = ("mask", "pooled")


@dataclass
class EncoderOutput:
    # [B, L, text_width], aligned with batch.input_ids: position i is the state of batch.input_ids[:, i]. Read it
    # where text_mask is True only; other positions hold whatever the family leaves there.
    text_states: Any
    text_mask: Any       # [B, L] bool: the text elements ([CLS], word pieces, [SEP]s, [MASK])
    # [B, R, visual_width], aligned with batch.boxes: slot r is the state of box r (box 0 the whole image);
    # zeros where visual_mask is False (padded box slots, text-only rows)
    visual_states: Any
    visual_mask: Any     # [B, R] bool
    pooled: Any          # [B, pooled_width]: one vector per sample, the family's sentence-pair readout
    roi_features: Any = None  # [B, R, appearance_dim]: the visual network's output the states were computed from


@dataclass(frozen=True)
class HeadSpec:
    """The widths and conventions of a model's outputs that a task head is built for (`model.head_spec()`)."""

    text_width: int
    visual_width: int
    pooled_width: int
    dropout: float
    hidden_act: str
    layer_norm_eps: float
    layout: str            # models/common/config.py TASK_HEAD_LAYOUTS: which head shapes
    answer_readout: str    # ANSWER_READOUTS: "mask", the text state at the sample's [MASK]; "pooled"

    def __post_init__(self) -> None:
        if self.answer_readout not in ANSWER_READOUTS:
            raise ValueError(f"HeadSpec: answer_readout must be one of {ANSWER_READOUTS}, got {self.answer_readout!r}")
