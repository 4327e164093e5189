"""Faults of a long run, made to happen for real (issue #36, docs/reliability.md): a second `snakemake` in a
directory where one is running, a damaged checkpoint, SIGTERM to a pre-training process. A DDP rank killed with
kill -9 is in tests/pretrain/test_ddp.py, SLURM's requeue in tests/workflow/test_slurm.py."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
from test_workflow import CI_CONFIG, REPO

pytestmark = pytest.mark.workflow

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


def _pretrain_command(world, config_file, out) -> list[str]:
    """`python -m vlbert_core.pretrain` on the tiny world, one process and one thread, as rule pretrain runs it."""
    return [sys.executable, "-m", "vlbert_core.pretrain", "--setting", "b", "--config", str(config_file),
            "--cc-shards", *world["cc"], "--roi-parquets", *world["rois"], "--text-shards", *world["text"],
            "--detector", world["detector"], "--out", str(out), "--threads", "1"]


def _wait_for(condition, what: str, process: subprocess.Popen, log, seconds: float = 120) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert process.poll() is None, f"the run ended (status {process.returncode}) before {what}:\n{log()[-3000:]}"
        assert time.monotonic() < deadline, f"no {what} within {seconds} s:\n{log()[-3000:]}"
        time.sleep(0.05)


def test_sigterm_stops_pretraining_with_a_checkpoint_and_the_rerun_resumes_to_the_straight_run(world, tmp_path):
    """What SLURM sends at preemption or the time limit, sent to a running pre-training process: it finishes the
    step, writes its checkpoint, exits 143 (128 + SIGTERM) within the grace time; the same command resumes there
    and ends with the weights of an uninterrupted run."""
    import signal

    import torch
    import yaml
    from test_pretrain import _run, model_cfg, pretrain_cfg

    steps = 30   # every step is logged (steps // 20 = 1); one takes ~0.1 s here, far longer than the signal's way
    # With the data streams in DataLoader workers, as on a GPU: the resumed run must not draw the workers' seed
    # from the global RNG (it did, and ended 1e-3 away from the straight run).
    cfg = pretrain_cfg(steps=steps, checkpoint_every=1000, stream_workers=True)
    config_file = tmp_path / "config.yaml"
    config_file.write_text(yaml.safe_dump({"model": model_cfg(world), "pretrain": cfg, "seed": 7, "device": "cpu",
                                           "max_image_pixels": 89_478_485}))  # the run context: every key
    out = tmp_path / "stopped"
    command = _pretrain_command(world, config_file, out)
    rank_log = out / "pretrain.rank0.log"
    log = lambda: rank_log.read_text() if rank_log.is_file() else ""  # noqa: E731
    with open(tmp_path / "stderr.txt", "w") as stderr:
        process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=stderr)
        try:
            _wait_for(lambda: f"step 3/{steps}" in log(), "step 3", process, log)
            process.send_signal(signal.SIGTERM)
            sent = time.monotonic()
            process.wait(timeout=30)   # SLURM's default grace time (KillWait) before its SIGKILL
        finally:
            process.kill()
    assert process.returncode == 128 + signal.SIGTERM, (tmp_path / "stderr.txt").read_text()[-3000:]
    assert time.monotonic() - sent < 30
    stopped_at = torch.load(out / "checkpoint.pt", weights_only=True)["step"]
    assert 3 <= stopped_at < steps
    assert f"stopped by SIGTERM after step {stopped_at}; checkpoint written to {out / 'checkpoint.pt'}" in log()
    assert not (out / "model.safetensors").exists()
    assert "Traceback" not in (tmp_path / "stderr.txt").read_text()

    again = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"at step {stopped_at}" in log()

    _run(world, "b", tmp_path / "straight", cfg={k: cfg[k] for k in ("steps", "checkpoint_every", "stream_workers")})
    want, got = _weights(tmp_path / "straight"), _weights(out)
    assert want.keys() == got.keys()
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=1e-6, atol=1e-7, msg=key)
