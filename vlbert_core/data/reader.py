"""Read a Conceptual Captions TSV (`caption<TAB>url`, no header) into numbered rows.

A row is one line of the file, numbered from 0 in file order; the row number is the sample's
identity everywhere downstream (shard key, accounting parquet). Malformed lines are returned as
rows carrying an `error` instead of being dropped, so that every line of the file is accounted for.

The file is split on b"\\n" only (a trailing b"\\r" is removed), and fields on a literal tab: the
published TSVs are not CSV-quoted, and captions may contain quote characters.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

EXPECTED_FIELDS = 2  # caption, url


@dataclass(frozen=True)
class CCRow:
    """One line of a CC TSV. `error` is None for a usable row, else why the line is malformed."""

    row: int
    caption: str
    url: str
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


def parse_cc_line(raw: bytes, row: int, source: str = "<tsv>") -> CCRow:
    """Parse one raw TSV line (without its newline) into a CCRow, never raising on bad content."""
    where = f"{source} line {row + 1}"
    raw = raw.removesuffix(b"\r")
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        preview = raw[:60].decode("utf-8", errors="replace")
        return CCRow(row, "", "", f"{where}: bad encoding, not UTF-8 ({err.reason} at byte {err.start}): {preview!r}")
    fields = line.split("\t")
    if len(fields) != EXPECTED_FIELDS:
        return CCRow(
            row,
            fields[0].strip(),
            fields[1].strip() if len(fields) > 1 else "",
            f"{where}: wrong field count, expected {EXPECTED_FIELDS} (caption<TAB>url), got {len(fields)}: {line[:80]!r}",
        )
    caption, url = fields[0].strip(), fields[1].strip()
    if not caption:
        return CCRow(row, caption, url, f"{where}: empty caption")
    if not url:
        return CCRow(row, caption, url, f"{where}: empty url")
    return CCRow(row, caption, url)


def iter_cc_tsv(path: str | os.PathLike, start: int = 0, stop: int | None = None) -> Iterator[CCRow]:
    """Yield the rows with start <= row < stop (all rows from `start` when stop is None), in order."""
    path = Path(path)
    if start < 0 or (stop is not None and stop < start):
        raise ValueError(f"{path}: bad row range [{start}, {stop})")
    with open(path, "rb") as handle:
        for row, raw in enumerate(handle):
            if stop is not None and row >= stop:
                break
            if row >= start:
                yield parse_cc_line(raw.removesuffix(b"\n"), row, path.name)


def read_cc_tsv(path: str | os.PathLike, start: int = 0, stop: int | None = None) -> list[CCRow]:
    """All rows of the TSV (or those in [start, stop)), malformed ones included with their error."""
    return list(iter_cc_tsv(path, start, stop))


def count_rows(path: str | os.PathLike) -> int:
    """Number of rows `iter_cc_tsv` yields for the whole file (a last line without newline counts)."""
    with open(path, "rb") as handle:
        return sum(1 for _ in handle)


def shard_bounds(num_rows: int, shard: int, shard_rows: int) -> tuple[int, int]:
    """The block [start, stop) of rows that `shard` owns: shard_rows rows from shard * shard_rows.

    Fixed-size blocks keep a shard's rows the same however many shards a config uses, so adding
    a shard to `cc.num_shards` downloads that shard and leaves the others alone. The last block
    of a file may be shorter; a shard past the end of the file is an error.
    """
    if shard_rows < 1:
        raise ValueError(f"shard_rows must be >= 1, got {shard_rows}")
    available = num_shards_of(num_rows, shard_rows)
    if not 0 <= shard < available:
        raise ValueError(
            f"shard {shard} does not exist: {num_rows} rows make {available} shards of {shard_rows} rows"
        )
    return shard * shard_rows, min((shard + 1) * shard_rows, num_rows)


def num_shards_of(num_rows: int, shard_rows: int) -> int:
    """How many shards of `shard_rows` rows a file of `num_rows` rows has (the last may be short)."""
    if num_rows < 0:
        raise ValueError(f"num_rows must be >= 0, got {num_rows}")
    return -(-num_rows // shard_rows)
