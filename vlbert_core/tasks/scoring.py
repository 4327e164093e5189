"""The official metrics, computed from prediction files and the datasets' own annotation files.

Torch-free on purpose: like an evaluation server, scoring needs only the submission and the ground
truth. Every question, expression or item of the split must be predicted exactly once; a missing or
extra prediction is an error naming the file and the id, never a silently smaller denominator.
The rules, and where the official code has each, are in docs/metrics.md.

Eval JSON schema (the tables read exactly this):

    {"task", "metric", "value" (percent; VQA's rounded to 2 digits as the official code
     reports it), "split", "num_examples", "predictions" (path), "setting", "schedule",
     "model_dir", "dataset", "baseline" (percent, or null), "baseline_kind" (what it is: chance or
     the majority answer, Task.baseline)} and the task's secondary metrics (a custom task's "macro_f1")
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Mapping, Sequence

from vlbert_core.utils import atomic_path, get_logger

from .registry import task_of_eval

log = get_logger(__name__)


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
                         dataset: str, rois: Sequence[str | os.PathLike] = (),
                         max_rois: int | None = None) -> dict[str, Any]:
    """Score one (eval task, split) and write its predictions file and eval JSON (atomically); `rois` and
    `max_rois`: the split's RoI parquets and the model's box count, for a baseline that reads them
    (Task.baseline_reads_rois)."""
    task = task_of_eval(eval_task)
    if eval_task not in task.eval_task_names():
        raise ValueError(f"eval task {eval_task} is scored by its own workflow script from "
                         f"other eval tasks' predictions, not from a predictions bundle")
    rows, model_dir = read_prediction_bundle(bundle_path, f"{eval_task}/{split}")
    where = f"{bundle_path} [{eval_task}/{split}]"
    value, out_rows = task.score(eval_task, split, rows, sources, where)
    with atomic_path(predictions_path) as tmp:
        tmp.write_text("[\n" + ",\n".join(json.dumps(r) for r in out_rows) + "\n]\n")
    result = {"task": eval_task, "metric": task.metric, "value": value, "split": split,
              "num_examples": len(out_rows), "predictions": str(predictions_path),
              "setting": setting, "schedule": schedule, "model_dir": model_dir, "dataset": dataset,
              **task.secondary_metrics(eval_task, split, out_rows),
              **task.baseline(eval_task, split, sources, rois=[str(p) for p in rois], max_rois=max_rois).fields()}
    with atomic_path(json_path) as tmp:
        tmp.write_text(json.dumps(result, indent=1) + "\n")
    log.info("%s %s: %s = %.2f over %d examples", eval_task, split, result["metric"], value, len(out_rows))
    return result
