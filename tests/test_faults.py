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


def _weights(directory):
    from safetensors.torch import load_file

    return load_file(str(directory / "model.safetensors"))


def test_a_damaged_checkpoint_is_never_loaded_and_the_previous_one_resumes(world, tmp_path, caplog):
    """Pre-training keeps its last two checkpoints: with the newest cut short (a machine that died while writing
    it, or a damaged disk), the run warns naming it and resumes from the one before, ending with the weights of
    an uninterrupted run; with both damaged it warns and starts afresh, with the same end."""
    import torch
    from test_pretrain import _run

    _run(world, "b", tmp_path / "straight")
    want = _weights(tmp_path / "straight")
    for damage in ("newest", "both"):
        out = tmp_path / damage
        assert _run(world, "b", out, stop_after_step=3)["stopped"]  # checkpoints at steps 2 (every 2) and 3
        newest, previous = out / "checkpoint.pt", out / "checkpoint.previous.pt"
        assert torch.load(previous, weights_only=True)["step"] == 2
        assert torch.load(newest, weights_only=True)["step"] == 3
        for path in (newest, previous) if damage == "both" else (newest,):
            path.write_bytes(path.read_bytes()[: path.stat().st_size // 3])
        caplog.clear()
        summary = _run(world, "b", out)
        assert summary["resumed_from"] == (2 if damage == "newest" else None)
        warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
        assert any(str(newest) in w and "not resuming from it" in w for w in warnings), warnings
        if damage == "both":
            assert any("no readable checkpoint" in w and "starting from scratch" in w for w in warnings), warnings
        got = _weights(out)
        for key in want:
            torch.testing.assert_close(got[key], want[key], rtol=1e-6, atol=1e-7, msg=key)
        # a finished run keeps its final checkpoint only
        assert newest.is_file() and not previous.exists()
