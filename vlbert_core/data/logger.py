"""Per-row accounting of a CC shard: a parquet with one row per input TSV row, and a stats JSON.

The accounting is the proof that no row went missing: every row of the shard's block appears
exactly once with its status, and rows_in == ok + failed.
"""

from __future__ import annotations

import collections
import json
import os
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

from vlbert_core.data import status as st
from vlbert_core.parquet import AtomicParquetWriter
from vlbert_core.utils import atomic_path

ACCOUNTING_SCHEMA = pa.schema(
    [
        ("row", pa.int64()),
        ("key", pa.string()),
        ("url", pa.string()),
        ("caption", pa.string()),
        ("status", pa.string()),
        ("error", pa.string()),
    ]
)


@dataclass
class ShardAccounting:
    """Collects one record per TSV row of the block [row_start, row_stop) of a shard."""

    row_start: int
    row_stop: int
    _records: dict[int, tuple[str, str, str, str, str]] = field(default_factory=dict)

    def add(self, row: int, key: str, url: str, caption: str, status: str, error: str = "") -> None:
        if status not in st.ALL_STATUSES:
            raise ValueError(f"row {row}: unknown status {status!r}; known: {st.ALL_STATUSES}")
        if not self.row_start <= row < self.row_stop:
            raise ValueError(f"row {row} is outside this shard's rows [{self.row_start}, {self.row_stop})")
        if row in self._records:
            raise ValueError(f"row {row} was accounted twice ({self._records[row][3]} then {status})")
        if status != st.OK and not error:
            raise ValueError(f"row {row}: failure status {status!r} needs an error message")
        self._records[row] = (key, url, caption, status, error)

    def counts(self) -> dict[str, int]:
        tally = collections.Counter(record[3] for record in self._records.values())
        return {name: tally.get(name, 0) for name in st.ALL_STATUSES}

    def check_complete(self) -> None:
        """Raise unless every row of the block is accounted for exactly once."""
        expected = self.row_stop - self.row_start
        if len(self._records) != expected:
            missing = sorted(set(range(self.row_start, self.row_stop)) - self._records.keys())
            raise AssertionError(
                f"accounting has {len(self._records)} of {expected} rows; missing rows {missing[:10]}"
                + (" ..." if len(missing) > 10 else "")
            )

    def stats(self, **context: Any) -> dict[str, Any]:
        """Counts per status plus rows_in/ok/failed; `context` (split, shard, tsv...) is added as is."""
        self.check_complete()
        counts = self.counts()
        rows_in = self.row_stop - self.row_start
        ok = counts[st.OK]
        failed = sum(counts[name] for name in st.FAILURE_STATUSES)
        assert rows_in == ok + failed, f"rows_in {rows_in} != ok {ok} + failed {failed}"
        return {
            **context,
            "row_start": self.row_start,
            "row_stop": self.row_stop,
            "rows_in": rows_in,
            "ok": ok,
            "failed": failed,
            "counts": counts,
        }

    def to_table(self) -> pa.Table:
        rows = sorted(self._records)
        columns = list(zip(*(self._records[row] for row in rows))) or [(), (), (), (), ()]
        return pa.table(
            [pa.array(rows, pa.int64())] + [pa.array(list(col), pa.string()) for col in columns],
            schema=ACCOUNTING_SCHEMA,
        )

    def write_parquet(self, path: str | os.PathLike) -> None:
        self.check_complete()
        with AtomicParquetWriter(path, ACCOUNTING_SCHEMA) as writer:
            writer.write_table(self.to_table())


def write_stats(stats: dict[str, Any], path: str | os.PathLike) -> None:
    """Write the stats JSON atomically, keys sorted so reruns give identical files."""
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(stats, indent=2, sort_keys=True) + "\n", encoding="utf-8")
