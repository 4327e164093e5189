"""Where a finished workflow run spent its time: the Snakemake `benchmark:` files of its jobs, per rule.

Every rule writes benchmarks/rules/<rule>/<wildcards>.tsv (or benchmarks/rules/<rule>.tsv for a rule
without wildcards): a header line and one row per measured run, whose column `s` is the job's wall
seconds and `cpu_time` its CPU seconds. The run's own wall time comes from its Snakemake log
(.snakemake/log/<start>.snakemake.log): from the `Date:` line to the last job's timestamp.
"""

from __future__ import annotations

import csv
import re
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

BENCHMARK_DIR = Path("benchmarks") / "rules"
_JOB_STAMP = re.compile(r"^\[(\w{3} \w{3} +\d+ \d\d:\d\d:\d\d \d{4})\]$")
_PROGRESS = re.compile(r"^\d+ of (\d+) steps")
_START = re.compile(r"^\s*Date: (\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)$")


@dataclass(frozen=True)
class RuleTime:
    rule: str
    jobs: int
    job_seconds: float      # sum of the jobs' wall seconds (column `s`)
    cpu_seconds: float      # sum of the jobs' CPU seconds (column `cpu_time`)
    max_job_seconds: float


def _rule_of(tsv: Path, root: Path) -> str:
    parts = tsv.relative_to(root).parts
    return parts[0] if len(parts) > 1 else tsv.stem


def _read_tsv(tsv: Path) -> tuple[float, float]:
    """(wall s, CPU s) of one job's benchmark file; a file measured over several repeats gives their mean."""
    with tsv.open(newline="") as f:
        rows = list(csv.DictReader(f, delimiter="\t"))
    if not rows or "s" not in rows[0]:
        raise ValueError(f"{tsv}: not a Snakemake benchmark file (no rows, or no column 's')")
    try:
        wall = [float(r["s"]) for r in rows]
        cpu = [float(r["cpu_time"]) if r.get("cpu_time") not in (None, "", "NA", "-") else 0.0 for r in rows]
    except ValueError as err:
        raise ValueError(f"{tsv}: a value of column 's' or 'cpu_time' is not a number ({err})") from None
    return sum(wall) / len(wall), sum(cpu) / len(cpu)


def rule_times(run_dir: str | Path) -> list[RuleTime]:
    """Job seconds per rule of the run in `run_dir`, the slowest rule first."""
    root = Path(run_dir) / BENCHMARK_DIR
    files = sorted(root.rglob("*.tsv"))
    if not files:
        raise FileNotFoundError(f"no benchmark files under {root}: is {run_dir} the directory of a finished run?")
    per_rule: dict[str, list[tuple[float, float]]] = {}
    for tsv in files:
        per_rule.setdefault(_rule_of(tsv, root), []).append(_read_tsv(tsv))
    out = [RuleTime(rule, len(jobs), sum(w for w, _ in jobs), sum(c for _, c in jobs), max(w for w, _ in jobs))
           for rule, jobs in per_rule.items()]
    return sorted(out, key=lambda r: (-r.job_seconds, r.rule))


def _log_span(path: Path) -> tuple[int, float] | None:
    """(jobs the invocation planned, its wall seconds) from one Snakemake log; None if it ran no job."""
    start = end = None
    planned = 0
    for line in path.read_text(errors="replace").splitlines():
        if start is None and (m := _START.match(line)):
            start = datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S")
        elif m := _JOB_STAMP.match(line.strip()):
            end = datetime.strptime(m.group(1), "%a %b %d %H:%M:%S %Y")
        elif m := _PROGRESS.match(line.strip()):
            planned = max(planned, int(m.group(1)))
    if start is None or end is None:
        return None
    return planned, (end - start).total_seconds()


def run_wall_seconds(run_dir: str | Path) -> float | None:
    """Wall seconds of the run: of the Snakemake invocation in `run_dir` that planned the most jobs
    (the newest among equals), so a small target built afterwards in the same directory does not
    stand in for the run. None without a log."""
    logs = sorted((Path(run_dir) / ".snakemake" / "log").glob("*.snakemake.log"))
    if not logs:
        return None
    spans = [(span, i) for i, path in enumerate(logs) if (span := _log_span(path)) is not None]
    if not spans:
        raise ValueError(f"{logs[-1]}: no 'Date:' line or no job timestamp; not a Snakemake run log")
    (_, seconds), _ = max(spans, key=lambda item: (item[0][0], item[1]))
    return seconds


def rule_table(times: list[RuleTime], wall_s: float | None) -> str:
    """Markdown table: job seconds per rule, count and share of all job seconds."""
    total = sum(t.job_seconds for t in times)
    lines = ["| rule | jobs | job s | share | CPU s | longest job s |", "|---|---|---|---|---|---|"]
    for t in times:
        share = 100 * t.job_seconds / total if total else 0.0
        lines.append(f"| {t.rule} | {t.jobs} | {t.job_seconds:.0f} | {share:.0f}% | {t.cpu_seconds:.0f} | "
                     f"{t.max_job_seconds:.0f} |")
    lines.append(f"| **all** | {sum(t.jobs for t in times)} | {total:.0f} | 100% | "
                 f"{sum(t.cpu_seconds for t in times):.0f} | |")
    if wall_s is not None:
        lines.append("")
        lines.append(f"Run wall time (Snakemake log, `Date:` to the last job): {wall_s:.0f} s; job seconds / wall = "
                     f"{total / wall_s:.2f} (how many jobs ran at once on average)." if wall_s > 0 else
                     "Run wall time: 0 s in the log.")
    return "\n".join(lines)
