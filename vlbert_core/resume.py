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
from vlbert_core.utils import atomic_path, get_logger

log = get_logger(__name__)


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


def previous_checkpoint(path: Path) -> Path:
    """Where the checkpoint before `path` is kept (checkpoint.pt -> checkpoint.previous.pt)."""
    path = Path(path)
    return path.with_name(f"{path.stem}.previous{path.suffix}")


def save_resume_checkpoint(payload: dict, path: Path) -> None:
    """Write `payload` to `path`, whole or not at all, keeping the checkpoint it replaces at
    previous_checkpoint(path): the last two. A machine that dies while writing leaves the previous one readable."""
    path = Path(path)
    if path.is_file():
        os.replace(path, previous_checkpoint(path))
    with atomic_path(path) as tmp:
        torch.save(payload, tmp)


def remove_resume_checkpoints(path: Path) -> None:
    """Both kept checkpoints: the job's outputs are complete, a re-run starts afresh."""
    for candidate in (Path(path), previous_checkpoint(path)):
        candidate.unlink(missing_ok=True)


def load_resume_checkpoint(path: Path, what: str) -> tuple[Path | None, dict | None]:
    """(file, checkpoint) of the newest readable checkpoint of the two kept (`path`, then its previous one), read
    with weights_only=True (a doctored file cannot run code); (None, None) when there is none. A damaged or
    truncated file is never loaded: a warning names it and why, and the previous one (or a fresh start) is taken."""
    path = Path(path)
    damaged = []
    for candidate in (path, previous_checkpoint(path)):
        if not candidate.is_file():
            continue
        try:
            return candidate, load_torch_file(candidate, what)
        except ValueError as e:
            damaged.append(candidate)
            log.warning("%s; not resuming from it", e)
    if damaged:
        log.warning("no readable checkpoint among %s: starting from scratch", [str(d) for d in damaged])
    return None, None
