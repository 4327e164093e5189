"""What VCR's accuracy is made of in the embedded world: accuracy per question kind, from a finished run.

A diagnostic: run to settle one question, not a benchmark that is re-run. Backs docs/benchmarks.md "VCR
accuracy per question kind" and docs/default-run.md (the VCR bullets).

The world asks four kinds of VCR question (vlbert_core/world/language.py, `vcr_items`): an object's colour
("What color is [0] ?"), its kind ("What is [0] ?"), what it is next to, and which of two is bigger. A VCR
reference becomes the object's name from the row's `objects` list, and the world calls every object
`object` (`VCR_OBJECT_NAME`), so no kind is answerable from the text alone: what an object is, its colour,
its size against another and its neighbour come only from the referenced RoIs. (Until 822b8dc the world
named objects by their category, so the right `kind` answer repeated the question's word and every model
scored 100 % there; and `bigger` offered two answers that were never right.)

This script reads the world's `val.jsonl` and the fine-tuned jobs' `predictions.json` (no model is run) and
prints one row per job: Q->A (or QA->R) accuracy per kind, the exact McNemar p-value against the `none` job of
the same schedule, and the mean training answer loss over the first, middle and last sixth of its steps
(ln 4 = 1.386 is chance).

    uv run python benchmarks/diagnostics/vcr_question_kinds.py RUN_DIR [--tasks vcr_q2a vcr_qa2r] [--write-docs]

RUN_DIR is a finished embedded-world run (`uv run snakemake --cores all results/tables/table4_ablation.csv`).
Longer schedules are fine-tuned in the same directory by adding them to `finetune.schedules`, e.g. a config
file with `finetune: {schedules: {full: 1.0, half: 0.5, x12: 12.0}}` given after config/config.yaml and the
target results/finetune/vcr_q2a/none/x12/predictions.json; every schedule found is reported.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from collections import Counter
from datetime import date
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/, for docs_section
from docs_section import replace_section  # noqa: E402

from vlbert_core.stats import format_p_value, mcnemar_exact  # noqa: E402
from vlbert_core.utils import read_jsonl  # noqa: E402

KINDS = ("kind", "colour", "next_to", "bigger")
HEADING = "## VCR accuracy per question kind"


def question_kind(tokens: list) -> str:
    """The world's VCR question kind, read from the question's words (object references left out)."""
    words = [t for t in tokens if isinstance(t, str)]
    if words[:2] == ["What", "color"]:
        return "colour"
    if "next" in words:
        return "next_to"
    if words[:1] == ["Is"]:
        return "bigger"
    if words[:1] == ["What"]:
        return "kind"
    raise ValueError(f"question {tokens!r} is none of the world's VCR kinds {KINDS}")


def load_labels(jsonl: Path, task: str) -> dict[str, tuple[str, int]]:
    """{annot_id: (kind, label)} of a VCR jsonl split."""
    key = "answer_label" if task == "vcr_q2a" else "rationale_label"
    labels = {}
    for row in read_jsonl(jsonl, line_field="line"):
        try:
            labels[row["annot_id"]] = (question_kind(row["question"]), int(row[key]))
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{jsonl} line {row['line']}: {exc!r}") from exc
    return labels


def val_predictions(path: Path, task: str) -> list[dict]:
    bundle = json.loads(path.read_text())
    key = f"{task}/val"
    if key not in bundle.get("predictions", {}):
        raise ValueError(f"{path} has no {key} predictions (has {sorted(bundle.get('predictions', {}))})")
    return bundle["predictions"][key]


def loss_by_phase(records: list[dict]) -> list[float]:
    """Mean answer loss over the first, middle and last sixth of a job's metrics records."""
    n = len(records)
    k = max(1, n // 6)
    spans = [records[:k], records[n // 2 - k // 2: n // 2 - k // 2 + k], records[-k:]]
    return [sum(r["answer_loss"] for r in span) / len(span) for span in spans]


def job_row(job_dir: Path, labels: dict, task: str) -> dict:
    right, total, correct = Counter(), Counter(), {}
    for p in val_predictions(job_dir / "predictions.json", task):
        if p["annot_id"] not in labels:
            raise ValueError(f"{job_dir}/predictions.json: annot_id {p['annot_id']!r} is not a val question")
        kind, label = labels[p["annot_id"]]
        total[kind] += 1
        correct[p["annot_id"]] = int(p["prediction"]) == label
        right[kind] += correct[p["annot_id"]]
    if set(correct) != set(labels):
        raise ValueError(f"{job_dir}/predictions.json covers {len(correct)} of the {len(labels)} val questions")
    records = read_jsonl(job_dir / "metrics.jsonl")
    return {"job": job_dir, "steps": len(records), "right": right, "total": total, "correct": correct,
            "loss": loss_by_phase(records)}


def p_vs_none(row: dict, rows: list[dict]) -> str:
    """Exact McNemar p-value against the `none` job of the same schedule ('' for none itself or without one)."""
    setting, schedule = row["job"].parts[-2:]
    none = [r for r in rows if r["job"].parts[-2:] == ("none", schedule)]
    if setting == "none" or not none:
        return ""
    ids = sorted(row["correct"])
    return format_p_value(mcnemar_exact([row["correct"][i] for i in ids], [none[0]["correct"][i] for i in ids]))


def table(rows: list[dict]) -> str:
    totals = rows[0]["total"]
    head = ("| setting / schedule | steps | all | p vs none | " + " | ".join(f"{k} ({totals[k]})" for k in KINDS)
            + " | answer loss: first / middle / last sixth |")
    lines = [head, "|" + "---|" * (len(KINDS) + 5)]
    for r in rows:
        name = "/".join(r["job"].parts[-2:])
        overall = 100 * sum(r["right"].values()) / sum(r["total"].values())
        per_kind = " | ".join(f"{100 * r['right'][k] / r['total'][k]:.0f}" for k in KINDS)
        loss = " / ".join(f"{v:.3f}" for v in r["loss"])
        lines.append(f"| {name} | {r['steps']} | {overall:.1f} | {p_vs_none(r, rows)} | {per_kind} | {loss} |")
    return "\n".join(lines)


def task_table(run: Path, task: str) -> str:
    labels = load_labels(run / "resources" / "synthetic" / "vcr" / "val.jsonl", task)
    jobs = list((run / "results" / "finetune" / task).glob("*/*/predictions.json"))
    if not jobs:
        raise SystemExit(f"no {task} predictions under {run / 'results' / 'finetune' / task}")
    rows = [job_row(p.parent, labels, task) for p in jobs]
    # schedules by length, `none` first in each
    rows.sort(key=lambda r: (r["steps"], r["job"].parts[-1], r["job"].parts[-2] != "none", r["job"].parts[-2]))
    return f"**{task}**, val split, {len(labels)} questions:\n\n" + table(rows)


def extra_schedules_note(run: Path, tasks: list[str]) -> str:
    """How schedules beyond the config's `full` and `half` were made, when the run has any."""
    found = {p.parent.name for task in tasks
             for p in (run / "results" / "finetune" / task).glob("*/*/predictions.json")}
    extra = sorted(found - {"full", "half"})
    if not extra:
        return ""
    return (f"\n\nSchedules other than `full` and `half` (here {', '.join(extra)}) were fine-tuned in the same run "
            "directory with a config file given after config/config.yaml that adds them to `finetune.schedules` "
            "(e.g. `finetune: {schedules: {full: 1.0, half: 0.5, x12: 12.0}}`), and targets "
            f"`results/finetune/vcr_q2a/SETTING/{extra[-1]}/predictions.json` (and vcr_qa2r).")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("run", type=Path)
    ap.add_argument("--tasks", nargs="+", default=["vcr_q2a", "vcr_qa2r"], choices=["vcr_q2a", "vcr_qa2r"])
    ap.add_argument("--write-docs", action="store_true")
    args = ap.parse_args()
    run = args.run.resolve()
    commit = subprocess.run(["git", "-C", str(run), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    source = f"a checkout of {commit.stdout.strip()}" if commit.returncode == 0 else f"`{run}`"
    body = (f"Accuracy (%) per question kind of every fine-tuned VCR job of the run in {source}, measured "
            f"{date.today().isoformat()}; chance is 25 on every kind; p vs none is the exact McNemar test against "
            f"`none` at the same schedule; the answer loss is chance at ln 4 = {math.log(4):.3f}.\n\n"
            + "\n\n".join(task_table(run, task) for task in args.tasks)
            + extra_schedules_note(run, args.tasks)
            + "\n\n```bash\nuv run python benchmarks/diagnostics/vcr_question_kinds.py RUN_DIR --write-docs\n```")
    print(body)
    if args.write_docs:
        replace_section(HEADING, body)


if __name__ == "__main__":
    main()
