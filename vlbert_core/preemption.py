"""Stopping a training job when the scheduler asks: a checkpoint at the end of the step, then exit.

SLURM sends SIGTERM when it preempts a job or the job reaches its time limit, and SIGKILL after the grace time
(KillWait, 30 s by default); `sbatch --signal=USR1@300` can send SIGUSR1 ahead of the limit instead. A signal
handler only sets a flag: the training loop finishes the step it is in, writes its resume checkpoint and raises
TrainingStopped, which exits with status 128 + the signal number. The requeued job (profiles/slurm:
slurm-requeue) or Snakemake's retry then resumes from that step with the weights an uninterrupted run has.

Under DDP every rank asks the others before stopping (one all-reduce of a flag per step): a rank that got the
signal a step later than another would otherwise wait forever in the checkpoint's collectives.
"""

from __future__ import annotations

import os
import signal
import threading

import torch
import torch.distributed as dist

from vlbert_core.utils import get_logger

log = get_logger(__name__)

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class TrainingStopped(SystemExit):
    """A training job stopped on a signal after writing its checkpoint. A SystemExit, so that no error boundary
    reports it as a failure of the code: the process exits with 128 + signal number, as if killed by it."""

    def __init__(self, signum: int, message: str):
        super().__init__(128 + signum)
        self.signum, self.message = signum, message

    def __str__(self) -> str:
        return self.message


class StopSignals:
    """`with StopSignals() as stop:` catches SIGTERM and SIGUSR1 for the duration of a training loop; the loop asks
    `stop.requested(world_size)` after each step. Outside the main thread (signals cannot be caught there) it
    catches nothing and never requests a stop."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, object] = {}

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():
            for signum in STOP_SIGNALS:
                self._previous[signum] = signal.signal(signum, self._catch)
        return self

    def __exit__(self, *exc) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    def _catch(self, signum: int, frame) -> None:
        self.signum = signum

    def requested(self, world_size: int = 1) -> bool:
        """Whether this process, or under DDP any rank, got a stop signal; every rank gets the same answer."""
        if world_size <= 1:
            return self.signum is not None
        # The signal number itself travels, so that every rank exits with the same status.
        flag = torch.tensor([self.signum or 0], dtype=torch.int64)
        if dist.get_backend() == "nccl":
            flag = flag.cuda()
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        self.signum = int(flag.item()) or None
        return self.signum is not None

    def after_step(self, step: int, total_steps: int, stop_after_step: int | None,
                   world_size: int = 1) -> str | None:
        """Why a training loop ends after `step`, before its last: "signal" (this process or, under DDP, any rank
        got a stop signal: raise `stop(...)` once the checkpoint is written), "asked" (the caller's
        `stop_after_step`: return once the checkpoint is written), or None to go on. Every rank gets the same
        answer. Either way the loop writes its checkpoint first."""
        if step < total_steps and self.requested(world_size):
            return "signal"
        if step == stop_after_step:
            return "asked"
        return None

    def stop(self, what: str, step: int, checkpoint: str) -> TrainingStopped:
        """The exception to raise once the checkpoint of `step` is written (its message goes to the log)."""
        name = signal.Signals(self.signum).name
        stopped = TrainingStopped(self.signum, f"{what}: stopped by {name} after step {step}; checkpoint written to "
                                               f"{checkpoint}, from which the same job resumes when run again")
        log.warning("%s", stopped)
        return stopped


def leave_quietly_on_stop_signals(worker_id: int = 0) -> None:
    """A DataLoader worker's answer to SIGTERM/SIGUSR1, which reach the whole process group: exit 0 at once. Killed by
    the signal instead, it would make the training process's SIGCHLD handler raise in the middle of writing the
    checkpoint; a worker that exits 0 is only noticed by the next batch asked of it, which never comes."""
    for signum in STOP_SIGNALS:
        signal.signal(signum, lambda *_: os._exit(0))
