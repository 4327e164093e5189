"""Small helpers shared by every stage: logging to a rule's log file, atomic writes, seeding."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import logging
import os
import random
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator, Mapping

import numpy as np

if TYPE_CHECKING:
    import torch


def setup_logging(log_path: str | os.PathLike | None, level: int = logging.INFO) -> logging.Logger:
    """Send the `vlbert` logger (and warnings) to the rule's log file and to stderr.

    Progress (vlbert_core.progress) is a live bar on a terminal and plain log lines elsewhere.
    """
    logger = logging.getLogger("vlbert")
    logger.setLevel(level)
    logger.handlers.clear()
    fmt = logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
    handlers: list[logging.Handler] = [logging.StreamHandler(sys.stderr)]
    if log_path:
        Path(log_path).parent.mkdir(parents=True, exist_ok=True)
        handlers.append(logging.FileHandler(log_path, mode="w"))
    for handler in handlers:
        handler.setFormatter(fmt)
        logger.addHandler(handler)
    logging.captureWarnings(True)
    return logger


def get_logger(name: str) -> logging.Logger:
    """A child of the `vlbert` logger, e.g. get_logger(__name__)."""
    return logging.getLogger("vlbert").getChild(name.removeprefix("vlbert_core."))


DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path next to `path`; rename it into place only if the block succeeds.

    A reader never sees a half-written file under the final name: a crash leaves at most a
    `.tmp-*` file behind, which the next run overwrites.
    """
    final = Path(path)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f".tmp-{os.getpid()}-{final.name}")
    try:
        yield tmp
        os.replace(tmp, final)
    except OSError as e:
        if e.errno in DISK_FULL_ERRNOS:
            # The OS error names neither the output nor what became of it.
            raise OSError(e.errno, f"{final}: {e.strerror} while writing it; nothing was kept under that name. "
                                   "Free space (or raise the quota) and run again") from e
        raise
    finally:
        if tmp.exists():
            tmp.unlink()


def save_safetensors(state_dict: Mapping[str, "torch.Tensor"], path: str | os.PathLike,
                     metadata: Mapping[str, str] | None = None) -> None:
    """Write a state dict as safetensors (detached, on CPU, contiguous), atomically."""
    from safetensors.torch import save_file

    state = {k: v.detach().cpu().contiguous() for k, v in state_dict.items()}
    with atomic_path(path) as tmp:
        save_file(state, str(tmp), metadata=None if metadata is None else dict(metadata))


