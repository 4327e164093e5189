"""Progress of long jobs on a redirected console: a few plain lines, not one per redraw (vlbert_core/progress.py)."""

from __future__ import annotations

import logging

from vlbert_core import progress as progress_module
from vlbert_core.progress import Progress


def test_a_redirected_console_gets_a_line_per_interval_and_one_at_the_end(monkeypatch, caplog):
    monkeypatch.setattr(progress_module, "_stderr_is_terminal", lambda: False)
    caplog.set_level(logging.INFO, logger="vlbert.progress")
    bar = Progress(total=600, desc="detector")
    assert bar.plain
    for step in range(600):   # what a training loop does every step
        bar.update(1)
        bar.set_postfix(loss=f"{1.0 / (step + 1):.3f}")
    bar.close()
    lines = [r.getMessage() for r in caplog.records if r.name == "vlbert.progress"]
    # the first draw, none while under the 30 s interval, and the last; never one per step
    assert 1 <= len(lines) <= 3, lines
    assert lines[-1].startswith("detector: 600/600 (100%)") and "loss=0.002" in lines[-1]
    assert all("\r" not in line for line in lines)


def test_a_terminal_gets_tqdm_itself(monkeypatch):
    monkeypatch.setattr(progress_module, "_stderr_is_terminal", lambda: True)
    bar = Progress(total=3, disable=True)
    assert not bar.plain
    bar.close()
