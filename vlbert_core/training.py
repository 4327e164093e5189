"""One resumable training run, shared by pre-training (pretrain/loop.py) and fine-tuning (tasks/finetune.py).

A loop builds its model, optimiser, scheduler and batches, then hands them to a `TrainingRun`, which owns
everything around the steps (nanoGPT's loop, read top to bottom):

    run = TrainingRun(out_dir, "finetune vqa/full/half", fingerprint=..., checkpoint_format=2, total_steps=...,
                      parts={"model": model, "optimizer": optimizer, "scheduler": scheduler}, data=batches,
                      device=dev, checkpoint_every=1000)
    run.resume()                   # the checkpoint of an interrupted run, if it is this run's (fingerprint)
    if run.train(train_step, stop_after_step):   # train_step(step) -> the step's metrics record
        return ...                 # stopped as asked, after writing a checkpoint
    ... write the outputs (run.metrics: one record per step), run.close()

The checkpoint (<out_dir>/checkpoint.pt, the one before kept as checkpoint.previous.pt: vlbert_core/resume.py)
holds {"format", "fingerprint", **labels, "step", each part's state_dict(), "data": the batches' state(),
"rng": the RNG states, "metrics": the records so far} (+ "train_seconds" with `timed`). With `per_rank`
"data" and "rng" are lists with one entry per rank, gathered to rank 0 (DDP), which writes the file.
Each record also goes to TensorBoard (tensorboard_log.py) and the progress bar; a stop signal (SLURM preemption,
vlbert_core/preemption.py) ends the run after the step's checkpoint by raising TrainingStopped.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from vlbert_core.preemption import StopSignals
from vlbert_core.progress import Progress
from vlbert_core.resume import load_resume_checkpoint, rng_state, save_resume_checkpoint, set_rng_state
from vlbert_core.tensorboard_log import TrainingEvents
from vlbert_core.utils import get_logger

log = get_logger(__name__)

CHECKPOINT_FILE = "checkpoint.pt"
LOG_LINES = 20  # metrics log lines over a run


def gather(obj: Any, world_size: int) -> list:
    """`obj` of every rank (rank order); [obj] without DDP."""
    if world_size == 1:
        return [obj]
    out: list = [None] * world_size
    dist.all_gather_object(out, obj)
    return out


class TrainingRun:
    """The steps of one training job, resumable: see the module docstring.

    `what` names the run (progress bar, stop message); `parts` are the objects with state_dict /
    load_state_dict the checkpoint holds (model, heads, optimizer, scheduler), `data` the batches (state /
    load_state); `labels` go into the checkpoint as they are; `per_rank`: "data" and "rng" are lists, one entry
    per rank (pre-training, with or without DDP); `final_checkpoint`: also write one after the last step
    (pre-training keeps it); `timed`: keep the training seconds across resumes ("train_seconds")."""

    def __init__(self, out_dir: str | Path, what: str, *, fingerprint: str, checkpoint_format: int, total_steps: int,
                 parts: Mapping[str, Any], data: Any, device: torch.device, checkpoint_every: int,
                 kind: str = "a training checkpoint", labels: Mapping[str, Any] | None = None, rank: int = 0,
                 world_size: int = 1, per_rank: bool = False, final_checkpoint: bool = False, timed: bool = False):
        self.out_dir, self.what, self.kind = Path(out_dir), what, kind
        self.fingerprint, self.checkpoint_format = fingerprint, checkpoint_format
        self.total_steps, self.checkpoint_every = total_steps, checkpoint_every
        self.parts, self.data, self.device, self.labels = dict(parts), data, device, dict(labels or {})
        self.rank, self.world_size, self.is_main = rank, world_size, rank == 0
        self.per_rank, self.final_checkpoint, self.timed = per_rank, final_checkpoint, timed
        self.checkpoint_path = self.out_dir / CHECKPOINT_FILE
        self.step, self.metrics, self.resumed_from = 0, [], None
        self.seconds_before, self.started = 0.0, time.perf_counter()
        self.events: TrainingEvents | None = None

    # ---- resume -----------------------------------------------------------------------------------

    def resume(self) -> int | None:
        """Load the newest readable checkpoint if it is this run's (format and fingerprint); the step it
        resumed from, or None (a checkpoint of another configuration or input is left alone, with a warning)."""
        found, ckpt = load_resume_checkpoint(self.checkpoint_path, self.kind)
        if ckpt is None:
            return None
        if ckpt.get("format") != self.checkpoint_format or ckpt.get("fingerprint") != self.fingerprint:
            log.warning("%s belongs to another configuration or input; starting from scratch", found)
            return None
        for name, part in self.parts.items():
            part.load_state_dict(ckpt[name])
        self.data.load_state(ckpt["data"][self.rank] if self.per_rank else ckpt["data"])
        set_rng_state(ckpt["rng"][self.rank] if self.per_rank else ckpt["rng"], self.device)
        self.step, self.metrics = int(ckpt["step"]), list(ckpt["metrics"])
        if self.timed:
            self.seconds_before = float(ckpt["train_seconds"])
        self.resumed_from = self.step
        log.info("resumed from %s at step %d", found, self.step)
        return self.step

    # ---- checkpoint -------------------------------------------------------------------------------

    def elapsed(self) -> float:
        """Training seconds so far, the runs before a resume included (with `timed`)."""
        return self.seconds_before + time.perf_counter() - self.started

    def save_checkpoint(self) -> None:
        """Every rank calls it (the data and RNG states are gathered); rank 0 writes the file."""
        data, rng = self.data.state(), rng_state(self.device)
        if self.per_rank:
            data, rng = gather(data, self.world_size), gather(rng, self.world_size)
        if not self.is_main:
            return
        payload = {"format": self.checkpoint_format, "fingerprint": self.fingerprint, **self.labels, "step": self.step,
                   **{name: part.state_dict() for name, part in self.parts.items()}, "data": data, "rng": rng,
                   "metrics": self.metrics}
        if self.timed:
            payload["train_seconds"] = self.elapsed()
        save_resume_checkpoint(payload, self.checkpoint_path)

    # ---- the steps --------------------------------------------------------------------------------

    def train(self, train_step: Callable[[int], dict], stop_after_step: int | None = None) -> bool:
        """Run `train_step(step)` (step: the number of the step it trains, from 1) until total_steps; each returns
        the step's metrics record. True when it stopped after `stop_after_step` (its checkpoint written);
        raises TrainingStopped on a stop signal (after the checkpoint); False at the end."""
        self.events = TrainingEvents(self.out_dir, resume_step=self.resumed_from, enabled=self.is_main)
        if self.metrics:
            self.events.write(self.metrics[-1])  # purged with the steps trained again after the checkpoint
        self.started = time.perf_counter()
        log_every = max(1, self.total_steps // LOG_LINES)
        progress = Progress(total=self.total_steps, initial=self.step, desc=self.what, unit="step", mininterval=5.0,
                            disable=not self.is_main)
        with StopSignals() as stop:
            while self.step < self.total_steps:
                record = train_step(self.step + 1)
                self.step += 1
                self.metrics.append(record)
                self.events.write(record)
                progress.update(1)
                progress.set_postfix(loss=f"{record['loss']:.4f}", lr=f"{record['lr']:.2e}")
                if self.step == 1 or self.step % log_every == 0 or self.step == self.total_steps:
                    log.info("step %d/%d %s", self.step, self.total_steps, " ".join(
                        f"{k}={v:.4g}" for k, v in record.items() if k != "step" and isinstance(v, (int, float))))
                why_stop = stop.after_step(self.step, self.total_steps, stop_after_step, self.world_size)
                if why_stop or (self.step < self.total_steps and self.step % self.checkpoint_every == 0) \
                        or (self.step == self.total_steps and self.final_checkpoint):
                    self.save_checkpoint()
                if why_stop:
                    progress.close()
                    self.close()
                    if why_stop == "signal":  # SIGTERM: SLURM preempts or hits the time limit
                        raise stop.stop(self.what, self.step, str(self.checkpoint_path))
                    log.info("stopping after step %d as asked (checkpoint written)", self.step)
                    return True
        progress.close()
        return False

    def close(self) -> None:
        if self.events is not None:
            self.events.close()
