"""Bring your own RoIs: import a bottom-up-attention TSV into our RoI parquet (vlbert_core.rois).

The TSV is what bottom-up-attention's `tools/generate_tsv.py` writes (Anderson et al. 2018): tab
separated, no header, one image per line, fields

    image_id, image_w, image_h, num_boxes, boxes, features[, cls_prob]

`boxes` is base64 of float32 [num_boxes, 4] (x1, y1, x2, y2 in the pixels of an image_w x image_h
image), `features` base64 of float32 [num_boxes, D]. The optional seventh field `cls_prob` is base64
of float32 [num_boxes, C], each box's class-score vector with background in column 0.

How a TSV row becomes a parquet row:
- **Which row.** `image_id` is matched to our image keys: for CC shards it is the sample key itself
  (`train-000000042`, `vlbert_core.data.writer.cc_key`); for VQA and RefCOCO+ it is the COCO image
  id, the number in the image file name (`COCO_train2014_000000000042` <- 42). Ids are compared as
  text after stripping; all-digit ids as numbers (`000042` == `42`). One parquet row is written per
  image of the shard / task split, in sample order; TSV rows of other images are skipped (counted
  in the metadata).
- **Boxes** are the TSV's own selection, not re-thresholded and not re-NMSed. They are rescaled
  from the TSV's image_w x image_h frame to the pixels of our image (the CC shard JPEG, the task
  image file), as `extract.py` stores them; the two frames must have the same aspect ratio (2%).
- **Class scores** (the soft targets of masked RoI classification): from `cls_prob` when the TSV
  has that field; otherwise our detector scores the given boxes with its box head
  (`extract.classify_boxes`: backbone, RoIAlign of each given box, box head, softmax). Either way
  they must be in the detector's class space (C = detector classes + 1), the space of the
  visual network that pre-training initialises from that detector; a `cls_prob` of another width
  stops the import with an error. A row's `scores`/`class_ids` are the best foreground score and
  its class; boxes are re-sorted by that score (stable), as our schema requires.
- **10..100 boxes.** More than rois.max_boxes boxes: the best max_boxes by score are kept (as our
  selection rule caps), and the row's count goes into the metadata (`rows_capped`). Fewer than
  rois.min_boxes: we cannot top up boxes that are not in the file, so the row becomes a failure
  `too_few_boxes`.
- **Bad rows are never dropped silently.** The image's row gets a failure status with the TSV path,
  line number, image_id and reason in `error`:
  `bad_tsv_row` (wrong field count, non-numeric sizes, base64 that does not decode to
  num_boxes x 4 / x D / x C float32, non-finite or negative values, a box outside the image,
  image_id repeated on several lines), `missing_in_tsv` (no line for this image),
  `size_mismatch` (TSV frame and our image differ in aspect ratio), `too_few_boxes`, and, as in
  extraction, `decode_error` / `missing_file` for our own image. Bad lines whose image_id cannot
  be read at all belong to no image; they are logged and listed in the metadata
  (`unattributed_bad_lines`).

The features are checked for size only and not stored: VL-BERT computes appearance features from
the pixels with its own Fast R-CNN (DESIGN §4), initialised from our detector.

The files are large (a few GB per 100k images), so they are streamed: a first pass indexes the byte
offset of each wanted image's line (reading only up to its first tab), a second reads and decodes
those lines one at a time in sample order.
"""

from __future__ import annotations

import base64
import binascii
import csv
import dataclasses
import math
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

import numpy as np
import torch
from vlbert_core.progress import Progress

from ..images import DEFAULT_MAX_PIXELS
from ..rois import (
    STATUS_BAD_TSV_ROW,
    STATUS_MISSING_IN_TSV,
    STATUS_OK,
    STATUS_SIZE_MISMATCH,
    STATUS_TOO_FEW_BOXES,
    RoIParquetWriter,
)
from ..utils import get_logger
from .extract import RoIBounds, RoIJobSettings, _check_unique_keys, classify_boxes, decoded_batches
from .images import to_unit_float
from .train import load_detector

