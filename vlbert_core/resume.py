"""What a training loop needs to stop and resume exactly: RNG states, a run fingerprint, the checkpoint reader.

Pre-training (pretrain/loop.py) and fine-tuning (tasks/finetune.py) write their own checkpoint layout;
both keep it loadable with torch.load(weights_only=True): plain types and tensors only.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch

from vlbert_core.safe_pickle import load_torch_file


def rng_state(device: torch.device) -> dict:
    """Python, NumPy, torch CPU (and this CUDA device's) generator states, as plain types and tensors."""
    kind, keys, pos, has_gauss, cached_gaussian = np.random.get_state()
    numpy_state = [kind, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached_gaussian)]
    state = {"python": random.getstate(), "numpy": numpy_state, "torch": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict, device: torch.device) -> None:
    random.setstate(state["python"])
    kind, keys, pos, has_gauss, cached_gaussian = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached_gaussian))
    torch.set_rng_state(state["torch"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def run_fingerprint(**parts: Any) -> str:
    """What a checkpoint must agree on to be resumed: settings, config and the input files' identity
    (`files`: path, size and modification time of each)."""
    def file_id(path: str | os.PathLike) -> list:
        st = os.stat(path)
        return [str(path), st.st_size, st.st_mtime_ns]

    payload = {k: v for k, v in parts.items() if k != "files"}
    payload["files"] = [file_id(p) for p in parts.get("files", [])]
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()


def load_resume_checkpoint(path: Path, what: str) -> dict:
    """A resume checkpoint, read with weights_only=True: a doctored file cannot run code."""
    try:
        return load_torch_file(path, what)
    except ValueError as e:
        raise ValueError(f"{e}; delete it to start from scratch") from e
