"""Cut a Conceptual Captions TSV into its download shards, once per split.

One cheap job reads the TSV (3.3M rows for real CC) and writes `rows/{split}.parquet`: every line
of the file, parsed by the reader, with the shard that owns it and, for repeated URLs, the row
that owns the URL. Each download job then reads only its own shard's row group instead of the
whole TSV, and the shard count stays a config value, so the DAG is static.

Shard k owns rows [k * shard_rows, (k + 1) * shard_rows) (reader.shard_bounds), whatever
`cc.num_shards` is, so a config that adds a shard downloads only that one. The config's
num_shards picks the first shards; the rows of the others are listed here with their shard and
are not downloaded. A URL that appears on several rows is
downloaded once: the first row (in file order) keeps it, and every later row is recorded by its
download job as `duplicate_url`, naming that first row. Duplicates are found across the whole
split, which no single shard job could do.

Columns: row, shard, caption, url, error ("" for a usable line), duplicate_of (-1 unless the
URL already appeared on an earlier usable row). The file's metadata holds the split, the TSV
path, the number of rows and shard_rows.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
from vlbert_core.progress import Progress

from vlbert_core.data.reader import CCRow, iter_cc_tsv, num_shards_of, shard_bounds
from vlbert_core.parquet import AtomicParquetWriter
from vlbert_core.utils import get_logger

log = get_logger(__name__)

ROWS_SCHEMA = pa.schema(
    [
        ("row", pa.int64()),
        ("shard", pa.int32()),
        ("caption", pa.string()),
        ("url", pa.string()),
        ("error", pa.string()),
        ("duplicate_of", pa.int64()),
    ]
)
_METADATA_KEY = b"vlbert.cc_rows"


@dataclass(frozen=True)
class ShardRows:
    """The rows one download job owns: rows [row_start, row_stop) of the split's TSV."""

    split: str
    shard: int
    shard_rows: int
    row_start: int
    row_stop: int
    tsv: str
    rows: list[CCRow]
    duplicate_of: dict[int, int]  # row -> the earlier row that has the same URL


def _repeated_url_hashes(tsv: str | os.PathLike) -> tuple[int, set[int]]:
    """Count the rows and return the hashes of URLs that occur on more than one usable row.

    Only hashes are kept (8 bytes a row), so this stays small for millions of rows; the exact
    comparison happens in the second pass, on the few URLs whose hash repeats. Python's str hash
    is salted per process, which is fine: both passes run in this process.
    """
    seen: set[int] = set()
    repeated: set[int] = set()
    num_rows = 0
    for row in Progress(iter_cc_tsv(tsv), desc="count rows", unit="row", mininterval=5.0):
        num_rows += 1
        if row.ok:
            digest = hash(row.url)
            if digest in seen:
                repeated.add(digest)
            else:
                seen.add(digest)
    return num_rows, repeated