log = get_logger(__name__)

TSV_FIELDS = ("image_id", "image_w", "image_h", "num_boxes", "boxes", "features")
TSV_FIELDS_WITH_CLS_PROB = TSV_FIELDS + ("cls_prob",)
ASPECT_TOLERANCE = 0.02   # relative; our resizer rounds sides to whole pixels
BOX_TOLERANCE_PX = 1.0    # bottom-up boxes are pixel indices (x2 <= image_w - 1); allow rounding
MAX_LISTED_BAD_LINES = 50
_COCO_FILE_STEM = re.compile(r"^COCO_[A-Za-z0-9]+_(\d+)$")

# Base64 of a float32 [100, 2048] feature block is ~1.1 MB, above csv's default field limit (128 KiB).
_FIELD_LIMIT = sys.maxsize
while True:
    try:
        csv.field_size_limit(_FIELD_LIMIT)
        break
    except OverflowError:  # the limit is a C long, narrower than sys.maxsize on some platforms
        _FIELD_LIMIT //= 2


class BadTsvRow(ValueError):
    """A TSV line that cannot become RoIs; the message says why."""


@dataclass
class BottomUpRow:
    line: int                  # 1-based line number in the TSV
    image_id: str              # normalised (normalise_image_id)
    image_w: int
    image_h: int
    boxes: np.ndarray          # [N, 4] float32 in the TSV's image_w x image_h frame
    feature_dim: int           # D of the features field (checked, not stored)
    cls_prob: np.ndarray | None  # [N, C] float32, background at 0, or None without that field


def normalise_image_id(raw: str) -> str:
    """An image_id as compared with our keys: stripped of blanks and quotes; all-digit ids as numbers."""
    text = raw.strip().strip('"').strip()
    return str(int(text)) if text.isdigit() else text


def cc_image_id(key: str) -> str:
    """TSV image_id of a CC sample: the sample key itself, e.g. train-000000042."""
    return normalise_image_id(key)


def coco_image_id(key: str) -> str:
    """TSV image_id of a VQA / RefCOCO+ image: the COCO id in its file stem, COCO_val2014_000000000042 -> 42."""
    match = _COCO_FILE_STEM.match(key)
    if match is None:
        raise ValueError(f"image key {key!r} is not a COCO file stem (COCO_<subset>_<image id>); the bottom-up TSV "
                         "import matches task images to TSV rows by their COCO image id")
    return str(int(match.group(1)))


def _decode_float32(text: str, what: str, rows: int, width: int | None) -> np.ndarray:
    """base64 -> float32 [rows, width]; width None means 'whatever it is', returned as [rows, D]."""
    try:
        raw = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise BadTsvRow(f"{what} is not valid base64 ({exc})") from exc
    if len(raw) % 4:
        raise BadTsvRow(f"{what} decodes to {len(raw)} bytes, not a whole number of float32")
    values = np.frombuffer(raw, dtype="<f4")
    if width is None:
        if rows == 0 or values.size % rows or values.size == 0:
            raise BadTsvRow(f"{what} decodes to {values.size} float32, not num_boxes={rows} rows of equal width")
        width = values.size // rows
    if values.size != rows * width:
        raise BadTsvRow(f"{what} decodes to {values.size} float32, expected num_boxes x {width} = {rows * width}")
    if not np.all(np.isfinite(values)):
        raise BadTsvRow(f"{what} has non-finite values")
    return values.reshape(rows, width).astype(np.float32)


def _base64_size(text: str) -> int:
    """Bytes that a base64 string decodes to, computed from its length (the feature blocks are large)."""
    text = text.strip()
    if len(text) % 4:
        raise BadTsvRow(f"features is not valid base64 (length {len(text)} is not a multiple of 4)")
    return len(text) // 4 * 3 - (len(text) - len(text.rstrip("=")))


