"""The per-rule breakdown of a finished run (benchmarks/default_run.py) on a fabricated run directory."""

from __future__ import annotations

import pytest
from conftest import run_benchmark_reporting_torch

from vlbert_core.rule_times import rule_table, rule_times, run_wall_seconds

HEADER = "s\th:m:s\tmax_rss\tmax_vms\tmax_uss\tmax_pss\tio_in\tio_out\tmean_load\tcpu_time\n"


def _job(path, seconds, cpu):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(HEADER + f"{seconds}\t0:00:{int(seconds):02d}\t50\t200\t30\t35\t0\t1\t90\t{cpu}\n")


def _run(tmp_path):
    rules = tmp_path / "benchmarks" / "rules"
    _job(rules / "pretrain" / "a.tsv", 40.0, 38.0)
    _job(rules / "pretrain" / "d.tsv", 60.0, 55.5)
    _job(rules / "finetune" / "vqa" / "a" / "full.tsv", 20.0, 19.0)
    _job(rules / "train_detector.tsv", 30.5, 50.0)   # a rule without wildcards
    log = tmp_path / ".snakemake" / "log"
    log.mkdir(parents=True)
    (log / "2026-11-24T100000.000000.snakemake.log").write_text("old run\n")
    (log / "2026-11-25T100000.000000.snakemake.log").write_text(
        "SNAKEMAKE\n  Date: 2026-11-25 10:00:00\n\n[Wed Nov 25 10:00:02 2026]\nlocalrule all:\n"
        "[Wed Nov 25 10:01:30 2026]\nFinished jobid: 3 (Rule: pretrain)\n[Wed Nov 25 10:02:40 2026]\n"
        "Finished jobid: 0 (Rule: all)\n12 of 12 steps (100%) done\n")
    # a one-job target built later in the same directory is not the run
    (log / "2026-11-25T110000.000000.snakemake.log").write_text(
        "SNAKEMAKE\n  Date: 2026-11-25 11:00:00\n\n[Wed Nov 25 11:00:01 2026]\nFinished jobid: 0 (Rule: tables)\n"
        "1 of 1 steps (100%) done\n")
    return tmp_path


def test_rule_times_sum_jobs_per_rule_slowest_first(tmp_path):
    times = rule_times(_run(tmp_path))
    assert [(t.rule, t.jobs, t.job_seconds, t.max_job_seconds) for t in times] == [
        ("pretrain", 2, 100.0, 60.0), ("train_detector", 1, 30.5, 30.5), ("finetune", 1, 20.0, 20.0)]
    assert times[0].cpu_seconds == pytest.approx(93.5)
    assert run_wall_seconds(tmp_path) == 160.0          # the largest invocation: 10:00:00 to 10:02:40
    table = rule_table(times, 160.0)
    assert "| pretrain | 2 | 100 | 66% | 94 | 60 |" in table
    assert "| **all** | 4 | 150 | 100% |" in table and "job seconds / wall = 0.94" in table


def test_rule_times_name_the_bad_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="no benchmark files"):
        rule_times(tmp_path)
    bad = tmp_path / "benchmarks" / "rules" / "pretrain" / "d.tsv"
    bad.parent.mkdir(parents=True)
    bad.write_text(HEADER + "soon\t0:00:01\t1\t1\t1\t1\t0\t0\t0\t1\n")
    with pytest.raises(ValueError, match="d.tsv.*not a number"):
        rule_times(tmp_path)
    assert run_wall_seconds(tmp_path) is None


def test_the_benchmark_prints_the_rule_table_without_importing_torch(tmp_path):
    # `benchmarks/default_run.py RUN --rules-only` reads text files: it answers at once, not after importing torch
    result = run_benchmark_reporting_torch("default_run", str(_run(tmp_path)), "--rules-only")
    assert result.returncode == 0, result.stderr
    assert "| pretrain | 2 | 100 | 66% | 94 | 60 |" in result.stdout
    assert result.stdout.rstrip().endswith("imported: []")
