"""TensorBoard event files hold the same scalars as the metrics records they come from."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vlbert_core.tensorboard_log import EVENTS_DIR, TrainingEvents, read_scalars, scalars


def assert_events_match_metrics(out_dir: Path, section: str = "train") -> dict:
    """Every number of every record of out_dir/metrics.jsonl is in out_dir/tensorboard/ at its step, and
    the event files hold no other `section` scalar. Returns the scalars read back."""
    records = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    expected: dict[str, list[tuple[int, float]]] = {}
    for record in records:
        for tag, value in scalars(record, section).items():
            expected.setdefault(tag, []).append((record["step"], value))
    events = read_scalars(out_dir / EVENTS_DIR)
    assert {t for t in events if t.startswith(f"{section}/")} == set(expected)
    for tag, points in expected.items():
        assert [s for s, _ in events[tag]] == [s for s, _ in points], tag
        # event files store float32
        assert [v for _, v in events[tag]] == pytest.approx([v for _, v in points], rel=1e-6, abs=1e-30), tag
    return events


def test_scalars_take_every_finite_number_and_nest_dicts():
    record = {"step": 3, "loss": 0.5, "lr": 1e-4, "count": 7, "acc": None, "nan": float("nan"), "note": "text",
              "flag": True, "with_image": {"mlm_acc": 0.25, "split": "val"}}
    assert scalars(record, "train") == {"train/loss": 0.5, "train/lr": 1e-4, "train/count": 7.0,
                                        "train/with_image/mlm_acc": 0.25}


def _write(out: Path, steps: range, resume_step: int | None = None, scale: float = 1.0) -> None:
    with TrainingEvents(out, resume_step=resume_step) as events:
        for step in steps:
            events.write({"step": step, "loss": scale * step})


def test_a_resumed_run_replaces_the_steps_after_its_checkpoint(tmp_path):
    _write(tmp_path, range(1, 6))  # interrupted after step 5, its checkpoint at step 3
    _write(tmp_path, range(3, 8), resume_step=3, scale=10.0)  # the last record of the checkpoint, then on
    assert len(list((tmp_path / EVENTS_DIR).iterdir())) == 2
    assert read_scalars(tmp_path / EVENTS_DIR)["train/loss"] == [(1, 1.0), (2, 2.0), (3, 30.0), (4, 40.0),
                                                                 (5, 50.0), (6, 60.0), (7, 70.0)]


def test_a_fresh_run_drops_the_event_files_of_an_earlier_one(tmp_path):
    _write(tmp_path, range(1, 6), scale=2.0)
    _write(tmp_path, range(1, 3))
    assert len(list((tmp_path / EVENTS_DIR).iterdir())) == 1
    assert read_scalars(tmp_path / EVENTS_DIR)["train/loss"] == [(1, 1.0), (2, 2.0)]


def test_disabled_writer_writes_nothing(tmp_path):
    with TrainingEvents(tmp_path, enabled=False) as events:
        events.write({"step": 1, "loss": 1.0})
    assert not (tmp_path / EVENTS_DIR).exists()


def test_a_resumed_runs_event_file_never_shares_the_interrupted_ones_second(tmp_path):
    """Event files are read in name order; a resumed run's file named in the same second as the interrupted
    run's could sort first ('...0.10' < '...0.9') and take the purge of the steps trained again with it."""
    import time

    from vlbert_core.tensorboard_log import wait_for_a_new_second

    second = int(time.time())
    (tmp_path / f"events.out.tfevents.{second}.host.1.9").write_bytes(b"")
    (tmp_path / "not-an-event-file").write_bytes(b"")
    wait_for_a_new_second(tmp_path)
    assert int(time.time()) != second
