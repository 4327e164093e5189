"""Every task head of ViLBERT's released fine-tuned models (facebookresearch/vilbert-multi-task VILBertForVLTasks:
the multi-task `multi_task_model.bin` and its per-task fine-tuned files all hold all of them), in one module, so
that a converted checkpoint keeps each of its heads (task_heads.safetensors beside the model).

Where this pipeline has the task, the head is the shared task class's own head in the "vilbert_released" layout,
so its weights load into that task's head unchanged:
- `vqa` (their vil_prediction, VQA's 3,129 answers): tasks/modeling/vqa.py VQAHead on the pooled vector;
- `pair_score` (their vil_logit, the VCR candidates' and retrieval pairs' score): tasks/modeling/retrieval.py
  PairScoreHead, which is also VCR's VCRHead in this layout (Dropout -> Linear(bi, 1));
- `region_score` (their vision_logit, RefCOCO+ / grounding, one score per region, padding at -10000):
  tasks/modeling/refcoco.py RefCOCOHead.
Where it has none, the head is here only (converted and loadable; no task trains or evaluates it yet):
- `gqa` (vil_prediction_gqa, GQA's 1,533 answers): Dropout -> TwoLayerClassifier(bi, 2 bi, 1533);
- `nlvr2` (vil_binary_prediction, NLVR2 / FOIL): rows 2k and 2k + 1 (a sentence with each of its two images)
  -> their pooled vectors side by side -> Dropout -> TwoLayerClassifier(2 bi, 2 bi, 2);
- `entailment` (vil_tri_prediction, SNLI-VE / GuessWhat): Dropout -> Linear(bi, 3);
- `word_score` (linguisic_logit): Dropout -> Linear(hidden, 1) at every text element (their forward computes it;
  no released task reads it).
Each dropout is the authors' one dropout (0.1) on the pooled vector or states before the head.

The ViLBERT paper's single-task fine-tuned models (jiasenlu/vilbert_beta, layout "vilbert_beta_released") have four
of these heads (BETA_HEAD_NAMES): vil_logit, vision_logit and linguisic_logit as above, and a vil_prediction of
its own (VQAHead's "vilbert_beta_released" layout: Linear, ReLU, Dropout(0.5), Linear, as many rows as the task's
labels).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn

from vlbert_core.models.common.initialization import init_new_parameters
from vlbert_core.models.common.output import HeadSpec
from vlbert_core.utils import load_safetensors, save_safetensors

from .common import VILBERT_BETA_RELEASED, VILBERT_LAYOUTS, VILBERT_RELEASED, TwoLayerClassifier
from .refcoco import RefCOCOHead
from .retrieval import PairScoreHead
from .vqa import VQAHead

TASK_HEADS_FILE = "task_heads.safetensors"
VQA_ANSWERS, GQA_ANSWERS = 3129, 1533   # the answer vocabularies the authors' heads are built for
ENTAILMENT_CLASSES = 3                  # SNLI-VE: entailment, neutral, contradiction
HEAD_NAMES = ("vqa", "gqa", "pair_score", "nlvr2", "entailment", "region_score", "word_score")
BETA_HEAD_NAMES = ("vqa", "pair_score", "region_score", "word_score")
# the heads of each release's VILBertForVLTasks (the head layout says which release), and the key of its VQA
# head's output rows (the answers, read off a saved file)
RELEASE_HEADS = {VILBERT_RELEASED: HEAD_NAMES, VILBERT_BETA_RELEASED: BETA_HEAD_NAMES}
VQA_OUTPUT_KEY = {VILBERT_RELEASED: "vqa.classifier.mlp.linear.weight",
                  VILBERT_BETA_RELEASED: "vqa.classifier.linear.weight"}


class PooledClassifier(nn.Module):
    """Dropout -> TwoLayerClassifier on the pooled vector (GQA's answers)."""

    def __init__(self, width: int, num_classes: int, dropout: float, layer_norm_eps: float):
        super().__init__()
        self.dropout = nn.Dropout(dropout)
        self.mlp = TwoLayerClassifier(width, 2 * width, num_classes, layer_norm_eps)

    def forward(self, output, batch) -> torch.Tensor:
        return self.mlp(self.dropout(output.pooled))


class PairedRowsClassifier(nn.Module):
    """NLVR2: [B, bi] pooled vectors, B even, rows 2k and 2k + 1 one example -> [B / 2, 2] logits."""

    def __init__(self, width: int, dropout: float, layer_norm_eps: float):
        super().__init__()
        self.dropout = nn.Dropout(dropout)
        self.mlp = TwoLayerClassifier(2 * width, 2 * width, 2, layer_norm_eps)

    def forward(self, output, batch) -> torch.Tensor:
        pooled = self.dropout(output.pooled)
        if pooled.shape[0] % 2:
            raise ValueError(f"PairedRowsClassifier: {pooled.shape[0]} rows; NLVR2's rows come in pairs (a sentence "
                             "with each of its two images)")
        return self.mlp(pooled.reshape(-1, 2 * pooled.shape[1]))


class LinearScore(nn.Module):
    """Dropout -> Linear(width, out) on the pooled vector (`source` "pooled") or every text state ("text")."""

    def __init__(self, width: int, out_width: int, dropout: float, source: str):
        super().__init__()
        if source not in ("pooled", "text"):
            raise ValueError(f"LinearScore: source must be 'pooled' or 'text', got {source!r}")
        self.source = source
        self.dropout = nn.Dropout(dropout)
        self.linear = nn.Linear(width, out_width)

    def forward(self, output, batch) -> torch.Tensor:
        vectors = output.pooled if self.source == "pooled" else output.text_states
        return self.linear(self.dropout(vectors))


class ViLBertReleasedHeads(nn.Module):
    """The heads of a release (RELEASE_HEADS of `spec.layout`: the seven of vilbert-multi-task, the four of
    vilbert_beta) on a model of `spec` (ViLBertModel.head_spec()); each forward(output, batch) reads an
    EncoderOutput as the task heads do. `vqa_answers`: the VQA head's rows (vilbert_beta's are its task's labels)."""

    def __init__(self, spec: HeadSpec, vqa_answers: int = VQA_ANSWERS):
        super().__init__()
        if spec.layout not in RELEASE_HEADS:
            raise ValueError(f"ViLBertReleasedHeads: head layout {spec.layout!r} is not a ViLBERT release's "
                             f"({list(RELEASE_HEADS)})")
        self.head_names = RELEASE_HEADS[spec.layout]
        eps, dropout = spec.layer_norm_eps, spec.dropout
        # the VQA head reads the pooled vector (readout "pooled"): its mask id is never read
        self.vqa = VQAHead(spec.pooled_width, vqa_answers, mask_id=-1, dropout=dropout, layer_norm_eps=eps,
                           layout=spec.layout, readout="pooled")
        self.pair_score = PairScoreHead(spec.pooled_width, dropout)
        self.region_score = RefCOCOHead(spec.visual_width, dropout, layout=spec.layout)
        self.word_score = LinearScore(spec.text_width, 1, dropout, "text")
        if "gqa" in self.head_names:
            self.gqa = PooledClassifier(spec.pooled_width, GQA_ANSWERS, dropout, eps)
            self.nlvr2 = PairedRowsClassifier(spec.pooled_width, dropout, eps)
            self.entailment = LinearScore(spec.pooled_width, ENTAILMENT_CLASSES, dropout, "pooled")
        init_new_parameters(self)

    def forward(self, output, batch) -> dict[str, torch.Tensor]:
        """Every head's output ({name: logits}); `nlvr2` only when the batch's rows pair up, as the authors'."""
        out = {name: getattr(self, name)(output, batch) for name in self.head_names if name != "nlvr2"}
        if "nlvr2" in self.head_names and output.pooled.shape[0] % 2 == 0:
            out["nlvr2"] = self.nlvr2(output, batch)
        return out


def save_released_heads(heads: ViLBertReleasedHeads, directory: str | os.PathLike) -> Path:
    path = Path(directory) / TASK_HEADS_FILE
    save_safetensors(heads.state_dict(), path)
    return path


def load_released_heads(spec: HeadSpec, directory: str | os.PathLike) -> ViLBertReleasedHeads:
    """The heads of directory/task_heads.safetensors (what `convert vilbert` writes of a VILBertForVLTasks
    checkpoint), every key and shape checked."""
    path = Path(directory) / TASK_HEADS_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no released ViLBERT task heads (written by `python -m vlbert_core.convert "
                                "vilbert` from a fine-tuned VILBertForVLTasks checkpoint)")
    state = load_safetensors(path)
    if spec.layout not in RELEASE_HEADS or VQA_OUTPUT_KEY[spec.layout] not in state:
        raise ValueError(f"{path}: not the released heads of a model whose head layout is {spec.layout!r} (no "
                         f"{VQA_OUTPUT_KEY.get(spec.layout, 'VQA head')!r})")
    heads = ViLBertReleasedHeads(spec, vqa_answers=state[VQA_OUTPUT_KEY[spec.layout]].shape[0])
    own = heads.state_dict()
    missing, unknown = sorted(set(own) - set(state)), sorted(set(state) - set(own))
    wrong = sorted(k for k in set(own) & set(state) if tuple(own[k].shape) != tuple(state[k].shape))
    if missing or unknown or wrong:
        raise ValueError(f"{path}: not the released heads of this model: missing {missing[:5]}, unknown "
                         f"{unknown[:5]}, of other shapes {wrong[:5]}")
    heads.load_state_dict(state, strict=True)
    return heads


def released_task_head(task: str, directory: str | os.PathLike, spec: HeadSpec) -> nn.Module | None:
    """The released head `task` reads (convert/released_heads.py VILBERT_TASK_HEADS) from directory's
    task_heads.safetensors, or None: no such file, no released head of the task, or heads of another layout than
    the released one (`spec.layout`). The VQA head is not taken: its rows are the authors' answers, in their
    order, which a fine-tuning run's answer vocabulary is not."""
    from vlbert_core.convert.released_heads import VILBERT_TASK_HEADS

    if not (Path(directory) / TASK_HEADS_FILE).is_file() or task not in VILBERT_TASK_HEADS or task == "vqa":
        return None
    if spec.layout not in VILBERT_LAYOUTS:
        return None
    return getattr(load_released_heads(spec, directory), VILBERT_TASK_HEADS[task].released_head)
