"""VQA: the samples <Question, [MASK], Image>, and the head (answer logits from the `[MASK]` text state on
VL-BERT, from the pooled vector on ViLBERT; BCE on soft scores)."""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from vlbert_core.models.common.batch import ModelBatch, collate_samples
from vlbert_core.models.common.heads import PredictionTransform
from vlbert_core.models.common.initialization import init_new_parameters

from ..common import rois_for_key
from ..samples import ImageLoader, Tokens, image_and_boxes, truncate_pair
from ..vqa import VqaQuestion, soft_targets
from .common import VILBERT_BETA_RELEASED, VILBERT_RELEASED, TwoLayerClassifier, answer_vector, check_layout

BETA_INNER_DROPOUT = 0.5   # vilbert_beta's SimpleClassifier(..., 0.5)


class VQAHead(nn.Module):
    """On the vector `readout` picks (common.answer_vector), of width h:
    layout "project": Dropout-Linear(h, 2h)-GELU-LayerNorm-Dropout-Linear(2h, answers) (also ViLBERT's
    SimpleClassifier on h_IMG * h_CLS); layout "released" (the authors' CLASSIFIER_TYPE 'mlm'): BERT's head
    transform (Linear(h, h)-GELU-LayerNorm) -> Dropout -> Linear(h, answers); layout "vilbert_released" (ViLBERT's
    vil_prediction): Dropout -> TwoLayerClassifier(h, 2h, answers), no dropout inside; layout
    "vilbert_beta_released" (the ViLBERT paper's vil_prediction, jiasenlu/vilbert_beta): Dropout -> Linear(h, 2h) ->
    ReLU -> Dropout(0.5) -> Linear(2h, answers) (their weight-normed Linears, folded by the converter)."""

    def __init__(self, hidden_size: int, num_answers: int, mask_id: int, dropout: float = 0.1,
                 layer_norm_eps: float = 1e-12, layout: str = "project", hidden_act: str = "gelu",
                 readout: str = "mask"):
        super().__init__()
        check_layout(layout)
        self.mask_id = int(mask_id)
        self.readout = readout
        self.num_answers = int(num_answers)
        if layout == "released":
            self.classifier = nn.Sequential(OrderedDict([
                ("transform", PredictionTransform(hidden_size, hidden_act, layer_norm_eps=layer_norm_eps)),
                ("dropout", nn.Dropout(dropout)), ("linear", nn.Linear(hidden_size, num_answers))]))
        elif layout == VILBERT_RELEASED:
            self.classifier = nn.Sequential(OrderedDict([
                ("dropout", nn.Dropout(dropout)),
                ("mlp", TwoLayerClassifier(hidden_size, 2 * hidden_size, num_answers, layer_norm_eps))]))
        elif layout == VILBERT_BETA_RELEASED:
            self.classifier = nn.Sequential(OrderedDict([
                ("dropout", nn.Dropout(dropout)), ("dense", nn.Linear(hidden_size, 2 * hidden_size)),
                ("act", nn.ReLU()), ("inner_dropout", nn.Dropout(BETA_INNER_DROPOUT)),
                ("linear", nn.Linear(2 * hidden_size, num_answers))]))
        else:
            # the released '2fc' classifier widens to 1024 for hidden 768; 2 x hidden keeps that ratio roughly
            inner = 2 * hidden_size
            self.classifier = nn.Sequential(
                nn.Dropout(dropout), nn.Linear(hidden_size, inner), nn.GELU(),
                nn.LayerNorm(inner, eps=layer_norm_eps), nn.Dropout(dropout),
                nn.Linear(inner, num_answers))
        init_new_parameters(self)

    def forward(self, output, batch) -> torch.Tensor:
        return self.classifier(answer_vector(output, batch, self.readout, self.mask_id))

    def loss(self, logits: torch.Tensor, soft_targets: torch.Tensor) -> torch.Tensor:
        return F.binary_cross_entropy_with_logits(logits, soft_targets) * soft_targets.shape[1]


class VqaData:
    """<Question, [MASK], Image> with detected RoIs; targets are the soft answer scores."""

    SPECIAL_TOKENS = 4  # [CLS] question [SEP] [MASK] [SEP]: the question gets max_text_len - 4 word pieces

    def __init__(self, questions: Sequence[tuple[VqaQuestion, Path]], rois: dict, rois_source: str,
                 tokens: Tokens, answers: list[str] | None, *, max_rois: int, max_text_len: int,
                 images: ImageLoader):
        self.questions = list(questions)
        self.tokens, self.images = tokens, images
        self.max_rois, self.max_text_len = int(max_rois), int(max_text_len)
        self.answer_index = None if answers is None else {a: i for i, a in enumerate(answers)}
        self.num_answers = 0 if answers is None else len(answers)
        self.rois_source = rois_source
        self.rois = {q.image_key: rois_for_key(rois, q.image_key, rois_source) for q, _ in self.questions}

    def __len__(self) -> int:
        return len(self.questions)

    def sample(self, i: int) -> dict:
        question, image_path = self.questions[i]
        record = self.rois[question.image_key]
        image, boxes = image_and_boxes(self.images, image_path, record.boxes, self.max_rois,
                                        (record.image_w, record.image_h),
                                        f"RoI parquet {self.rois_source} key {question.image_key}")
        ids_a, _ = truncate_pair(self.tokens.ids(question.question), None, self.max_text_len - self.SPECIAL_TOKENS)
        sample = {"sequence": self.tokens.sequence(ids_a, [self.tokens.mask_id], len(boxes)),
                  "image": image, "boxes": boxes, "question_id": question.question_id,
                  "image_key": question.image_key}
        if self.answer_index is not None:
            target = torch.zeros(self.num_answers)
            for index, score in soft_targets(question, self.answer_index).items():
                target[index] = score
            sample["target"] = target
        return sample

    def collate(self, samples: list[dict]) -> tuple[ModelBatch, dict]:
        extras = {"question_id": [s["question_id"] for s in samples],
                  "image_keys": [s["image_key"] for s in samples]}
        if "target" in samples[0]:
            extras["target"] = torch.stack([s["target"] for s in samples])
        return collate_samples(samples), extras
