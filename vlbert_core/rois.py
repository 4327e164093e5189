"""The RoI parquet: one row per image with its selected RoIs (the detector's, or imported ones).

Columns (ROI_SCHEMA): key, status (one of STATUSES), error, image_w, image_h, num_boxes, boxes
(N*4 float32, x1,y1,x2,y2 in original pixels), scores (N float32), class_ids (N int32),
class_scores (N*C float16, C = K+1 with background at index 0), num_classes (C). Boxes are sorted
by score, descending. Failed rows have null image_w/image_h, zero boxes and the error text. The
file's key-value metadata `vlbert_rois` (JSON) says where the RoIs came from and counts the rows per
status (`read_rois_metadata`).

The detector's extraction (detector/extract.py) and the bottom-up TSV import (detector/bottom_up.py)
write these files with RoIParquetWriter; pre-training, the tasks and the report read them with
`read_rois`.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import pyarrow as pa

from .damaged import read_parquet_footer, read_parquet_schema, read_parquet_table
from .parquet import AtomicParquetWriter

METADATA_KEY = "vlbert_rois"  # parquet key-value metadata: where the RoIs came from, row counts per status

STATUS_OK = "ok"
# the detector's extraction: the image could not be read
STATUS_DECODE_ERROR = "decode_error"
STATUS_MISSING_FILE = "missing_file"
# the bottom-up TSV import: the image's TSV line is missing or unusable
STATUS_MISSING_IN_TSV = "missing_in_tsv"
STATUS_BAD_TSV_ROW = "bad_tsv_row"
STATUS_SIZE_MISMATCH = "size_mismatch"
# fewer boxes than rois.min_boxes: in the TSV's row, or from the detector (an RPN that kept no proposal)
STATUS_TOO_FEW_BOXES = "too_few_boxes"
FAILURE_STATUSES = (STATUS_DECODE_ERROR, STATUS_MISSING_FILE, STATUS_MISSING_IN_TSV, STATUS_BAD_TSV_ROW,
                    STATUS_SIZE_MISMATCH, STATUS_TOO_FEW_BOXES)
STATUSES = (STATUS_OK,) + FAILURE_STATUSES

ROI_SCHEMA = pa.schema([
    ("key", pa.string()),
    ("status", pa.string()),
    ("error", pa.string()),
    ("image_w", pa.int32()),
    ("image_h", pa.int32()),
    ("num_boxes", pa.int32()),
    ("boxes", pa.list_(pa.float32())),
    ("scores", pa.list_(pa.float32())),
    ("class_ids", pa.list_(pa.int32())),
    ("class_scores", pa.list_(pa.float16())),
    ("num_classes", pa.int32()),
])
ARRAY_COLUMNS = ("boxes", "scores", "class_ids", "class_scores")
SCALAR_COLUMNS = tuple(name for name in ROI_SCHEMA.names if name not in ARRAY_COLUMNS)


class RoIParquetWriter:
    """Writes RoI parquet rows (ROI_SCHEMA) row group by row group, so a shard of any size needs
    memory for one row group only. Use as a context manager: the file appears under its final name
    when the block ends without an exception, and never half-written (parquet.AtomicParquetWriter).

    `metadata` (JSON-able) is stored under the parquet key-value metadata key `vlbert_rois`, with
    the per-status row counts added when the file is closed; it records where the RoIs came from.
    """

    ROWS_PER_GROUP = 512

    def __init__(self, path: str | os.PathLike, num_classes: int, metadata: Mapping[str, Any]):
        self.path = Path(path)
        self.num_classes = int(num_classes)
        self.metadata = dict(metadata)
        self.status_counts: Counter[str] = Counter()
        self._keys: set[str] = set()
        self._file: AtomicParquetWriter | None = None
        self._reset_buffer()

    def _reset_buffer(self) -> None:
        self._scalars: dict[str, list] = {name: [] for name in ("key", "status", "error", "image_w", "image_h")}
        self._arrays: dict[str, list[np.ndarray]] = {name: [] for name in ARRAY_COLUMNS}
        self._num_boxes: list[int] = []

    def __enter__(self) -> "RoIParquetWriter":
        self._file = AtomicParquetWriter(self.path, ROI_SCHEMA).__enter__()
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc_type is None:
            try:
                self._flush()
                self.metadata["status_counts"] = dict(sorted(self.status_counts.items()))
                self._file.add_key_value_metadata({METADATA_KEY: json.dumps(self.metadata, sort_keys=True)})
            except BaseException as error:
                self._file.__exit__(type(error), error, error.__traceback__)
                raise
        return self._file.__exit__(exc_type, exc, tb)

    def _start_row(self, key: str, status: str, error: str) -> None:
        if key in self._keys:
            raise ValueError(f"{self.path}: duplicate key {key!r}")
        self._keys.add(key)
        self.status_counts[status] += 1
        self._scalars["key"].append(key)
        self._scalars["status"].append(status)
        self._scalars["error"].append(error)

    def add(self, key: str, *, image_w: int, image_h: int, boxes: np.ndarray, scores: np.ndarray,
            class_ids: np.ndarray, class_scores: np.ndarray) -> None:
        """An image's RoIs: boxes [N, 4], scores [N], class_ids [N], class_scores [N, C]."""
        n = int(len(scores))
        if boxes.shape != (n, 4) or class_ids.shape != (n,) or class_scores.shape != (n, self.num_classes):
            raise ValueError(f"{self.path}: key {key!r}: shapes boxes {boxes.shape}, scores ({n},), class_ids "
                             f"{class_ids.shape}, class_scores {class_scores.shape} do not fit N={n}, C={self.num_classes}")
        self._start_row(key, STATUS_OK, "")
        self._scalars["image_w"].append(int(image_w))
        self._scalars["image_h"].append(int(image_h))
        self._num_boxes.append(n)
        self._arrays["boxes"].append(np.asarray(boxes, dtype=np.float32).reshape(-1))
        self._arrays["scores"].append(np.asarray(scores, dtype=np.float32))
        self._arrays["class_ids"].append(np.asarray(class_ids, dtype=np.int32))
        self._arrays["class_scores"].append(np.asarray(class_scores, dtype=np.float16).reshape(-1))
        self._maybe_flush()

    def add_failure(self, key: str, status: str, error: str) -> None:
        """A row with no RoIs: the image (or its imported row) could not be used, and why."""
        if status not in FAILURE_STATUSES:
            raise ValueError(f"{self.path}: key {key!r}: {status!r} is not a failure status ({', '.join(FAILURE_STATUSES)})")
        self._start_row(key, status, error)
        self._scalars["image_w"].append(None)
        self._scalars["image_h"].append(None)
        self._num_boxes.append(0)
        for name in self._arrays:
            self._arrays[name].append(np.empty(0, dtype=np.float32))
        self._maybe_flush()

    def _maybe_flush(self) -> None:
        if len(self._num_boxes) >= self.ROWS_PER_GROUP:
            self._flush()

    def _flush(self) -> None:
        if not self._num_boxes:
            return
        num_boxes = np.asarray(self._num_boxes, dtype=np.int32)
        per_box = {"boxes": 4, "scores": 1, "class_ids": 1, "class_scores": self.num_classes}
        columns = {
            "key": pa.array(self._scalars["key"], pa.string()),
            "status": pa.array(self._scalars["status"], pa.string()),
            "error": pa.array(self._scalars["error"], pa.string()),
            "image_w": pa.array(self._scalars["image_w"], pa.int32()),
            "image_h": pa.array(self._scalars["image_h"], pa.int32()),
            "num_boxes": pa.array(num_boxes, pa.int32()),
            "num_classes": pa.array(np.full(len(num_boxes), self.num_classes, dtype=np.int32), pa.int32()),
        }
        for name, width in per_box.items():
            value_type = ROI_SCHEMA.field(name).type.value_type
            offsets = np.zeros(len(num_boxes) + 1, dtype=np.int32)
            np.cumsum(num_boxes * width, out=offsets[1:])
            flat = np.concatenate(self._arrays[name]).astype(value_type.to_pandas_dtype(), copy=False)
            columns[name] = pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), pa.array(flat, value_type))
        self._file.write_table(pa.table(columns, schema=ROI_SCHEMA))
        self._reset_buffer()