def partition_cc_tsv(
    tsv: str | os.PathLike,
    split: str,
    shard_rows: int,
    out_rows: str | os.PathLike,
    expected_rows: int | None = None,
) -> dict[str, Any]:
    """Write the rows parquet of `tsv` in shards of `shard_rows` rows; return counts for the log.

    `expected_rows` (the published line count, when the config gives it) catches a truncated or
    wrong TSV before hundreds of download jobs start on it.
    """
    num_rows, repeated = _repeated_url_hashes(tsv)
    if expected_rows is not None and num_rows != expected_rows:
        raise ValueError(f"{tsv}: {num_rows} rows, but cc.expected_rows.{split} is {expected_rows}")
    first_row_of_url: dict[str, int] = {}  # only URLs whose hash repeats
    counts = {"rows": num_rows, "malformed": 0, "duplicates": 0}
    if shard_rows < 1:
        raise ValueError(f"shard_rows must be >= 1, got {shard_rows}")
    num_shards = num_shards_of(num_rows, shard_rows)
    metadata = {"split": split, "tsv": str(tsv), "num_rows": num_rows, "shard_rows": shard_rows}

    def shard_table(shard: int, rows: list[CCRow], duplicate_of: list[int]) -> pa.Table:
        return pa.table(
            {
                "row": pa.array([r.row for r in rows], pa.int64()),
                "shard": pa.array([shard] * len(rows), pa.int32()),
                "caption": pa.array([r.caption for r in rows], pa.string()),
                "url": pa.array([r.url for r in rows], pa.string()),
                "error": pa.array([r.error or "" for r in rows], pa.string()),
                "duplicate_of": pa.array(duplicate_of, pa.int64()),
            },
            schema=ROWS_SCHEMA,
        )

    schema = ROWS_SCHEMA.with_metadata({_METADATA_KEY: json.dumps(metadata, sort_keys=True).encode()})
    rows_iter = iter_cc_tsv(tsv)
    with AtomicParquetWriter(out_rows, schema) as writer:
        for shard in range(num_shards):
            start, stop = shard_bounds(num_rows, shard, shard_rows)
            rows: list[CCRow] = []
            duplicate_of: list[int] = []
            for _ in range(stop - start):
                row = next(rows_iter, None)
                if row is None:
                    raise RuntimeError(f"{tsv}: the file changed while it was read (it had {num_rows} rows before)")
                first = -1
                if not row.ok:
                    counts["malformed"] += 1
                elif hash(row.url) in repeated:
                    first = first_row_of_url.setdefault(row.url, row.row)
                    if first == row.row:
                        first = -1
                    else:
                        counts["duplicates"] += 1
                rows.append(row)
                duplicate_of.append(first)
            # One row group per shard, so a download job reads only its own rows.
            writer.write_table(shard_table(shard, rows, duplicate_of), row_group_size=max(1, len(rows)))
    log.info(
        "%s: %d rows of split %s make %d shards of %d rows; %d malformed, %d repeat an earlier row's URL",
        tsv, num_rows, split, num_shards, shard_rows, counts["malformed"], counts["duplicates"],
    )
    return {**metadata, **counts, "num_shards": num_shards}


def read_shard_rows(path: str | os.PathLike, shard: int) -> ShardRows:
    """The rows of `shard` from a rows parquet written by partition_cc_tsv."""
    path = Path(path)
    parquet = pq.ParquetFile(path)
    raw = (parquet.schema_arrow.metadata or {}).get(_METADATA_KEY)
    if raw is None:
        raise ValueError(f"{path}: not a CC rows parquet (no {_METADATA_KEY.decode()} metadata); rerun partition_cc")
    metadata = json.loads(raw)
    num_rows, shard_rows = metadata["num_rows"], metadata["shard_rows"]
    try:
        row_start, row_stop = shard_bounds(num_rows, shard, shard_rows)
    except ValueError as err:
        raise ValueError(f"{path}: {err}; lower cc.num_shards.{metadata['split']}") from None
    # partition_cc_tsv writes shard k as row group k (reading it needs no pyarrow.dataset import).
    columns = parquet.read_row_group(shard).to_pydict()
    if columns["row"] != list(range(row_start, row_stop)):
        raise ValueError(
            f"{path}: shard {shard} should hold rows [{row_start}, {row_stop}) in order, "
            f"found {len(columns['row'])} rows; rerun partition_cc"
        )
    rows = [
        CCRow(row, caption, url, error or None)
        for row, caption, url, error in zip(columns["row"], columns["caption"], columns["url"], columns["error"])
    ]
    duplicate_of = {row: first for row, first in zip(columns["row"], columns["duplicate_of"]) if first >= 0}
    return ShardRows(
        split=metadata["split"],
        shard=shard,
        shard_rows=shard_rows,
        row_start=row_start,
        row_stop=row_stop,
        tsv=metadata["tsv"],
        rows=rows,
        duplicate_of=duplicate_of,
    )
