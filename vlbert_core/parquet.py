"""The one way this project writes a parquet file: buffered, row group by row group, atomically, and with a
checksum in every page (read back by vlbert_core/damaged.py)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Mapping

import pyarrow as pa
import pyarrow.parquet as pq

from .utils import atomic_path


class AtomicParquetWriter:
    """Writes a parquet with `schema` into a temporary file, renamed into place (utils.atomic_path)
    only when the `with` block ends without an exception and the last flush and the close succeed.

    Rows come either as tuples in schema order (`add_row`, buffered and written `rows_per_group` at a
    time, so a file of any size needs memory for one row group) or as ready tables (`write_table`,
    one row group each). `add_key_value_metadata` adds entries to the footer, written at close.
    """

    def __init__(self, path: str | os.PathLike, schema: pa.Schema, rows_per_group: int = 100_000):
        self.path = Path(path)
        self.schema = schema
        self.rows_per_group = int(rows_per_group)
        self._rows: list[tuple] = []
        self._key_value_metadata: dict[str, str] = {}
        self._writer: pq.ParquetWriter | None = None
        self._atomic = None

    def __enter__(self) -> "AtomicParquetWriter":
        self._atomic = atomic_path(self.path)
        tmp = self._atomic.__enter__()
        # A CRC32 per page lets a reader tell a page whose bytes changed on disk (damaged.read_parquet_table),
        # which parquet would otherwise decode into other values without a word.
        self._writer = pq.ParquetWriter(tmp, self.schema, write_page_checksum=True)
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        # A failure of the last flush or of the close (a full disk) must reach atomic_path as an error,
        # or the half-written file would be renamed into place.
        own_error: BaseException | None = None
        try:
            if exc_type is None:
                self.flush()
                if self._key_value_metadata:
                    self._writer.add_key_value_metadata(self._key_value_metadata)
        except BaseException as error:
            own_error = error
        try:
            self._writer.close()
        except BaseException as error:
            own_error = own_error or (error if exc is None else None)
        failure = exc if exc is not None else own_error
        self._atomic.__exit__(type(failure) if failure else None, failure, failure.__traceback__ if failure else None)
        if own_error is not None and exc is None:
            raise own_error
        return False

    def add_row(self, row: tuple) -> None:
        self._rows.append(row)
        if len(self._rows) >= self.rows_per_group:
            self.flush()

    def flush(self) -> None:
        """Write the buffered rows as one row group (nothing when there are none)."""
        if not self._rows:
            return
        columns = list(zip(*self._rows))
        self._rows = []
        self._writer.write_table(pa.table([pa.array(list(column), type=field.type)
                                           for column, field in zip(columns, self.schema)], schema=self.schema))

    def write_table(self, table: pa.Table, row_group_size: int | None = None) -> None:
        """Write `table` (of this schema) after the buffered rows: one row group, or groups of row_group_size
        rows (pyarrow's default when None)."""
        self.flush()
        self._writer.write_table(table, row_group_size=row_group_size)

    def add_key_value_metadata(self, metadata: Mapping[str, str]) -> None:
        self._key_value_metadata.update(metadata)
