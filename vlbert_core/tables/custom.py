"""The table of a custom task (`tasks.custom.<name>`, rule `custom_table`):
results/tables/custom_<name>.csv and its Markdown twin."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Mapping

from vlbert_core.tasks.base import split_path
from vlbert_core.tasks.custom import OK, SPLITS, CustomSpec, accuracy, macro_f1, read_checked_rows
from vlbert_core.utils import atomic_path, get_logger

from .build import describe_model, format_number, read_eval, write_csv

log = get_logger(__name__)


TABLE_HEADER = ["task", "setting", "schedule", "model", "dataset", "split", "accuracy", "macro_f1",
                "val_examples", "train_examples", "rows_skipped", "note"]


def _counts_text(counts: Mapping[str, int]) -> str:
    skipped = ", ".join(f"{n} {status}" for status, n in counts.items() if status != OK)
    return f"{sum(counts.values())} rows, {counts.get(OK, 0)} ok" + (f", skipped {skipped}" if skipped else "")


MAJORITY_SETTING = "majority label"


def majority_baseline(labels: list[str], rows_paths: Mapping[str, str | os.PathLike]) -> dict[str, Any]:
    """The score of always answering the most frequent label of the `ok` train rows (ties: the
    first in `labels`) on the `ok` val rows: what a model that learns nothing from the image or
    the text reaches."""
    ok = {split: [r["label"] for r in read_checked_rows(rows_paths[split]) if r["status"] == OK] for split in SPLITS}
    label = max(labels, key=lambda name: (ok["train"].count(name), -labels.index(name)))
    predicted = [label] * len(ok["val"])
    return {"label": label, "accuracy": accuracy(predicted, ok["val"]), "macro_f1": macro_f1(predicted, ok["val"]),
            "val_examples": len(ok["val"])}


def write_custom_table(spec: CustomSpec, eval_paths: Mapping[str, str | os.PathLike], summary_path: str | os.PathLike,
                       rows_paths: Mapping[str, str | os.PathLike], csv_path: str | os.PathLike,
                       md_path: str | os.PathLike, *, dataset: str, model_cfg: Mapping[str, Any]) -> list[dict]:
    """`results/tables/custom_<name>.csv` and its Markdown twin: accuracy and macro-F1 on val of each
    fine-tuned setting (`eval_paths`: {setting: eval JSON}), then the majority-label baseline
    (`rows_paths`: {split: checked rows}), with the row accounting of `check_rows` (`summary_path`,
    its labels.json) in the notes."""
    summary = json.loads(Path(summary_path).read_text(encoding="utf-8"))
    counts = summary["counts"]
    skipped = sum(n for split in SPLITS for status, n in counts[split].items() if status != OK)
    model = describe_model(dict(model_cfg))
    rows = []
    for setting, path in eval_paths.items():
        record = read_eval(Path(path))
        if "macro_f1" not in record:
            raise ValueError(f"eval JSON {path} has no 'macro_f1'; it is not a custom task's evaluation")
        rows.append({"task": spec.task_name, "setting": setting, "schedule": spec.schedule, "model": model,
                     "dataset": dataset, "split": record["split"], "accuracy": float(record["value"]),
                     "macro_f1": float(record["macro_f1"]), "val_examples": record["num_examples"],
                     "train_examples": counts["train"].get(OK, 0), "rows_skipped": skipped,
                     "note": f"train: {_counts_text(counts['train'])}; val: {_counts_text(counts['val'])}"})
    majority = majority_baseline(list(summary["labels"]), rows_paths)
    rows.append({"task": spec.task_name, "setting": MAJORITY_SETTING, "schedule": "", "model": "", "dataset": dataset,
                 "split": "val", "accuracy": majority["accuracy"], "macro_f1": majority["macro_f1"],
                 "val_examples": majority["val_examples"], "train_examples": counts["train"].get(OK, 0),
                 "rows_skipped": skipped,
                 "note": f"baseline, no model: always {majority['label']!r}, the most frequent train label"})
    write_csv(rows, TABLE_HEADER, Path(csv_path))
    lines = [f"# Custom task `{spec.name}`: accuracy and macro-F1 on val", "",
             "| setting | accuracy | macro-F1 | val examples |", "|---|---|---|---|"]
    lines += [f"| {r['setting']} | {format_number(r['accuracy'], 1)} | {format_number(r['macro_f1'], 1)} | "
              f"{r['val_examples']} |" for r in rows]
    lines += ["", f"{model}, fine-tuned with schedule `{spec.schedule}` from each pre-training setting; "
              f"labels {summary['labels']}. The row `{MAJORITY_SETTING}` always answers "
              f"{majority['label']!r}, the most frequent train label: a model that learns nothing scores that.", ""]
    for split in SPLITS:
        lines.append(f"- {split} (`{summary['files'][split]}`): {_counts_text(counts[split])}; every row with "
                     f"its status and reason: `{split_path(spec.sources()['rows'], split)}`.")
    with atomic_path(md_path) as tmp:
        tmp.write_text("\n".join(lines) + "\n", encoding="utf-8")
    log.info("wrote %s (%d settings and the majority label)", csv_path, len(rows) - 1)
    return rows