def parse_bottom_up_row(fields: Sequence[str], line: int) -> BottomUpRow:
    """One TSV line's fields -> BottomUpRow, or BadTsvRow saying what is wrong."""
    if len(fields) not in (len(TSV_FIELDS), len(TSV_FIELDS_WITH_CLS_PROB)):
        raise BadTsvRow(f"{len(fields)} fields, expected {len(TSV_FIELDS)} ({', '.join(TSV_FIELDS)}) "
                        f"or {len(TSV_FIELDS_WITH_CLS_PROB)} (+ cls_prob)")
    image_id = normalise_image_id(fields[0])
    try:
        image_w, image_h, num_boxes = (int(float(fields[i])) for i in (1, 2, 3))
    except ValueError as exc:
        raise BadTsvRow(f"image_w/image_h/num_boxes are not numbers ({exc})") from exc
    if image_w <= 0 or image_h <= 0:
        raise BadTsvRow(f"image size {image_w}x{image_h} is not positive")
    if num_boxes < 0:
        raise BadTsvRow(f"num_boxes={num_boxes} is negative")
    boxes = _decode_float32(fields[4], "boxes", num_boxes, 4)
    feature_bytes = _base64_size(fields[5])
    if num_boxes and (feature_bytes == 0 or feature_bytes % (4 * num_boxes)):
        raise BadTsvRow(f"features decode to {feature_bytes} bytes, not num_boxes={num_boxes} rows of float32")
    feature_dim = feature_bytes // (4 * num_boxes) if num_boxes else 0
    cls_prob = None
    if len(fields) == len(TSV_FIELDS_WITH_CLS_PROB):
        cls_prob = _decode_float32(fields[6], "cls_prob", num_boxes, None) if num_boxes else np.zeros((0, 0), np.float32)
        if np.any(cls_prob < 0):
            raise BadTsvRow("cls_prob has negative values")
    tol = BOX_TOLERANCE_PX
    bad = ((boxes[:, 0] < -tol) | (boxes[:, 1] < -tol) | (boxes[:, 2] > image_w + tol) | (boxes[:, 3] > image_h + tol)
           | (boxes[:, 2] < boxes[:, 0]) | (boxes[:, 3] < boxes[:, 1]))
    if np.any(bad):
        i = int(np.flatnonzero(bad)[0])
        raise BadTsvRow(f"box {i} {boxes[i].round(1).tolist()} is outside the {image_w}x{image_h} image or inverted "
                        f"({int(bad.sum())} such boxes)")
    return BottomUpRow(line, image_id, image_w, image_h, boxes, feature_dim, cls_prob)


@dataclass
class TsvIndex:
    """Where each wanted image's line is in a TSV (first pass of the import)."""

    path: Path
    num_fields: int                                   # field count of the first line: 6, or 7 with cls_prob
    lines: dict[str, tuple[int, int]] = field(default_factory=dict)   # image_id -> (line number, byte offset)
    repeated: dict[str, list[int]] = field(default_factory=dict)      # image_id -> all its line numbers
    num_lines: int = 0
    other_images: int = 0                             # lines of images we were not asked for
    unattributed: list[tuple[int, str]] = field(default_factory=list)  # (line, reason) without a usable image_id

    @property
    def has_cls_prob(self) -> bool:
        return self.num_fields == len(TSV_FIELDS_WITH_CLS_PROB)


