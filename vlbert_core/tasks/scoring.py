"""The official metrics, computed from prediction files and the datasets' own annotation files.

Torch-free on purpose: like an evaluation server, scoring needs only the submission and the ground
truth. Every question, expression or item of the split must be predicted exactly once; a missing or
extra prediction is an error naming the file and the id, never a silently smaller denominator.
The rules, and where the official code has each, are in docs/metrics.md.

Eval JSON schema (the tables read exactly this):

    {"task", "metric", "value" (percent; VQA's rounded to 2 digits as the official code
     reports it), "split", "num_examples", "predictions" (path), "setting", "schedule",
     "model_dir", "dataset"}
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from vlbert_core.utils import atomic_path, get_logger

from . import refcoco as refcoco_lib
from . import vcr as vcr_lib
from .vqa import load_vqa, vqa_accuracy, vqa_overall_accuracy, vqa_submission

log = get_logger(__name__)

METRICS = {"vcr_q2a": "accuracy", "vcr_qa2r": "accuracy", "vqa": "vqa_accuracy",
           "refcoco_gt": "accuracy@0.5", "refcoco_det": "accuracy@0.5"}


def _check_ids(predicted: list, expected: list, what: str, where: str) -> None:
    seen: set = set()
    for key in predicted:
        if key in seen:
            raise ValueError(f"{where}: {what} {key!r} is predicted twice")
        seen.add(key)
    missing = [k for k in expected if k not in seen]
    extra = sorted(seen - set(expected), key=str)
    if missing or extra:
        raise ValueError(f"{where}: predictions do not match the split: {len(missing)} {what}s "
                         f"missing (e.g. {missing[:3]}), {len(extra)} unknown (e.g. {extra[:3]})")


def score_vqa(rows: list[dict], questions_path: str, annotations_path: str, where: str) -> tuple[float, list[dict]]:
    """Official VQA accuracy (percent, rounded as the official code reports it) and the
    predictions in the official results format, unchanged from the bundle's order."""
    submission = vqa_submission(rows, where)
    questions = load_vqa(questions_path, annotations_path)
    _check_ids([r["question_id"] for r in submission], [q.question_id for q in questions],
               "question_id", where)
    answers = {r["question_id"]: r["answer"] for r in submission}
    in_official_order = sorted(questions, key=lambda q: q.annotation_index)
    accuracies = [vqa_accuracy(answers[q.question_id], q.answers) for q in in_official_order]
    return vqa_overall_accuracy(accuracies), submission


def score_vcr(rows: list[dict], jsonl_path: str, eval_task: str, where: str) -> tuple[float, list[dict]]:
    """Accuracy over the 4 candidates; the label comes from the official jsonl, not the predictions."""
    items = {item.annot_id: item for item in vcr_lib.load_vcr(jsonl_path)}
    _check_ids([r["annot_id"] for r in rows], list(items), "annot_id", where)
    scored = []
    for r in rows:
        item = items[r["annot_id"]]
        label = item.answer_label if eval_task == "vcr_q2a" else item.rationale_label
        if label is None:
            raise ValueError(f"{jsonl_path}: item {item.annot_id} has no label; cannot score {eval_task}")
        scored.append({**r, "label": int(label)})
    correct = vcr_lib.vcr_correct([r.get("prediction") for r in scored], [r["label"] for r in scored], where)
    return vcr_lib.vcr_accuracy(correct), scored


def score_refcoco(rows: list[dict], refs_path: str, instances_path: str, split: str,
                  where: str) -> tuple[float, list[dict]]:
    """Accuracy at IoU >= 0.5 between the chosen box and the referred object's box."""
    data = refcoco_lib.load_refcoco(refs_path, instances_path, split)
    expressions = {(e.ref_id, e.sent_id): e for e in data.expressions}
    _check_ids([(r["ref_id"], r["sent_id"]) for r in rows], list(expressions), "(ref_id, sent_id)", where)
    predicted = refcoco_lib.check_predicted_boxes([r.get("box") for r in rows], where)
    gt = np.stack([expressions[(r["ref_id"], r["sent_id"])].gt_box for r in rows])
    value, ious = refcoco_lib.refcoco_accuracy(predicted, gt)
    scored = [{**r, "iou": round(float(iou), 4), "correct": bool(iou >= refcoco_lib.CORRECT_IOU)}
              for r, iou in zip(rows, ious)]
    return value, scored


def read_prediction_bundle(path: str | os.PathLike, key: str) -> tuple[list[dict], str]:
    """(rows, model_dir) of one `<eval task>/<split>` entry of a fine-tune job's predictions bundle."""
    try:
        bundle = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"predictions bundle {path} cannot be read: {err}") from None
    if key not in bundle.get("predictions", {}):
        raise ValueError(f"predictions bundle {path} has no entry {key!r} "
                         f"(it has {sorted(bundle.get('predictions', {}))})")
    return bundle["predictions"][key], bundle.get("model_dir", "")


def evaluate_predictions(eval_task: str, split: str, bundle_path: str | os.PathLike,
                         sources: Mapping[str, str], json_path: str | os.PathLike,
                         predictions_path: str | os.PathLike, *, setting: str, schedule: str,
                         dataset: str) -> dict[str, Any]:
    """Score one (eval task, split) and write its predictions file and eval JSON (atomically)."""
    rows, model_dir = read_prediction_bundle(bundle_path, f"{eval_task}/{split}")
    where = f"{bundle_path} [{eval_task}/{split}]"
    if eval_task == "vqa":
        value, out_rows = score_vqa(rows, sources["questions"].format(split=split),
                                    sources["annotations"].format(split=split), where)
    elif eval_task in ("vcr_q2a", "vcr_qa2r"):
        value, out_rows = score_vcr(rows, sources["annotations"].format(split=split), eval_task, where)
    elif eval_task in ("refcoco_gt", "refcoco_det"):
        value, out_rows = score_refcoco(rows, sources["refs"], sources["instances"], split, where)
    else:
        raise ValueError(f"unknown eval task {eval_task!r} (expected one of {list(METRICS)})")
    with atomic_path(predictions_path) as tmp:
        tmp.write_text("[\n" + ",\n".join(json.dumps(r) for r in out_rows) + "\n]\n")
    result = {"task": eval_task, "metric": METRICS[eval_task], "value": value, "split": split,
              "num_examples": len(out_rows), "predictions": str(predictions_path),
              "setting": setting, "schedule": schedule, "model_dir": model_dir, "dataset": dataset}
    with atomic_path(json_path) as tmp:
        tmp.write_text(json.dumps(result, indent=1) + "\n")
    log.info("%s %s: %s = %.2f over %d examples", eval_task, split, result["metric"], value, len(out_rows))
    return result
