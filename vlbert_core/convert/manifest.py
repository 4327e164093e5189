"""Manifests of published checkpoints, and random-valued stand-ins written from them.

A manifest (JSON, in vlbert_core/convert/manifests/: package data, MANIFEST_DIR) records, as facts from
the authors' model definitions, what a published file holds: its container format, where the tensors sit
inside it, and every tensor's key, shape and dtype. Tests and the rehearsal config write a file with exactly those keys
and shapes but random values (`write_stand_in`), then convert it: this exercises each converter on
the published layout with no network and no multi-GB download.

Manifest fields:
  file        the published file name (e.g. "vl-bert-base-e2e.model")
  format      "torch" (torch.save), or "pickle" (a data-only pickle of numpy arrays)
  wrap        keys leading from the top-level object to the tensor dict, e.g. ["state_dict"]
  extra       other top-level entries written as they are (e.g. {"epoch": 0})
  tensors     {key: {"shape": [...], "dtype": "float32"}}
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

FORMATS = ("torch", "pickle")
# The manifests of the published files, shipped with the package (the rehearsal's rule stand_in reads them)
MANIFEST_DIR = Path(__file__).parent / "manifests"


@dataclass(frozen=True)
class Manifest:
    file: str
    format: str
    wrap: tuple[str, ...]
    tensors: dict[str, tuple[tuple[int, ...], str]]
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Manifest":
        data = json.loads(Path(path).read_text())
        for key in ("file", "format", "wrap", "tensors"):
            if key not in data:
                raise ValueError(f"manifest {path}: missing field {key!r}")
        if data["format"] not in FORMATS:
            raise ValueError(f"manifest {path}: format {data['format']!r} is not one of {FORMATS}")
        tensors = {k: (tuple(v["shape"]), v.get("dtype", "float32")) for k, v in data["tensors"].items()}
        return cls(file=data["file"], format=data["format"], wrap=tuple(data["wrap"]), tensors=tensors,
                   extra=dict(data.get("extra", {})))

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {k: shape for k, (shape, _) in self.tensors.items()}


def _random_array(shape: tuple[int, ...], dtype: str, rng: np.random.Generator) -> np.ndarray:
    if dtype.startswith("int"):
        return rng.integers(0, 10, size=shape).astype(dtype)
    # small values, like trained weights; running variances must stay positive
    return (rng.standard_normal(size=shape) * 0.05).astype(dtype)


def stand_in_tensors(manifest: Manifest, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    arrays = {}
    for key, (shape, dtype) in manifest.tensors.items():
        value = _random_array(shape, dtype, rng)
        if key.endswith(("running_var", "moving_variance")):
            value = np.abs(value) + 0.5
        arrays[key] = value
    return arrays


def write_stand_in(manifest: Manifest, path: str | os.PathLike, seed: int = 0,
                   overrides: dict[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
    """Write a file laid out as `manifest` says, with random values (or `overrides` where given; when they
    cover every tensor, no random value is drawn). Returns the arrays written, so a test can compute expected
    outputs from them by hand."""
    from ..utils import atomic_path

    overrides = overrides or {}
    arrays = {} if set(manifest.tensors) <= set(overrides) else stand_in_tensors(manifest, seed)
    for key, value in overrides.items():
        if key not in manifest.tensors:
            raise KeyError(f"override {key!r} is not in manifest {manifest.file}")
        arrays[key] = value
    if manifest.format == "torch":
        tensors: dict[str, Any] = {k: torch.from_numpy(v.copy()) for k, v in arrays.items()}
    else:
        tensors = dict(arrays)
    obj: Any = tensors
    for key in reversed(manifest.wrap):
        obj = {key: obj}
    if manifest.extra:
        if not isinstance(obj, dict) or not manifest.wrap:
            raise ValueError(f"manifest {manifest.file}: `extra` needs a non-empty `wrap`")
        obj = {**manifest.extra, **obj}
    with atomic_path(Path(path)) as tmp:
        if manifest.format == "torch":
            torch.save(obj, tmp)
        else:
            import pickle

            Path(tmp).write_bytes(pickle.dumps(obj, protocol=2))
    return arrays


def read_published(path: str | os.PathLike, wrap: tuple[str, ...],
                   outside: list[str] | None = None) -> dict[str, torch.Tensor]:
    """The tensor dict of a published checkpoint, read without running code from it: torch files
    with `weights_only=True`, pickles with the restricted unpickler. `wrap` as in the manifest.
    `outside`, if given, receives the top-level entries not on the `wrap` path (e.g. 'optimizer')."""
    from ..safe_pickle import load_pickle, load_torch_file

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: checkpoint not found")
    if path.suffix in (".pkl", ".p", ".pickle"):
        obj = load_pickle(path)
    else:
        obj = load_torch_file(path, "a torch checkpoint")
    if outside is not None and wrap and isinstance(obj, dict):
        outside.extend(str(k) for k in obj if k != wrap[0])
    for key in wrap:
        if not isinstance(obj, dict) or key not in obj:
            found = sorted(obj)[:10] if isinstance(obj, dict) else type(obj).__name__
            raise ValueError(f"{path}: expected an entry {key!r} (path {list(wrap)}); found {found}")
        obj = obj[key]
    if not isinstance(obj, dict):
        raise ValueError(f"{path}: expected a dict of tensors under {list(wrap)}, got {type(obj).__name__}")
    out = {}
    for key, value in obj.items():
        if isinstance(value, np.ndarray):
            value = torch.from_numpy(np.ascontiguousarray(value))
        if not isinstance(value, torch.Tensor):
            raise ValueError(f"{path}: entry {key!r} is a {type(value).__name__}, not a tensor")
        out[key] = value
    return out