@dataclass
class RoIRecord:
    """One row of a RoI parquet, with arrays in their natural shapes (float32 class scores).

    `num_boxes` is the row's count in the file; the arrays hold the first `keep_boxes` of them when
    `read_rois` was asked for fewer, and are None when it was asked for no arrays.
    """

    key: str
    status: str
    error: str
    image_w: int | None
    image_h: int | None
    num_boxes: int
    num_classes: int
    boxes: np.ndarray | None = None  # [N, 4] float32
    scores: np.ndarray | None = None  # [N] float32
    class_ids: np.ndarray | None = None  # [N] int32
    class_scores: np.ndarray | None = None  # [N, C] float32

    @property
    def ok(self) -> bool:
        return self.status == STATUS_OK


def read_rois(parquet: str | os.PathLike, *, arrays: bool = True, keep_boxes: int | None = None) -> dict[str, RoIRecord]:
    """Read a RoI parquet into {key: RoIRecord}, in file order.

    arrays=False reads the scalar columns only (key, status, error, sizes, counts), for callers that
    count RoIs. keep_boxes keeps the first (highest-scoring) boxes of each row. Checks, naming the
    file, row and key: the columns are there, statuses are known, keys are unique, num_classes is the
    same on every row, an ok row has a positive image size, and each row's arrays fit num_boxes. A file
    cut short or changed on disk raises damaged.DamagedFile, which names the rule that writes it again.
    """
    parquet = Path(parquet)
    if not parquet.is_file():
        raise FileNotFoundError(f"RoI parquet {parquet} does not exist")
    wanted = list(ROI_SCHEMA.names) if arrays else list(SCALAR_COLUMNS)
    names = read_parquet_schema(parquet).names
    missing = [name for name in wanted if name not in names]
    if missing:
        raise ValueError(f"{parquet}: not a RoI parquet, missing columns {missing}")
    rows = read_parquet_table(parquet, columns=wanted).to_pydict()
    records: dict[str, RoIRecord] = {}
    file_classes: int | None = None
    for i, key in enumerate(rows["key"]):
        where = f"{parquet}: row {i} (key {key!r})"
        status, n, c = rows["status"][i], int(rows["num_boxes"][i]), int(rows["num_classes"][i])
        if status not in STATUSES:
            raise ValueError(f"{where}: unknown status {status!r} (known: {', '.join(STATUSES)})")
        if key in records:
            raise ValueError(f"{parquet}: duplicate key {key!r} at row {i}")
        if file_classes is None:
            file_classes = c
        elif c != file_classes:
            raise ValueError(f"{where}: num_classes={c}, earlier rows {file_classes}")
        image_w, image_h = rows["image_w"][i], rows["image_h"][i]
        if status == STATUS_OK and (image_w is None or image_h is None or image_w <= 0 or image_h <= 0):
            raise ValueError(f"{where}: bad image size {image_w}x{image_h}")
        record = RoIRecord(key=key, status=status, error=rows["error"][i], image_w=image_w, image_h=image_h,
                           num_boxes=n, num_classes=c)
        if arrays:
            boxes = np.asarray(rows["boxes"][i], dtype=np.float32)
            scores = np.asarray(rows["scores"][i], dtype=np.float32)
            class_ids = np.asarray(rows["class_ids"][i], dtype=np.int32)
            class_scores = np.asarray(rows["class_scores"][i], dtype=np.float32)
            if boxes.size != 4 * n or scores.size != n or class_ids.size != n or class_scores.size != n * c:
                raise ValueError(
                    f"{where} has num_boxes={n}, num_classes={c} but {boxes.size} box values, {scores.size} "
                    f"scores, {class_ids.size} class ids, {class_scores.size} class scores"
                )
            record.boxes, record.scores = boxes.reshape(n, 4), scores
            record.class_ids, record.class_scores = class_ids, class_scores.reshape(n, c)
            if keep_boxes is not None:  # copies, so the arrays of the whole row are freed
                for name in ARRAY_COLUMNS:
                    setattr(record, name, getattr(record, name)[:keep_boxes].copy())
        records[key] = record
    return records


def read_rois_metadata(parquet: str | os.PathLike) -> dict[str, Any]:
    """The `vlbert_rois` metadata of a RoI parquet (source, counts); {} for files written without it."""
    raw = read_parquet_footer(parquet).metadata or {}  # the footer's key-value metadata
    value = raw.get(METADATA_KEY.encode())
    return json.loads(value) if value else {}
