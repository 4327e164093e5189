"""Readers for the files the report shows: training metrics, CC shard accounting, RoI counts and the
per-job timings Snakemake recorded. Each checks what it reads and names the file (and line or key)
when something is wrong, so a broken input stops the report instead of vanishing from it.
"""

from __future__ import annotations

import csv
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from vlbert_core.data.status import OK
from vlbert_core.rois import read_rois
from vlbert_core.utils import read_jsonl


@dataclass
class LossCurves:
    """The losses of one training run, step by step (`loss` is the total; the rest are its parts)."""

    label: str
    path: Path
    steps: list[int] = field(default_factory=list)
    losses: dict[str, list[float]] = field(default_factory=dict)
    note: str = ""  # why there are no steps (e.g. setting `none` is the BERT initialisation)


def read_loss_curves(path: str | Path, label: str) -> LossCurves:
    """The loss columns (every key that ends in `loss`) of a pre-training or fine-tuning metrics.jsonl.

    Rows without a step (or with step 0) are notes, such as the one setting `none` writes instead of
    training; a training row must carry a finite total `loss`.
    """
    path = Path(path)
    curves = LossCurves(label=label, path=path)
    rows = read_jsonl(path)
    notes = []
    for number, row in enumerate(rows, start=1):
        if not row.get("step"):
            notes.append(str(row.get("note", "")))
            continue
        if "loss" not in row:
            raise ValueError(f"{path}: line {number} (step {row['step']}) has no key 'loss'")
        curves.steps.append(int(row["step"]))
        for key in sorted(k for k in row if k.endswith("loss")):
            values = curves.losses.setdefault(key, [math.nan] * (len(curves.steps) - 1))
            value = row[key]
            values.append(float(value) if value is not None else math.nan)
        for values in curves.losses.values():  # a loss this row lacks: a gap in its line
            if len(values) < len(curves.steps):
                values.append(math.nan)
    if not curves.steps:
        curves.note = "; ".join(n for n in notes if n) or "no training steps recorded"
    return curves


def pretrain_setting(path: str | Path) -> str:
    """`results/pretrain/{setting}/metrics.jsonl` → setting."""
    path = Path(path)
    if path.name != "metrics.jsonl" or len(path.parts) < 3 or path.parts[-3] != "pretrain":
        raise ValueError(f"{path}: expected results/pretrain/{{setting}}/metrics.jsonl")
    return path.parts[-2]


def finetune_job(path: str | Path) -> tuple[str, str, str]:
    """`results/finetune/{task}/{setting}/{schedule}/metrics.jsonl` → (task, setting, schedule)."""
    path = Path(path)
    if path.name != "metrics.jsonl" or len(path.parts) < 5 or path.parts[-5] != "finetune":
        raise ValueError(f"{path}: expected results/finetune/{{task}}/{{setting}}/{{schedule}}/metrics.jsonl")
    task, setting, schedule = path.parts[-4:-1]
    return task, setting, schedule


@dataclass
class ShardStats:
    """One CC shard's download outcome: rows read from the TSV and how many ended in each status."""

    label: str  # "{split}-{shard:05d}"
    path: Path
    rows_in: int
    counts: dict[str, int]


def read_shard_stats(path: str | Path) -> ShardStats:
    """A `results/shards/cc/{split}-{shard}.stats.json`; its status counts must add up to rows_in."""
    path = Path(path)
    try:
        stats = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: not valid JSON: {err}") from None
    for key in ("counts", "rows_in", "split", "shard"):
        if key not in stats:
            raise ValueError(f"{path}: no key {key!r}")
    counts = {str(k): int(v) for k, v in stats["counts"].items()}
    if sum(counts.values()) != int(stats["rows_in"]):
        raise ValueError(f"{path}: the status counts add up to {sum(counts.values())}, "
                         f"but rows_in is {stats['rows_in']}")
    return ShardStats(label=f"{stats['split']}-{int(stats['shard']):05d}", path=path,
                           rows_in=int(stats["rows_in"]), counts=counts)


def status_order(shards: list[ShardStats]) -> list[str]:
    """`ok` first, then the failure kinds that occurred, most frequent first."""
    totals: dict[str, int] = {}
    for shard in shards:
        for status, count in shard.counts.items():
            totals[status] = totals.get(status, 0) + count
    failures = sorted((s for s, n in totals.items() if s != OK and n > 0), key=lambda s: (-totals[s], s))
    return [OK] + failures


