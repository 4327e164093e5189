"""Predictions of a fine-tuned model on the held-out splits of its task.

Eval tasks: `vcr_q2a`, `vcr_qa2r`, `vqa`, `refcoco_gt` and `refcoco_det` (RefCOCO+ with
ground-truth or detected regions). The fine-tune job runs this right after training, while the
model is in memory, and writes one bundle of predictions; the `evaluate` jobs then score each
(eval task, split) with the official metric (`vlbert_core.tasks.scoring`, torch-free), as an
evaluation server scores a submission.

Prediction rows: VQA `{"question_id", "answer"}` (the submission format); VCR `{"annot_id",
"prediction", "probabilities"}`; RefCOCO+ `{"ref_id", "sent_id", "image_id", "box"}` with the chosen
box in original pixels.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Mapping

import torch
from tqdm import tqdm

from vlbert_core.model import load_tokenizer
from vlbert_core.model.config import visual_pixel_format
from vlbert_core.utils import atomic_path, get_logger, seed_everything

from .finetune import FinetuneModel, build_task_data, load_finetuned, read_task_rois
from .samples import ImageLoader, Tokens, iterate_batches

log = get_logger(__name__)

EVAL_TASKS = {"vcr_q2a": "vcr_q2a", "vcr_qa2r": "vcr_qa2r", "vqa": "vqa",
              "refcoco_gt": "refcoco", "refcoco_det": "refcoco"}


def _predict(model: FinetuneModel, data, batch_size: int, device: str, desc: str):
    """Yield (indices, scores dict on CPU, extras) batch by batch, without gradients."""
    model.eval()
    with torch.no_grad():
        batches = iterate_batches(data, batch_size, shuffle=False)
        for indices, batch, extras in tqdm(batches, total=-(-len(data) // batch_size), desc=desc,
                                           mininterval=5.0):
            out = model.scores(batch.to(device), extras)
            yield indices, {k: v.float().cpu() for k, v in out.items()}, extras


def _write_json(path: Path, payload: Any) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(payload, indent=1) + "\n")


def _predict_vqa(model, data, batch_size, device, answers) -> list[dict]:
    rows = []
    for indices, out, _ in _predict(model, data, batch_size, device, "predict vqa"):
        best = out["logits"].argmax(dim=1).tolist()
        for i, answer_index in zip(indices, best):
            question, _ = data.questions[i]
            rows.append({"question_id": question.question_id, "answer": answers[answer_index]})
    return rows


def _predict_vcr(model, data, batch_size, device, task) -> list[dict]:
    rows = []
    for indices, out, _ in _predict(model, data, batch_size, device, f"predict {task}"):
        # the choice is the argmax of the scores, as the authors' code takes it (softmax can tie
        # two scores that differ)
        choices = out["scores"].argmax(dim=1).tolist()
        probabilities = torch.softmax(out["scores"], dim=1)
        for i, choice, probs in zip(indices, choices, probabilities):
            rows.append({"annot_id": data.items[i].annot_id, "prediction": int(choice),
                         "probabilities": [round(float(p), 6) for p in probs]})
    return rows


def _predict_refcoco(model, data, batch_size, device, eval_task) -> list[dict]:
    rows = []
    for indices, out, extras in _predict(model, data, batch_size, device, f"predict {eval_task}"):
        chosen = model.head.predict(out["logits"], extras["candidate"]).tolist()
        for i, box_index in zip(indices, chosen):
            expr = data.data.expressions[i]
            box = data.candidates[expr.image_id][box_index - 1]  # box 0 is the whole image
            rows.append({"ref_id": expr.ref_id, "sent_id": expr.sent_id, "image_id": expr.image_id,
                         "box": [round(float(v), 2) for v in box]})
    return rows


def predict_splits(model_dir: str | os.PathLike, targets: list[tuple[str, str]], *,
                   sources: Mapping[str, str], model_cfg: Mapping[str, Any],
                   rois_paths: list[str] | tuple = (), seed: int = 0, device: str = "cpu") -> dict:
    """Predictions of the fine-tuned model on every (eval task, split) target.

    Returns {"<eval task>/<split>": rows}; the rows carry no labels, so the metrics
    (`vlbert_core.tasks.scoring`) read the ground truth from the official files themselves.
    """
    seed_everything(seed)
    model, meta = load_finetuned(model_dir)
    model.to(device)
    for eval_task, _ in targets:
        if eval_task not in EVAL_TASKS:
            raise ValueError(f"unknown eval task {eval_task!r} (expected one of {list(EVAL_TASKS)})")
        if EVAL_TASKS[eval_task] != meta["name"]:
            raise ValueError(f"eval task {eval_task} needs a {EVAL_TASKS[eval_task]} "
                             f"model; {model_dir} was fine-tuned on {meta['name']}")
    tokens = Tokens(load_tokenizer(model.vlbert.config.bert_path))
    images = ImageLoader(int(model_cfg["image_max_side"]), pixel_format=visual_pixel_format(model.vlbert.config))
    rois, rois_source = read_task_rois(list(rois_paths))
    batch_size = int(meta["batch_size"])
    task = meta["name"]
    bundle = {}
    for eval_task, split in targets:
        data = build_task_data(
            task, split, sources=sources, tokens=tokens, images=images,
            max_rois=int(model_cfg["max_rois"]), max_text_len=int(meta["max_text_len"]), rois=rois,
            rois_source=rois_source, answers=meta.get("answers"),
            object_names=meta.get("object_names"),
            tracks=(eval_task.removeprefix("refcoco_"),) if task == "refcoco" else ("gt", "det"))
        if len(data) == 0:
            raise ValueError(f"{eval_task} split {split}: no examples to predict")
        if task == "vqa":
            rows = _predict_vqa(model, data, batch_size, device, meta["answers"])
        elif task.startswith("vcr"):
            rows = _predict_vcr(model, data, batch_size, device, task)
        else:
            rows = _predict_refcoco(model, data, batch_size, device, eval_task)
        bundle[f"{eval_task}/{split}"] = rows
        log.info("%s %s: %d predictions", eval_task, split, len(rows))
    return bundle


def write_prediction_bundle(bundle: dict, path: str | os.PathLike, *, model_dir: str | os.PathLike) -> None:
    _write_json(Path(path), {"model_dir": str(model_dir), "predictions": bundle})
