"""The process set-up every torch job runs first (vlbert_core.utils.setup_compute)."""

from __future__ import annotations

import subprocess
import sys

import pytest


# In a fresh process: free a 64 MiB block (above glibc's largest default mmap threshold, 32 MiB) and
# print how much of it the process still holds.
_RETAINED = """
import os, sys
import numpy as np
from vlbert_core.utils import setup_compute
if sys.argv[1] == "setup":
    setup_compute(1)
def resident():
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
before = resident()
block = np.ones(64 << 20, dtype=np.uint8)   # touched, so resident
del block
print((resident() - before) >> 20)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc; glibc's malloc")
def test_a_job_process_keeps_a_freed_large_block_for_reuse():
    def retained_mib(mode: str) -> int:
        done = subprocess.run([sys.executable, "-c", _RETAINED, mode], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        return int(done.stdout.strip())

    assert retained_mib("default") < 16     # glibc unmapped it on free
    assert retained_mib("setup") >= 60      # kept in the heap: the next step's block of this size reuses it