def index_bottom_up_tsv(path: str | os.PathLike, wanted: set[str]) -> TsvIndex:
    """Stream the TSV once, reading each line only up to its first tab: the byte offset of every
    wanted image_id's line, repeated ids, and lines without an image_id.

    The first line's field count says whether the file carries cls_prob (7 fields) or not (6);
    a first line with another count means this is not a bottom-up TSV, and raises.
    """
    path = Path(path)
    index: TsvIndex | None = None
    with open(path, "rb") as f, Progress(total=path.stat().st_size, desc=f"index {path.name}", unit="B",
                                     unit_scale=True, mininterval=5.0) as progress:
        offset = 0
        for number, raw in enumerate(f, start=1):
            start, offset = offset, offset + len(raw)
            progress.update(len(raw))
            if not raw.strip():
                continue  # a blank line carries no image
            if index is None:
                num_fields = raw.count(b"\t") + 1
                if num_fields not in (len(TSV_FIELDS), len(TSV_FIELDS_WITH_CLS_PROB)):
                    raise ValueError(f"{path}: line {number} has {num_fields} tab-separated fields; a bottom-up TSV "
                                     f"has {len(TSV_FIELDS)} ({', '.join(TSV_FIELDS)}) or "
                                     f"{len(TSV_FIELDS_WITH_CLS_PROB)} (+ cls_prob), without a header")
                index = TsvIndex(path, num_fields)
            index.num_lines += 1
            tab = raw.find(b"\t")
            image_id = normalise_image_id(raw[:tab].decode("utf-8", errors="replace")) if tab > 0 else ""
            if not image_id:
                index.unattributed.append((number, "no image_id before the first tab"))
            elif image_id not in wanted:
                index.other_images += 1
            elif image_id in index.repeated:
                index.repeated[image_id].append(number)
            elif image_id in index.lines:
                first_line, _ = index.lines.pop(image_id)
                index.repeated[image_id] = [first_line, number]
            else:
                index.lines[image_id] = (number, start)
    if index is None:
        raise ValueError(f"{path}: no rows (an empty bottom-up TSV)")
    for number, reason in index.unattributed[:MAX_LISTED_BAD_LINES]:
        log.warning("%s line %d: %s; the line belongs to no image and is skipped", path, number, reason)
    return index


def read_bottom_up_row(handle, index: TsvIndex, image_id: str) -> BottomUpRow:
    """The parsed line of one indexed image_id; BadTsvRow (with the line number) when it is bad."""
    if image_id in index.repeated:
        raise BadTsvRow(f"lines {index.repeated[image_id]}: image_id {image_id} is on several lines; which one holds "
                        "its RoIs is ambiguous")
    number, offset = index.lines[image_id]
    handle.seek(offset)
    text = handle.readline().decode("utf-8", errors="replace").rstrip("\r\n")
    try:
        fields = next(csv.reader([text], delimiter="\t"))
        if len(fields) != index.num_fields:
            raise BadTsvRow(f"{len(fields)} fields where the file's first line has {index.num_fields}")
        return parse_bottom_up_row(fields, number)
    except BadTsvRow as exc:
        raise BadTsvRow(f"line {number}: image_id {image_id}: {exc}") from exc
    except csv.Error as exc:
        raise BadTsvRow(f"line {number}: image_id {image_id}: unreadable ({exc})") from exc


