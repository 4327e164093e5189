"""The table of a custom task (`tasks.custom.<name>`, rule `custom_table`):
results/tables/custom_<name>.csv and its Markdown twin."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Mapping

from vlbert_core.tasks.base import split_path
from vlbert_core.tasks.custom import OK, SPLITS, CustomSpec
from vlbert_core.utils import atomic_path, get_logger

from .build import describe_model, format_number, read_eval, write_csv

log = get_logger(__name__)


TABLE_HEADER = ["task", "setting", "schedule", "model", "dataset", "split", "accuracy", "macro_f1",
                "val_examples", "train_examples", "rows_skipped", "note"]


def _counts_text(counts: Mapping[str, int]) -> str:
    skipped = ", ".join(f"{n} {status}" for status, n in counts.items() if status != OK)
    return f"{sum(counts.values())} rows, {counts.get(OK, 0)} ok" + (f", skipped {skipped}" if skipped else "")


def write_custom_table(spec: CustomSpec, eval_paths: Mapping[str, str | os.PathLike], summary_path: str | os.PathLike,
                       csv_path: str | os.PathLike, md_path: str | os.PathLike, *, dataset: str,
                       model_cfg: Mapping[str, Any]) -> list[dict]:
    """`results/tables/custom_<name>.csv` and its Markdown twin: accuracy and macro-F1 on val of each
    fine-tuned setting (`eval_paths`: {setting: eval JSON}), with the row accounting of `check_rows`
    (`summary_path`, its labels.json) in the notes."""
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
    write_csv(rows, TABLE_HEADER, Path(csv_path))
    lines = [f"# Custom task `{spec.name}`: accuracy and macro-F1 on val", "",
             "| setting | accuracy | macro-F1 | val examples |", "|---|---|---|---|"]
    lines += [f"| {r['setting']} | {format_number(r['accuracy'], 1)} | {format_number(r['macro_f1'], 1)} | "
              f"{r['val_examples']} |" for r in rows]
    lines += ["", f"{model}, fine-tuned with schedule `{spec.schedule}` from each pre-training setting; "
              f"labels {summary['labels']}.", ""]
    for split in SPLITS:
        lines.append(f"- {split} (`{summary['files'][split]}`): {_counts_text(counts[split])}; every row with "
                     f"its status and reason: `{split_path(spec.sources()['rows'], split)}`.")
    with atomic_path(md_path) as tmp:
        tmp.write_text("\n".join(lines) + "\n", encoding="utf-8")
    log.info("wrote %s (%d settings)", csv_path, len(rows))
    return rows
