"""Read pickles from outside the project without running their code.

A pickle can name any importable callable and call it while loading (`os.system` included), so
files we did not write — published detector weights (`.pkl`), RefCOCO+'s `refs(unc).p` — are read
with an unpickler that resolves only the globals needed for numpy arrays and plain containers.
Anything else is refused with an error that names the file and the global it asked for.
"""

from __future__ import annotations

import os
import pickle
from pathlib import Path
from typing import Any

# (module, name) pairs a data-only pickle needs: numpy arrays and scalars (both numpy 1 and 2 module
# paths, since published pickles were written by either), the bytes codec Python 2 pickles use for
# array buffers, and ordered dicts.
ALLOWED_GLOBALS = frozenset({
    ("numpy", "ndarray"),
    ("numpy", "dtype"),
    ("numpy.core.multiarray", "_reconstruct"),
    ("numpy.core.multiarray", "scalar"),
    ("numpy._core.multiarray", "_reconstruct"),
    ("numpy._core.multiarray", "scalar"),
    ("_codecs", "encode"),
    ("collections", "OrderedDict"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
    ("__builtin__", "set"),       # Python 2 pickles
})


class UnsafePickleError(pickle.UnpicklingError):
    """The pickle asked for a global outside ALLOWED_GLOBALS (it could run code)."""


class _RestrictedUnpickler(pickle.Unpickler):
    def __init__(self, file, source: str, **kwargs):
        super().__init__(file, **kwargs)
        self._source = source

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in ALLOWED_GLOBALS:
            raise UnsafePickleError(
                f"{self._source}: refusing to load global {module}.{name} — only numpy arrays and plain "
                "containers are read from pickles (a pickle that names other callables can run code)")
        if module == "__builtin__":
            module = "builtins"
        return super().find_class(module, name)


def load_pickle(path: str | os.PathLike, *, encoding: str = "latin1") -> Any:
    """Load a data-only pickle. `encoding="latin1"` reads Python 2 pickles' str buffers as bytes,
    which is what numpy arrays saved under Python 2 need."""
    path = Path(path)
    with open(path, "rb") as f:
        try:
            return _RestrictedUnpickler(f, str(path), encoding=encoding).load()
        except (UnsafePickleError, UnicodeDecodeError):
            raise
        except Exception as e:  # truncated or not a pickle at all
            raise pickle.UnpicklingError(f"{path}: not a readable pickle ({type(e).__name__}: {e})") from e


def load_torch_file(path: str | os.PathLike, what: str) -> Any:
    """torch.load with weights_only=True (tensors and plain containers only, never code), on the CPU.
    Any failure names the file and `what` it was meant to be (e.g. "a detector checkpoint")."""
    import torch

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: {what} not found")
    if path.stat().st_size == 0:
        raise ValueError(f"{path}: empty file, not {what}")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise ValueError(f"{path}: not {what} readable as plain tensors and containers "
                         f"({type(e).__name__}: {_first_sentence(e)}); the file is damaged, cut short or not "
                         f"{what}") from None


def _first_sentence(exc: BaseException) -> str:
    """The gist of a loader's error: its first line, without torch's advice to load with weights_only=False,
    which would run code from the file (this project never does)."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    for marker in ("Weights only load failed", "weights_only"):
        if marker in text:
            return "it holds more than tensors and plain containers"
    return text[:200]