def _scores_and_classes(class_scores: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Best foreground score and its class (1..K) of each row of [N, K+1] class scores."""
    foreground = class_scores[:, 1:]
    class_ids = foreground.argmax(axis=1).astype(np.int32) + 1
    scores = foreground.max(axis=1).astype(np.float32) if len(foreground) else np.zeros(0, np.float32)
    return scores, class_ids


@dataclass
class _PendingRow:
    key: str
    image: torch.Tensor        # [3, H, W] uint8, our image
    boxes: np.ndarray          # [N, 4] float32 in our image's pixels
    cls_prob: np.ndarray | None


def import_bottom_up_rois(
    tsv_path: str | os.PathLike,
    samples: Iterable[tuple[str, bytes | str | os.PathLike]],
    out_parquet: str | os.PathLike,
    rois_cfg: Mapping[str, Any],
    detector: torch.nn.Module,
    *,
    image_id_of: Callable[[str], str],
    metadata: Mapping[str, Any] | None = None,
    max_pixels: int = DEFAULT_MAX_PIXELS,
) -> dict[str, int]:
    """Write the RoI parquet of `samples` ((key, image bytes or path), in order) from a bottom-up TSV.

    `image_id_of` maps a sample key to its TSV image_id (`cc_image_id`, `coco_image_id`). The
    detector supplies the class space and, when the TSV has no cls_prob, the class scores. Uses
    rois_cfg min_boxes, max_boxes, batch_size and num_workers (image decoding). An image over
    `max_pixels` (the config's max_image_pixels) is a decode_error row. The module docstring has the
    rules. Returns counts {'rows', 'ok', 'failed'}.
    """
    tsv_path = Path(tsv_path)
    samples = list(samples)
    _check_unique_keys(samples, out_parquet)
    image_ids: dict[str, str] = {}
    key_of_id: dict[str, str] = {}
    for key, _ in samples:
        image_id = image_id_of(key)
        if image_id in key_of_id:
            raise ValueError(f"{out_parquet}: images {key_of_id[image_id]!r} and {key!r} both map to TSV image_id "
                             f"{image_id}")
        image_ids[key] = key_of_id[image_id] = image_id
    bounds, job = RoIBounds.from_config(rois_cfg), RoIJobSettings.from_config(rois_cfg)
    min_boxes, max_boxes = bounds.min_boxes, bounds.max_boxes
    batch_size = max(1, job.batch_size)
    num_classes = int(detector.roi_heads.box_predictor.cls_score.out_features)

    index = index_bottom_up_tsv(tsv_path, set(key_of_id))
    class_score_source = "tsv cls_prob" if index.has_cls_prob else "detector box head"
    log.info("%s: %d lines, %d of them for the %d images asked for (%d other images); class scores from %s",
             tsv_path, index.num_lines, len(index.lines) + sum(map(len, index.repeated.values())), len(samples),
             index.other_images, class_score_source)
    rows_capped = 0
    box_counts: list[int] = []
    info = {"source": "bottom_up_tsv", "tsv": str(tsv_path), "class_scores": class_score_source,
            **(metadata or {})}
    with RoIParquetWriter(out_parquet, num_classes, info) as writer, open(tsv_path, "rb") as handle:
        progress = Progress(decoded_batches(samples, batch_size, job.num_workers,
                                            max_pixels=max_pixels),
                            total=math.ceil(len(samples) / batch_size), desc="import rois", unit="batch")
        for batch in progress:
            # rows in sample order: a failure (status, error) or a _PendingRow awaiting class scores
            rows: list[tuple[str, str, str] | _PendingRow] = []
            for key, image, status, error in batch:
                if status != STATUS_OK:
                    rows.append((key, status, error))
                    continue
                try:
                    rows.append(_usable_row(key, image, image_ids[key], handle, index, min_boxes))
                except _RowFailure as failure:
                    rows.append((key, failure.status, f"{tsv_path}: {failure}"))
            pending = [r for r in rows if isinstance(r, _PendingRow)]
            if index.has_cls_prob:
                scored = [r.cls_prob for r in pending]
                for r in pending:
                    if r.cls_prob.shape[1] != num_classes:
                        raise ValueError(
                            f"{tsv_path}: cls_prob of image {r.key!r} has {r.cls_prob.shape[1]} classes, the detector "
                            f"{num_classes} (incl. background); the class scores must be in the detector's class space "
                            "(remove the cls_prob field to have the detector score the boxes, or set detector.weights "
                            "to the detector that produced them)")
            else:
                scored = [s.numpy() for s in classify_boxes(
                    detector, [to_unit_float(r.image) for r in pending], [torch.from_numpy(r.boxes) for r in pending])]
            class_scores_of = {r.key: s for r, s in zip(pending, scored)}
            for row in rows:
                if not isinstance(row, _PendingRow):
                    key, status, error = row
                    log.warning("%s: %s (%s)", key, status, error)
                    writer.add_failure(key, status, error)
                    continue
                class_scores = class_scores_of[row.key]
                scores, class_ids = _scores_and_classes(class_scores)
                order = np.argsort(-scores, kind="stable")
                if len(order) > max_boxes:
                    rows_capped += 1
                    order = order[:max_boxes]
                box_counts.append(len(order))
                writer.add(row.key, image_w=int(row.image.shape[-1]), image_h=int(row.image.shape[-2]),
                           boxes=row.boxes[order], scores=scores[order], class_ids=class_ids[order],
                           class_scores=class_scores[order])
            progress.set_postfix(ok=writer.status_counts[STATUS_OK],
                                 failed=sum(writer.status_counts.values()) - writer.status_counts[STATUS_OK])
        writer.metadata.update({
            "rows_capped": rows_capped,
            "tsv_lines": index.num_lines,
            "tsv_lines_other_images": index.other_images,
            "unattributed_bad_lines": [f"line {n}: {reason}" for n, reason in index.unattributed[:MAX_LISTED_BAD_LINES]],
            "num_unattributed_bad_lines": len(index.unattributed),
        })
    num_ok = writer.status_counts[STATUS_OK]
    counts = {"rows": len(samples), "ok": num_ok, "failed": len(samples) - num_ok}
    log.info("%s: %d rows, %d ok, %d failed %s, %d capped to %d boxes, %.1f RoIs per image", out_parquet,
             counts["rows"], num_ok, counts["failed"], dict(writer.status_counts), rows_capped, max_boxes,
             float(np.mean(box_counts)) if box_counts else 0.0)
    return counts


class _RowFailure(Exception):
    def __init__(self, status: str, message: str):
        super().__init__(message)
        self.status = status


def _usable_row(key: str, image: torch.Tensor, image_id: str, handle, index: TsvIndex, min_boxes: int) -> _PendingRow:
    """The TSV row of one decoded image, checked and with boxes in the image's pixels, or _RowFailure."""
    if image_id not in index.lines and image_id not in index.repeated:
        raise _RowFailure(STATUS_MISSING_IN_TSV, f"no line with image_id {image_id}")
    try:
        row = read_bottom_up_row(handle, index, image_id)
    except BadTsvRow as exc:
        raise _RowFailure(STATUS_BAD_TSV_ROW, str(exc)) from exc
    height, width = int(image.shape[-2]), int(image.shape[-1])
    scale_x, scale_y = width / row.image_w, height / row.image_h
    if abs(scale_x / scale_y - 1.0) > ASPECT_TOLERANCE:
        raise _RowFailure(STATUS_SIZE_MISMATCH, f"line {row.line}: image_id {image_id}: {row.image_w}x{row.image_h} in the "
                                           f"TSV but our image {key!r} is {width}x{height} (another aspect ratio)")
    if len(row.boxes) < min_boxes:
        raise _RowFailure(STATUS_TOO_FEW_BOXES, f"line {row.line}: image_id {image_id}: {len(row.boxes)} boxes, "
                                           f"rois.min_boxes is {min_boxes}")
    boxes = row.boxes * np.array([scale_x, scale_y, scale_x, scale_y], dtype=np.float32)
    boxes = np.clip(boxes, 0.0, np.array([width, height, width, height], dtype=np.float32)).astype(np.float32)
    return _PendingRow(key, image, boxes, row.cls_prob)


def import_rois_with_detector(tsv_path: str | os.PathLike, model_path: str | os.PathLike,
                              samples: Iterable[tuple[str, bytes | str | os.PathLike]], out_parquet: str | os.PathLike,
                              rois_cfg: Mapping[str, Any], *, image_id_of: Callable[[str], str],
                              device: str = "cpu", max_image_pixels: int = DEFAULT_MAX_PIXELS) -> dict[str, int]:
    """Load the detector checkpoint and import the RoIs of `samples` from a bottom-up TSV."""

    model, _ = load_detector(model_path, map_location=device)
    return import_bottom_up_rois(tsv_path, samples, out_parquet, rois_cfg, model.to(device), image_id_of=image_id_of,
                                 metadata={"detector": str(model_path),
                                           "bounds": dataclasses.asdict(RoIBounds.from_config(rois_cfg))},
                                 max_pixels=max_image_pixels)