def load_safetensors(path: str | os.PathLike,
                     keep: Callable[[str], bool] | None = None) -> dict[str, "torch.Tensor"]:
    """The tensors of a safetensors file (only the keys `keep` accepts, when given), on CPU. A missing, truncated
    or foreign file is an error naming it."""
    from safetensors import SafetensorError, safe_open

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist")
    try:
        with safe_open(str(path), "pt") as f:
            return {k: f.get_tensor(k) for k in f.keys() if keep is None or keep(k)}
    except SafetensorError as exc:
        raise ValueError(f"{path}: not a readable safetensors file ({exc}); it is damaged or was cut short: write "
                         "it again (re-run the job or the conversion that makes it)") from None


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch (if imported) for a deterministic run."""
    random.seed(seed)
    np.random.seed(seed % (2**32))
    if "torch" in sys.modules:
        import torch

        torch.manual_seed(seed)


# glibc mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_KEEP_BLOCKS_BELOW = 1 << 30   # bytes; the default run's largest tensors are ~50 MB, BERT-BASE's ~100 MB


def keep_freed_memory() -> bool:
    """Let this process reuse the large blocks it frees rather than hand them back to the OS and fault
    them in again.

    glibc serves a block above its mmap threshold (at most 32 MiB by default) with its own mmap and unmaps
    it on free. A job that allocates the same large tensors again and again (a training step's 47 MB
    word-embedding gradient, a detector batch's feature maps) then pays for fresh zeroed pages every time.
    With both thresholds raised the blocks stay in the heap: RoI extraction ran 30% faster in the default
    run, its peak memory 1.0 -> 1.4 GB (docs/benchmarks.md, "What 1,200 s took"). Computed values do not
    change. Returns False where the C library is not glibc (nothing changes there).
    """
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return (bool(mallopt(_M_MMAP_THRESHOLD, _KEEP_BLOCKS_BELOW))
            and bool(mallopt(_M_TRIM_THRESHOLD, 2 * _KEEP_BLOCKS_BELOW - 1)))


def setup_compute(threads: int) -> None:
    """Set up a job's process for torch: exactly the cores Snakemake gave it (torch would otherwise take
    them all), and freed memory kept for reuse (keep_freed_memory)."""
    keep_freed_memory()
    threads = max(1, int(threads))
    os.environ["OMP_NUM_THREADS"] = str(threads)
    if "torch" in sys.modules:
        import torch

        torch.set_num_threads(threads)
        with contextlib.suppress(RuntimeError):
            torch.set_num_interop_threads(1)


def _duplicate_key(node, where: tuple[str, ...] = ()) -> tuple[str, int, int] | None:
    """(dotted key, first line, second line) of the first key given twice in one mapping of a composed YAML
    node tree, or None. YAML's merge key `<<` is not a key of its own."""
    import yaml

    if isinstance(node, yaml.MappingNode):
        seen: dict = {}
        for key_node, value_node in node.value:
            key = key_node.value if isinstance(key_node, yaml.ScalarNode) else None
            if key is not None and key != "<<":
                path = ".".join((*where, str(key)))
                if key in seen:
                    return path, seen[key], key_node.start_mark.line + 1
                seen[key] = key_node.start_mark.line + 1
                found = _duplicate_key(value_node, (*where, str(key)))
            else:
                found = _duplicate_key(value_node, where)
            if found:
                return found
    elif isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            found = _duplicate_key(item, (*where[:-1], f"{where[-1]}[{index}]") if where else (f"[{index}]",))
            if found:
                return found
    return None


def read_yaml(path: str | Path, what: str = "config") -> dict:
    """A YAML mapping (an empty file: {}), the one reader of the project's config files: a file that is not YAML,
    not a mapping, or gives a key twice in one mapping (YAML would keep the last value without a word) is an error
    naming it and the line(s)."""
    import yaml

    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
        # libyaml's parser where PyYAML has it (the same constructor and resolver: the same values, 20x faster)
        loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
        duplicate = _duplicate_key(yaml.compose(text, Loader=loader))
        if duplicate:
            key, first, second = duplicate
            raise ValueError(f"{what} {path}: key {key} is given twice, lines {first} and {second}; YAML would keep "
                             f"the second without a word: delete one")
        data = yaml.load(text, Loader=loader)
    except UnicodeDecodeError as err:
        raise ValueError(f"{what} {path}: not UTF-8 text (byte {err.object[err.start]:#04x} at offset {err.start})") from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise ValueError(f"{what} {path}{where}: not valid YAML ({problem})") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"{what} {path}: expected a mapping of keys, got {type(data).__name__}")
    return data


def read_jsonl(path: str | Path, line_field: str | None = None) -> list[dict]:
    """Every row of a JSON-lines file (blank lines skipped); names the file and line of one that is not a
    JSON object. With `line_field`, each row also gets its 1-based line number under that key."""
    import json

    rows = []
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise ValueError(f"{path} line {number}: not UTF-8 text (byte {raw[err.start]:#04x} at column "
                                 f"{err.start + 1}); save the file as UTF-8") from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path} line {number}: not valid JSON ({err})") from None
            if not isinstance(row, dict):
                raise ValueError(f"{path} line {number}: expected a JSON object, got {type(row).__name__}")
            rows.append(row if line_field is None else {**row, line_field: number})
    return rows
