"""Faults of a long run, made to happen for real (issue #36, docs/reliability.md): here, a second `snakemake` in a
directory where one is running."""

from __future__ import annotations

import subprocess
import sys
import time

from test_workflow import CI_CONFIG, REPO

TARGET = "results/detector/model.pt"  # rules world and train_detector: about a minute on config/ci.yaml


def test_a_second_snakemake_in_the_same_directory_is_refused_by_the_lock(tmp_path):
    cmd = [sys.executable, "-m", "snakemake", "-s", str(REPO / "Snakefile"), "-d", str(tmp_path), "--configfile",
           str(CI_CONFIG), "--cores", "1", TARGET]
    first = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        locks = tmp_path / ".snakemake" / "locks"
        deadline = time.monotonic() + 120
        while not (locks.is_dir() and any(locks.iterdir())):   # the first run holds its lock
            assert first.poll() is None, first.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "the first run took no lock within 120 s"
            time.sleep(0.2)
        second = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    finally:
        out, err = first.communicate(timeout=600)
    assert second.returncode != 0
    # Snakemake's own message, which says what to do
    assert "Directory cannot be locked" in second.stderr and "--unlock" in second.stderr, second.stderr[-3000:]
    # the second run wrote nothing and did not disturb the first, which finishes
    assert first.returncode == 0, err[-3000:]
    assert (tmp_path / TARGET).is_file()
    assert not locks.is_dir() or not any(locks.iterdir())  # the first run released its lock
