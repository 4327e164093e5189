"""Evaluation of a fine-tuned model: predictions and the official metric of each eval task.

Eval tasks: `vcr_q2a`, `vcr_qa2r` (accuracy), `vqa` (official VQA accuracy), `refcoco_gt` and
`refcoco_det` (accuracy@0.5 with ground-truth or detected regions). Each (eval task, split)
writes an eval JSON (schema below) and the predictions file it names, both atomically:

    {"task", "metric", "value" (percent), "split", "num_examples", "predictions" (path as given),
     "setting", "schedule", "model_dir", "dataset"}

Predictions: VQA `[{"question_id", "answer"}]` (the submission format); VCR one row per question
`{"annot_id", "label", "prediction", "probabilities"}` (JSON lines when the file name ends in
`.jsonl`, else a JSON list); RefCOCO+ one row per expression with the chosen box in original
pixels and its IoU with the referred box.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import torch
from tqdm import tqdm

from vlbert_core.model import load_tokenizer
from vlbert_core.utils import atomic_path, get_logger, seed_everything

from .finetune import FinetuneModel, build_task_data, load_finetuned, read_task_rois
from .refcoco import refcoco_accuracy
from .samples import ImageLoader, Tokens, iterate_batches
from .vqa import vqa_accuracy

log = get_logger(__name__)

EVAL_TASKS = {"vcr_q2a": "vcr_q2a", "vcr_qa2r": "vcr_qa2r", "vqa": "vqa",
              "refcoco_gt": "refcoco", "refcoco_det": "refcoco"}
METRICS = {"vcr_q2a": "accuracy", "vcr_qa2r": "accuracy", "vqa": "vqa_accuracy",
           "refcoco_gt": "accuracy@0.5", "refcoco_det": "accuracy@0.5"}


@dataclass
class EvalTarget:
    """One eval output: which eval task on which split, and where its two files go."""

    eval_task: str
    split: str
    json_path: Path
    predictions_path: Path


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


def _write_rows(path: Path, rows: list[dict]) -> None:
    """JSON lines for `.jsonl`, otherwise one JSON list; either way one row per line."""
    lines = [json.dumps(r) for r in rows]
    text = "\n".join(lines) + "\n" if path.suffix == ".jsonl" else "[\n" + ",\n".join(lines) + "\n]\n"
    with atomic_path(path) as tmp:
        tmp.write_text(text)


def _eval_vqa(model, data, batch_size, device, answers):
    rows, accuracies = [], []
    for indices, out, _ in _predict(model, data, batch_size, device, "eval vqa"):
        best = out["logits"].argmax(dim=1).tolist()
        for i, answer_index in zip(indices, best):
            question, _ = data.questions[i]
            answer = answers[answer_index]
            rows.append({"question_id": question.question_id, "answer": answer})
            accuracies.append(vqa_accuracy(answer, question.answers))
    return rows, 100.0 * float(np.mean(accuracies))


def _eval_vcr(model, data, batch_size, device, task):
    rows, correct = [], []
    for indices, out, extras in _predict(model, data, batch_size, device, f"eval {task}"):
        probabilities = torch.softmax(out["scores"], dim=1)
        for i, probs, label in zip(indices, probabilities, extras["label"].tolist()):
            prediction = int(probs.argmax())
            rows.append({"annot_id": data.items[i].annot_id, "label": label,
                         "prediction": prediction,
                         "probabilities": [round(float(p), 6) for p in probs]})
            correct.append(prediction == label)
    return rows, 100.0 * float(np.mean(correct))


def _eval_refcoco(model, data, batch_size, device, eval_task):
    rows, chosen_boxes, gt_boxes = [], [], []
    for indices, out, extras in _predict(model, data, batch_size, device, f"eval {eval_task}"):
        chosen = model.head.predict(out["logits"], extras["candidate"]).tolist()
        for i, box_index in zip(indices, chosen):
            expr = data.data.expressions[i]
            box = data.candidates[expr.image_id][box_index - 1]  # box 0 is the whole image
            chosen_boxes.append(box)
            gt_boxes.append(expr.gt_box)
            rows.append({"ref_id": expr.ref_id, "sent_id": expr.sent_id, "image_id": expr.image_id,
                         "box": [round(float(v), 2) for v in box]})
    value, ious = refcoco_accuracy(np.stack(chosen_boxes), np.stack(gt_boxes))
    for row, iou in zip(rows, ious):
        row["iou"] = round(float(iou), 4)
        row["correct"] = bool(iou >= 0.5)
    return rows, value


def evaluate(model_dir: str | os.PathLike, targets: list[EvalTarget], *, setting: str,
             schedule: str, sources: Mapping[str, str], model_cfg: Mapping[str, Any],
             dataset: str, rois_paths: list[str] | tuple = (), seed: int = 0,
             device: str = "cpu") -> list[dict]:
    """Predict every target's split with the fine-tuned model and write its eval JSON + predictions."""
    seed_everything(seed)
    model, meta = load_finetuned(model_dir)
    model.to(device)
    for target in targets:
        if target.eval_task not in EVAL_TASKS:
            raise ValueError(f"unknown eval task {target.eval_task!r} (expected one of {list(EVAL_TASKS)})")
        if EVAL_TASKS[target.eval_task] != meta["name"]:
            raise ValueError(f"eval task {target.eval_task} needs a {EVAL_TASKS[target.eval_task]} "
                             f"model; {model_dir} was fine-tuned on {meta['name']}")
    tokens = Tokens(load_tokenizer(model.vlbert.config.bert_path))
    images = ImageLoader(int(model_cfg["image_max_side"]))
    rois, rois_source = read_task_rois(list(rois_paths))
    batch_size = int(meta["batch_size"])
    results = []
    for target in targets:
        task = meta["name"]
        data = build_task_data(
            task, target.split, sources=sources, tokens=tokens, images=images,
            max_rois=int(model_cfg["max_rois"]), max_text_len=int(meta["max_text_len"]), rois=rois,
            rois_source=rois_source, answers=meta.get("answers"),
            object_names=meta.get("object_names"),
            tracks=(target.eval_task.removeprefix("refcoco_"),) if task == "refcoco" else ("gt", "det"))
        if len(data) == 0:
            raise ValueError(f"{target.eval_task} split {target.split}: no examples to evaluate")
        if task == "vqa":
            rows, value = _eval_vqa(model, data, batch_size, device, meta["answers"])
        elif task.startswith("vcr"):
            rows, value = _eval_vcr(model, data, batch_size, device, task)
        else:
            rows, value = _eval_refcoco(model, data, batch_size, device, target.eval_task)
        _write_rows(target.predictions_path, rows)
        result = {"task": target.eval_task, "metric": METRICS[target.eval_task], "value": value,
                  "split": target.split, "num_examples": len(rows),
                  "predictions": str(target.predictions_path), "setting": setting,
                  "schedule": schedule, "model_dir": str(model_dir), "dataset": dataset}
        _write_json(target.json_path, result)
        log.info("%s %s: %s = %.2f over %d examples", target.eval_task, target.split,
                 result["metric"], value, len(rows))
        results.append(result)
    return results

