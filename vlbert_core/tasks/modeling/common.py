"""What every task head shares: picking outputs out of the sequence, and the initialisation."""

from __future__ import annotations

import torch

from vlbert_core.model.config import SENTENCE_READOUTS
from vlbert_core.model.inputs import IMG, TEXT


def cls_output(sequence_output: torch.Tensor) -> torch.Tensor:
    """[B, hidden]: the `[CLS]` element is always first."""
    return sequence_output[:, 0]


def check_readout(readout: str) -> None:
    if readout not in SENTENCE_READOUTS:
        raise ValueError(f"sentence readout must be one of {SENTENCE_READOUTS}, got {readout!r}")


def sentence_output(sequence_output: torch.Tensor, batch, readout: str) -> torch.Tensor:
    """[B, hidden]: the vector a sentence-level head reads (VLBertConfig.sentence_readout).

    "cls" is the `[CLS]` output. "text_mean" averages the outputs of the sample's text elements (`[CLS]`, the
    word pieces, the `[SEP]`s), padding, `[IMG]` and `[END]` left out: how a checkpoint trained with mean
    pooling (sentence-transformers) makes its sentence vector. The visual elements reach it through attention.
    """
    check_readout(readout)
    if readout == "cls":
        return cls_output(sequence_output)
    weights = ((batch.element_kind == TEXT) & batch.attention_mask).to(sequence_output.dtype)
    return (weights.unsqueeze(-1) * sequence_output).sum(1) / weights.sum(1, keepdim=True)


def mask_output(sequence_output: torch.Tensor, input_ids: torch.Tensor, mask_id: int) -> torch.Tensor:
    """[B, hidden]: the output at the single `[MASK]` token of each sequence."""
    is_mask = input_ids == mask_id
    counts = is_mask.sum(dim=1)
    if not bool((counts == 1).all()):
        bad = (counts != 1).nonzero().flatten().tolist()
        raise ValueError(f"each sequence must hold exactly one [MASK]; samples {bad} hold "
                         f"{counts[bad].tolist()}")
    return sequence_output[is_mask]


def roi_outputs(sequence_output: torch.Tensor, element_kind: torch.Tensor, roi_index: torch.Tensor,
                num_boxes: int) -> torch.Tensor:
    """[B, R, hidden]: the `[IMG]` outputs placed at their box index (zeros for padded boxes)."""
    batch_size, _, hidden = sequence_output.shape
    out = sequence_output.new_zeros(batch_size, num_boxes, hidden)
    sample_idx, position = (element_kind == IMG).nonzero(as_tuple=True)
    box_idx = roi_index[sample_idx, position]
    return out.index_put((sample_idx, box_idx), sequence_output[sample_idx, position])


HEAD_LAYOUTS = ("project", "released")


def check_layout(layout: str) -> None:
    if layout not in HEAD_LAYOUTS:
        raise ValueError(f"task head layout must be one of {HEAD_LAYOUTS}, got {layout!r}")
