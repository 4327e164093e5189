"""StopSignals' end-of-step answer, which both training loops (pre-training and fine-tuning) act on. The loops
themselves are stopped for real in tests/workflow/test_faults.py and tests/tasks/test_tasks.py."""

from __future__ import annotations

import signal

from vlbert_core.preemption import StopSignals


def test_after_step_says_signal_before_asked_and_never_after_the_last_step():
    with StopSignals() as stop:
        assert stop.after_step(3, 10, stop_after_step=None) is None
        assert stop.after_step(3, 10, stop_after_step=3) == "asked"
        assert stop.after_step(10, 10, stop_after_step=10) == "asked"   # the caller's stop, even at the last step
        signal.raise_signal(signal.SIGTERM)                               # caught: only a flag is set
        assert stop.after_step(3, 10, stop_after_step=3) == "signal"     # the signal wins: it exits non-zero
        assert stop.after_step(10, 10, stop_after_step=None) is None     # the last step ends the run normally
        assert stop.stop("pretrain full", 3, "ckpt.pt").code == 128 + signal.SIGTERM