@dataclass
class RoiCounts:
    """RoIs per image over the CC RoI parquets, and the rows that have no RoIs, by status."""

    num_boxes: np.ndarray  # one entry per image with status ok
    not_ok: dict[str, int]  # status → rows (images the detector could not read)
    files: list[Path]


def count_rois(paths: list[str | Path]) -> RoiCounts:
    """`num_boxes` of every ok row of the RoI parquets, and the other rows per status (no arrays are read)."""
    counts, not_ok = [], {}
    for path in paths:
        records = read_rois(path, arrays=False).values()
        counts.append(np.array([r.num_boxes for r in records if r.ok], dtype=np.int64))
        for record in records:
            if not record.ok:
                not_ok[record.status] = not_ok.get(record.status, 0) + 1
    all_counts = np.concatenate(counts) if counts else np.zeros(0, dtype=np.int64)
    return RoiCounts(num_boxes=all_counts, not_ok=dict(sorted(not_ok.items())), files=[Path(p) for p in paths])


@dataclass
class BenchmarkRecord:
    """One Snakemake benchmark TSV: the rule, which job of it, and the measured columns."""

    rule: str
    job: str  # the TSV's path below the rule's folder, without .tsv ("" for a one-job rule)
    path: Path
    values: dict[str, float | None]  # s, max_rss (MB), cpu_time, ...; None where Snakemake wrote NA


BENCHMARK_COLUMNS = ["s", "max_rss", "max_vms", "max_uss", "max_pss", "io_in", "io_out", "mean_load", "cpu_time"]


def _number(text: str) -> float | None:
    try:
        value = float(text)
    except ValueError:
        return None  # Snakemake writes NA (or -) where it could not measure a column
    return value if math.isfinite(value) else None


def read_benchmarks(benchmarks_dir: str | Path) -> list[BenchmarkRecord]:
    """Every `{rule}/**/*.tsv` or `{rule}.tsv` under benchmarks_dir, whatever exists now.

    Snakemake writes a job's TSV when the job finishes, so these are not outputs of any rule; the
    report reads what is there. A TSV with several runs (`repeat`) is averaged, as Snakemake's own
    report does.
    """
    benchmarks_dir = Path(benchmarks_dir)
    records = []
    for path in sorted(benchmarks_dir.rglob("*.tsv")):
        relative = path.relative_to(benchmarks_dir).with_suffix("")
        rule, job = relative.parts[0], "/".join(relative.parts[1:])
        with open(path, newline="", encoding="utf-8") as f:
            rows = list(csv.DictReader(f, delimiter="\t"))
        if not rows or "s" not in rows[0]:
            raise ValueError(f"{path}: not a Snakemake benchmark TSV (no header with 's', or no data row)")
        values = {}
        for column in BENCHMARK_COLUMNS:
            numbers = [_number(row[column]) for row in rows if row.get(column) is not None]
            numbers = [n for n in numbers if n is not None]
            values[column] = sum(numbers) / len(numbers) if numbers else None
        if values["s"] is None:
            raise ValueError(f"{path}: column 's' has no number")
        records.append(BenchmarkRecord(rule=rule, job=job, path=path, values=values))
    return records


@dataclass
class RuleTimings:
    rule: str
    jobs: int
    total_s: float
    max_s: float
    cpu_s: float | None
    peak_rss_mb: float | None


def summarise_benchmarks(records: list[BenchmarkRecord]) -> list[RuleTimings]:
    """Per rule: job count, wall seconds (total, longest job), CPU seconds, peak RSS; slowest first."""
    by_rule: dict[str, list[BenchmarkRecord]] = {}
    for record in records:
        by_rule.setdefault(record.rule, []).append(record)
    summary = []
    for rule, jobs in by_rule.items():
        cpu = [j.values["cpu_time"] for j in jobs if j.values["cpu_time"] is not None]
        rss = [j.values["max_rss"] for j in jobs if j.values["max_rss"] is not None]
        seconds = [j.values["s"] for j in jobs]
        summary.append(RuleTimings(rule=rule, jobs=len(jobs), total_s=sum(seconds), max_s=max(seconds),
                                   cpu_s=sum(cpu) if cpu else None, peak_rss_mb=max(rss) if rss else None))
    return sorted(summary, key=lambda t: (-t.total_s, t.rule))
