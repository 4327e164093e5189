"""Write webdataset tar shards atomically and reproducibly.

`webdataset.TarWriter` takes a fixed `mtime`, user/group names and file mode (uid/gid stay 0),
and writes members in sorted-extension order, so the same samples in the same order give a
byte-identical tar. The tar is written under a temporary name and renamed when closed, so a
crashed job never leaves a tar that looks finished.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import tarfile
from pathlib import Path
from typing import Any, Mapping

import webdataset

from vlbert_core.utils import atomic_path

FIXED_MTIME = 0  # member timestamps: a constant, so reruns are byte-identical (an int: a float adds a PAX header per member)
_OWNER = "vlbert"
# Members are small (tens of KB); one large buffer turns four write calls per sample into one per MiB.
_WRITE_BUFFER_BYTES = 1 << 20
_MEMBER_MODE = 0o444
# webdataset groups members by the part of the name before the first dot, so keys carry no dots.
_KEY_PATTERN = re.compile(r"^[A-Za-z0-9_-]+$")
_EXT_PATTERN = re.compile(r"^[a-z0-9]+(\.[a-z0-9]+)*$")


def cc_key(split: str, row: int) -> str:
    """The sample key of TSV row `row` of `split`, e.g. train-000000042."""
    return f"{split}-{row:09d}"


def text_key(corpus: str, doc_index: int) -> str:
    """The sample key of document `doc_index` of a text corpus, e.g. wiki-000000007."""
    return f"{corpus}-{doc_index:09d}"


def encode_json(obj: Mapping[str, Any]) -> bytes:
    """Canonical JSON (sorted keys, no spaces) so identical metadata gives identical bytes."""
    return json.dumps(obj, sort_keys=True, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


class TarShardWriter:
    """Context manager writing samples {ext: bytes|str} under keys into one tar.

        with TarShardWriter("results/shards/cc/train-00000.tar") as shard:
            shard.write("train-000000000", {"jpg": jpeg, "txt": caption, "json": meta})

    The tar appears under its final name only when the block exits without an exception.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.count = 0
        self._keys: set[str] = set()
        self._stack: contextlib.ExitStack | None = None
        self._tar: webdataset.TarWriter | None = None

    def __enter__(self) -> "TarShardWriter":
        stack = contextlib.ExitStack()
        try:
            tmp = stack.enter_context(atomic_path(self.path))
            handle = stack.enter_context(open(tmp, "wb", buffering=_WRITE_BUFFER_BYTES))
            self._tar = webdataset.TarWriter(
                handle, user=_OWNER, group=_OWNER, mode=_MEMBER_MODE, encoder=False, mtime=FIXED_MTIME
            )
            # webdataset (1.0) works out USTAR as its default format but never hands it to tarfile, which then
            # checks every member for PAX fields it never needs: keys are ASCII and short, sizes < 8 GiB, and
            # the mtime is an int. Same bytes either way, one pure-Python pass less per member.
            self._tar.tarstream.format = tarfile.USTAR_FORMAT
            stack.callback(self._tar.close)  # runs before the file closes and before the rename
        except BaseException:
            stack.close()
            raise
        self._stack = stack
        return self

    def write(self, key: str, members: Mapping[str, bytes | str]) -> None:
        if self._tar is None:
            raise RuntimeError(f"{self.path}: write() outside the `with TarShardWriter(...)` block")
        if not _KEY_PATTERN.match(key):
            raise ValueError(f"{self.path}: sample key {key!r} must match {_KEY_PATTERN.pattern} (no dots)")
        if key in self._keys:
            raise ValueError(f"{self.path}: duplicate sample key {key!r}")
        if not members:
            raise ValueError(f"{self.path}: sample {key!r} has no members")
        sample: dict[str, Any] = {"__key__": key}
        for ext, value in members.items():
            if not _EXT_PATTERN.match(ext):
                raise ValueError(f"{self.path}: sample {key!r} has a bad member extension {ext!r}")
            sample[ext] = value.encode("utf-8") if isinstance(value, str) else bytes(value)
        self._tar.write(sample)
        self._keys.add(key)
        self.count += 1

    def __exit__(self, exc_type, exc, tb) -> bool:
        stack, self._stack, self._tar = self._stack, None, None
        assert stack is not None
        return stack.__exit__(exc_type, exc, tb)
