"""Task heads on top of `VLBertModel` outputs, and their losses.

Every head takes the model's `VLBertOutput` and the `VLBertBatch` it came from:
- `VQAHead`: the `[MASK]` output -> Linear-GELU-LayerNorm-Linear -> one logit per answer; BCE on
  the soft targets, multiplied by the number of answers as in the released code.
- `VCRHead`: the `[CLS]` output -> Linear -> one score per candidate sequence.
- `VCRRoIClassifier`: the auxiliary RoI classification with linguistic clues: each `[IMG]`
  output (it has attended to the text) -> Linear -> the box's object-name class.
- `RefCOCOHead`: each `[IMG]` output -> MLP -> one binary score per RoI.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from vlbert_core.model.inputs import IMG

IGNORE_INDEX = -100


def cls_output(sequence_output: torch.Tensor) -> torch.Tensor:
    """[B, hidden]: the `[CLS]` element is always first."""
    return sequence_output[:, 0]


def mask_output(sequence_output: torch.Tensor, input_ids: torch.Tensor, mask_id: int) -> torch.Tensor:
    """[B, hidden]: the output at the single `[MASK]` token of each sequence."""
    is_mask = input_ids == mask_id
    counts = is_mask.sum(dim=1)
    if not bool((counts == 1).all()):
        bad = (counts != 1).nonzero().flatten().tolist()
        raise ValueError(f"VQA sequences must hold exactly one [MASK]; samples {bad} hold "
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


class VQAHead(nn.Module):
    def __init__(self, hidden_size: int, num_answers: int, mask_id: int, dropout: float = 0.1,
                 layer_norm_eps: float = 1e-12):
        super().__init__()
        self.mask_id = int(mask_id)
        self.num_answers = int(num_answers)
        # the released classifier widens to 2048 for hidden 768; 2 x hidden keeps that ratio roughly
        inner = 2 * hidden_size
        self.classifier = nn.Sequential(
            nn.Dropout(dropout), nn.Linear(hidden_size, inner), nn.GELU(),
            nn.LayerNorm(inner, eps=layer_norm_eps), nn.Dropout(dropout),
            nn.Linear(inner, num_answers))
        _init_linear(self)

    def forward(self, output, batch) -> torch.Tensor:
        return self.classifier(mask_output(output.sequence_output, batch.input_ids, self.mask_id))

    def loss(self, logits: torch.Tensor, soft_targets: torch.Tensor) -> torch.Tensor:
        return F.binary_cross_entropy_with_logits(logits, soft_targets) * soft_targets.shape[1]


class VCRHead(nn.Module):
    def __init__(self, hidden_size: int, dropout: float = 0.1):
        super().__init__()
        self.dropout = nn.Dropout(dropout)
        self.score = nn.Linear(hidden_size, 1)
        _init_linear(self)

    def forward(self, output, batch, num_candidates: int) -> torch.Tensor:
        """[B_questions, num_candidates] scores; rows of the batch are question-major."""
        scores = self.score(self.dropout(cls_output(output.sequence_output))).squeeze(-1)
        return scores.view(-1, num_candidates)

    @staticmethod
    def loss(scores: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(scores, labels)


class VCRRoIClassifier(nn.Module):
    def __init__(self, hidden_size: int, num_classes: int, dropout: float = 0.1):
        super().__init__()
        self.num_classes = int(num_classes)
        self.dropout = nn.Dropout(dropout)
        self.classifier = nn.Linear(hidden_size, num_classes)
        _init_linear(self)

    def forward(self, output, batch) -> torch.Tensor:
        """[B, R, num_classes] logits of every box slot."""
        rois = roi_outputs(output.sequence_output, batch.element_kind, batch.roi_index,
                           batch.boxes.shape[1])
        return self.classifier(self.dropout(rois))

    @staticmethod
    def loss(logits: torch.Tensor, box_classes: torch.Tensor) -> torch.Tensor:
        """Cross entropy over boxes with a class; box 0 / padding carry IGNORE_INDEX."""
        if not bool((box_classes != IGNORE_INDEX).any()):
            return logits.sum() * 0.0
        return F.cross_entropy(logits.flatten(0, 1), box_classes.flatten(), ignore_index=IGNORE_INDEX)


class RefCOCOHead(nn.Module):
    def __init__(self, hidden_size: int, dropout: float = 0.1):
        super().__init__()
        # the released final MLP: Dropout-Linear-ReLU-Dropout-Linear
        self.mlp = nn.Sequential(nn.Dropout(dropout), nn.Linear(hidden_size, hidden_size), nn.ReLU(),
                                 nn.Dropout(dropout), nn.Linear(hidden_size, 1))
        _init_linear(self)

    def forward(self, output, batch) -> torch.Tensor:
        """[B, R] logits; box slots that are not candidates are left to the caller's mask."""
        rois = roi_outputs(output.sequence_output, batch.element_kind, batch.roi_index,
                           batch.boxes.shape[1])
        return self.mlp(rois).squeeze(-1)

    @staticmethod
    def loss(logits: torch.Tensor, labels: torch.Tensor, candidate: torch.Tensor) -> torch.Tensor:
        """BCE over candidate boxes only (box 0, the whole image, and padding are not candidates)."""
        return F.binary_cross_entropy_with_logits(logits[candidate], labels[candidate])

    @staticmethod
    def predict(logits: torch.Tensor, candidate: torch.Tensor) -> torch.Tensor:
        """[B] index of the best-scoring candidate box."""
        return logits.masked_fill(~candidate, float("-inf")).argmax(dim=1)


def _init_linear(module: nn.Module, std: float = 0.02) -> None:
    """New parameters ~ N(0, 0.02), biases 0, as BERT initialises."""
    for m in module.modules():
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=std)
            nn.init.zeros_(m.bias)
