"""TensorBoard event files of the training loops, written from the records that go into metrics.jsonl.

A loop hands each metrics record (one dict per step) to `TrainingEvents.write`; every number in it
becomes a scalar `<section>/<key>` at the record's step (nested dicts: `<section>/<key>/<subkey>`), so the
event files and metrics.jsonl hold the same values. Text, booleans and missing values (None, NaN) are
left out. The files go to <out dir>/tensorboard/, which no workflow rule declares as an output: a job
counts as finished by its model and metrics files alone, so a half-written event file never makes it
look done.

A fresh run deletes the directory's earlier event files. A resumed run starts a new event file that
purges, in TensorBoard's view, every event of the earlier files from the resume step on (those were
written after the checkpoint and are trained again), and writes the checkpoint's last record again.
"""

from __future__ import annotations

import math
import shutil
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

EVENTS_DIR = "tensorboard"
FLUSH_SECONDS = 30  # how stale a live TensorBoard view may be


def scalars(record: Mapping[str, Any], section: str) -> dict[str, float]:
    """The TensorBoard scalars of one record: {tag: value} for every finite number in it but `step`."""
    return dict(_numbers(record, section, top=True))


def _numbers(record: Mapping[str, Any], prefix: str, *, top: bool) -> Iterator[tuple[str, float]]:
    for key, value in record.items():
        if top and key == "step":
            continue
        tag = f"{prefix}/{key}"
        if isinstance(value, Mapping):
            yield from _numbers(value, tag, top=False)
        elif isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            yield tag, float(value)


def wait_for_a_new_second(directory: Path) -> None:
    """Return once the clock's second differs from that in the names of `directory`'s event files.

    TensorBoard reads a directory's event files in name order, and a name is `events.out.tfevents.<unix
    second>.<host>.<pid>.<counter>`: a resumed run's file written in the same second as the interrupted run's
    (a quick requeue, a test) could sort before it, its counter being compared as text ('10' < '9'), and then
    the purge of the steps trained again would apply to the wrong file."""
    seconds = {name.split(".")[3] for name in (f.name for f in directory.glob("events.out.tfevents.*"))
               if len(name.split(".")) > 3}
    while str(int(time.time())) in seconds:
        time.sleep(0.05)


class TrainingEvents:
    """The event files of one training run in <out_dir>/tensorboard/; a no-op where `enabled` is false
    (every rank but 0 under DDP).

    `resume_step`: the step of the checkpoint this run resumed from (None: a fresh run).
    """

    def __init__(self, out_dir: str | Path, *, resume_step: int | None = None, enabled: bool = True):
        self.directory = Path(out_dir) / EVENTS_DIR
        self.writer = None
        if not enabled:
            return
        if resume_step is None and self.directory.exists():
            shutil.rmtree(self.directory)  # the curves of an earlier run of this output directory
        from torch.utils.tensorboard import SummaryWriter  # tensorboard loads only where a loop writes events

        if resume_step is not None:
            wait_for_a_new_second(self.directory)
        self.writer = SummaryWriter(str(self.directory), flush_secs=FLUSH_SECONDS, purge_step=resume_step)

    def write(self, record: Mapping[str, Any], section: str = "train", step: int | None = None) -> None:
        """Every number of `record` as a scalar at `step` (default: the record's own "step")."""
        if self.writer is None:
            return
        at = int(record["step"] if step is None else step)
        for tag, value in scalars(record, section).items():
            self.writer.add_scalar(tag, value, at)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None

    def __enter__(self) -> TrainingEvents:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_scalars(directory: str | Path) -> dict[str, list[tuple[int, float]]]:
    """{tag: [(step, value), ...]} of the event files in `directory`, as TensorBoard shows them (an event
    purged by a resumed run is gone)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(directory), size_guidance={"scalars": 0})  # 0: keep every event
    accumulator.Reload()
    return {tag: [(e.step, e.value) for e in accumulator.Scalars(tag)] for tag in accumulator.Tags()["scalars"]}
