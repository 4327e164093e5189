"""Run the detector over images and store each image's selected RoIs in a parquet file.

Parquet schema (docs/architecture.md): key, status ('ok' | 'decode_error' | 'missing_file'; the
bottom-up TSV import, bottom_up.py, adds its own failure kinds), error, image_w, image_h,
num_boxes, boxes (N*4 float32, x1,y1,x2,y2 in original pixels), scores (N float32), class_ids
(N int32), class_scores (N*C float16, C = K+1 with background at index 0), num_classes (C). Boxes
are sorted by score, descending. Failed rows have null image_w/image_h, zero boxes and the error
text. The file's key-value metadata `vlbert_rois` (JSON) says where the RoIs came from and counts
the rows per status (`read_rois_metadata`).
"""

from __future__ import annotations

import io
import json
import math
import os
import posixpath
import tarfile
from collections import Counter, OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
import torch.nn.functional as F
from PIL import Image
from torch.utils.data import DataLoader, Dataset
from torchvision.ops import boxes as box_ops
from tqdm import tqdm

from ..utils import atomic_path, get_logger
from .faster_rcnn import clip_boxes_legacy, uses_legacy_boxes
from .select import SelectedRoIs, select_rois

log = get_logger(__name__)

SELECT_KEYS = ("score_threshold", "min_boxes", "max_boxes", "nms_iou")
IMAGE_EXTENSIONS = ("jpg", "jpeg", "png")
METADATA_KEY = "vlbert_rois"  # parquet key-value metadata: where the RoIs came from, row counts per status

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


def selection_kwargs(rois_cfg: Mapping[str, Any]) -> dict[str, Any]:
    """The select_rois keyword arguments out of the config's `rois:` section."""
    missing = [k for k in SELECT_KEYS if k not in rois_cfg]
    if missing:
        raise KeyError(f"rois config lacks keys {missing}")
    return {"score_threshold": float(rois_cfg["score_threshold"]), "min_boxes": int(rois_cfg["min_boxes"]),
            "max_boxes": int(rois_cfg["max_boxes"]), "nms_iou": float(rois_cfg["nms_iou"])}


def _backbone_features(model, images: Sequence[torch.Tensor], device: torch.device):
    """The detector's transform and backbone on `images`: (ImageList, feature maps, original sizes)."""
    images = [img.to(device) for img in images]
    original_sizes = [(int(img.shape[-2]), int(img.shape[-1])) for img in images]
    image_list, _ = model.transform(images)
    features = model.backbone(image_list.tensors)
    if isinstance(features, torch.Tensor):
        features = OrderedDict([("0", features)])
    return image_list, features, original_sizes


def run_detector(model: torch.nn.Module, images: Sequence[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The detector network on a batch of images ([3, H, W] float in [0, 1]): per image, the box
    regressed for every proposal and foreground class, [P, K, 4] in the pixels of the input image
    (clipped to it), and the proposal's class-score vector [P, K+1] (softmax, background at 0).

    Runs the Faster R-CNN stages by hand so that every box keeps the class-score vector of its
    proposal (torchvision's postprocess_detections drops it). This is the bare detector forward
    that benchmarks/rois.py compares the whole extraction with. Tensors stay on the model's device.
    """
    if len(images) == 0:
        return []
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            image_list, features, original_sizes = _backbone_features(model, images, device)
            proposals, _ = model.rpn(image_list, features)
            heads = model.roi_heads
            box_features = heads.box_head(heads.box_roi_pool(features, proposals, image_list.image_sizes))
            class_logits, box_regression = heads.box_predictor(box_features)
            pred_scores = F.softmax(class_logits, dim=-1)
            counts = [len(p) for p in proposals]
            ratios = [proposals[0].new_tensor([original[1] / resized[1], original[0] / resized[0]] * 2)
                      for resized, original in zip(image_list.image_sizes, original_sizes)]
            legacy = uses_legacy_boxes(model)
            if legacy:
                # py-faster-rcnn decodes in original-image pixels (rois / im_scale), where the +1 of
                # its box widths is measured, and clips there to [0, W - 1].
                original_proposals = [p * r for p, r in zip(proposals, ratios)]
                pred_boxes = heads.box_coder.decode(box_regression, original_proposals)  # [sum P, K+1, 4]
            else:
                pred_boxes = heads.box_coder.decode(box_regression, proposals)

            results = []
            for boxes, scores, resized, original, ratio in zip(
                pred_boxes.split(counts), pred_scores.split(counts), image_list.image_sizes, original_sizes, ratios
            ):
                if legacy:
                    boxes = clip_boxes_legacy(boxes, original)
                else:
                    boxes = box_ops.clip_boxes_to_image(boxes, resized) * ratio
                results.append((boxes[:, 1:], scores))
    finally:
        model.train(was_training)
    return results


def detect_rois(model: torch.nn.Module, images: Sequence[torch.Tensor], select_kwargs: Mapping[str, Any]) -> list[SelectedRoIs]:
    """Detect and select the RoIs of a batch of images ([3, H, W] float in [0, 1]).

    `run_detector`, then the DESIGN §4 rule (`select_rois`) per image. Boxes come back in the
    pixel coordinates of the input images, on the CPU.
    """
    results = []
    legacy = uses_legacy_boxes(model)
    with torch.inference_mode():
        for boxes_per_class, class_scores in run_detector(model, images):
            selected = select_rois(boxes_per_class, class_scores, **select_kwargs, legacy_iou=legacy)
            results.append(SelectedRoIs(*(t.cpu() for t in (selected.boxes, selected.scores,
                                                              selected.class_ids, selected.class_scores))))
    return results


def classify_boxes(model: torch.nn.Module, images: Sequence[torch.Tensor],
                   boxes: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Class-score vectors [N, K+1] (softmax, background at 0) of given boxes, from the detector's box head.

    images: [3, H, W] float in [0, 1]; boxes: [N, 4] x1,y1,x2,y2 in the pixels of each image. The
    boxes replace the RPN proposals: the image goes through the detector's transform and backbone,
    each box through RoIAlign, the box head and the class predictor (its box regression is not
    used). This is how imported RoIs without class scores get their soft labels (bottom_up.py).
    Returns CPU float32 tensors.
    """
    if len(images) != len(boxes):
        raise ValueError(f"classify_boxes: {len(images)} images but {len(boxes)} box sets")
    if len(images) == 0:
        return []
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            image_list, features, original_sizes = _backbone_features(model, images, device)
            resized_boxes = []
            for b, resized, original in zip(boxes, image_list.image_sizes, original_sizes):
                scale = torch.tensor([resized[1] / original[1], resized[0] / original[0]] * 2, dtype=torch.float32)
                resized_boxes.append((b.float().reshape(-1, 4) * scale).to(device))
            heads = model.roi_heads
            box_features = heads.box_head(heads.box_roi_pool(features, resized_boxes, image_list.image_sizes))
            class_logits, _ = heads.box_predictor(box_features)
            scores = F.softmax(class_logits.float(), dim=-1).cpu()
    finally:
        model.train(was_training)
    return list(scores.split([len(b) for b in resized_boxes]))


def decode_image(source: bytes | str | os.PathLike) -> torch.Tensor:
    """Decode JPEG/PNG bytes or a file into a [3, H, W] uint8 RGB tensor (fully decoded)."""
    fp = io.BytesIO(source) if isinstance(source, (bytes, bytearray, memoryview)) else source
    with Image.open(fp) as image:
        rgb = image.convert("RGB")  # convert() forces the full decode, so truncation shows here
    # HWC -> CHW in numpy: a torch op on a tensor this small runs on torch's thread pool, whose
    # synchronisation costs more than the copy itself on a busy machine (benchmarks/rois.py).
    return torch.from_numpy(np.asarray(rgb, dtype=np.uint8).transpose(2, 0, 1).copy())  # copy: C order, writable


def to_unit_float(image: torch.Tensor) -> torch.Tensor:
    """[3, H, W] uint8 -> float32 in [0, 1] (the detector's input), computed in numpy for the same
    reason as in decode_image; the values equal image.float() / 255."""
    return torch.from_numpy(np.divide(image.numpy(), np.float32(255.0), dtype=np.float32))


class _DecodeDataset(Dataset):
    def __init__(self, samples: list[tuple[str, Any]]):
        self.samples = samples

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> tuple[str, torch.Tensor | None, str, str]:
        key, source = self.samples[index]
        try:
            return key, decode_image(source), "ok", ""
        except FileNotFoundError as exc:
            return key, None, "missing_file", f"{type(exc).__name__}: {exc}"
        except Exception as exc:  # noqa: BLE001 - any decoder failure is this row's error, not the job's
            return key, None, "decode_error", f"{type(exc).__name__}: {exc}"


def _collate(batch: list) -> list:
    return batch


class RoIParquetWriter:
    """Writes RoI parquet rows (ROI_SCHEMA) row group by row group, so a shard of any size needs
    memory for one row group only. Use as a context manager: the file appears under its final name
    when the block ends without an exception, and never half-written (utils.atomic_path).

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
        self._writer: pq.ParquetWriter | None = None
        self._atomic = None
        self._reset_buffer()

    def _reset_buffer(self) -> None:
        self._scalars: dict[str, list] = {name: [] for name in ("key", "status", "error", "image_w", "image_h")}
        self._arrays: dict[str, list[np.ndarray]] = {name: [] for name in ("boxes", "scores", "class_ids", "class_scores")}
        self._num_boxes: list[int] = []

    def __enter__(self) -> "RoIParquetWriter":
        self._atomic = atomic_path(self.path)
        tmp = self._atomic.__enter__()
        self._writer = pq.ParquetWriter(tmp, ROI_SCHEMA)
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        # A failure of the last flush or of the close (a full disk) must reach atomic_path as an error,
        # or the half-written file would be renamed into place.
        own_error: BaseException | None = None
        try:
            if exc_type is None:
                self._flush()
                self.metadata["status_counts"] = dict(sorted(self.status_counts.items()))
                self._writer.add_key_value_metadata({METADATA_KEY: json.dumps(self.metadata, sort_keys=True)})
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
        self._start_row(key, "ok", "")
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
        if status == "ok":
            raise ValueError(f"{self.path}: key {key!r}: a failure row needs a failure status")
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
        self._writer.write_table(pa.table(columns, schema=ROI_SCHEMA))
        self._reset_buffer()


def read_rois_metadata(parquet: str | os.PathLike) -> dict[str, Any]:
    """The `vlbert_rois` metadata of a RoI parquet (source, counts); {} for files written without it."""
    raw = pq.ParquetFile(parquet).metadata.metadata or {}  # the footer's key-value metadata
    value = raw.get(METADATA_KEY.encode())
    return json.loads(value) if value else {}


def extract_rois_to_parquet(
    model: torch.nn.Module,
    samples: Iterable[tuple[str, bytes | str | os.PathLike]],
    out_parquet: str | os.PathLike,
    batch_size: int,
    select_kwargs: Mapping[str, Any],
    num_workers: int = 0,
    metadata: Mapping[str, Any] | None = None,
) -> dict[str, int]:
    """Detect RoIs for every (key, image bytes or path) sample and write one parquet row per sample.

    Images are decoded in a DataLoader (worker processes when num_workers > 0). An image that
    cannot be read becomes a row with status 'decode_error' (or 'missing_file') and its error; the
    others go on. `metadata` goes into the file's `vlbert_rois` metadata (with source 'detector').
    Returns counts {'rows', 'ok', 'failed'}.
    """
    samples = list(samples)
    _check_unique_keys(samples, out_parquet)
    num_classes = int(model.roi_heads.box_predictor.cls_score.out_features)
    batch_size = max(1, int(batch_size))
    box_counts = []
    with RoIParquetWriter(out_parquet, num_classes, {"source": "detector", **(metadata or {})}) as writer:
        progress = tqdm(decoded_batches(samples, batch_size, num_workers), total=math.ceil(len(samples) / batch_size),
                        desc="rois", unit="batch")
        for batch in progress:
            decoded = [img for _, img, status, _ in batch if status == "ok"]
            selections = iter(detect_rois(model, [to_unit_float(img) for img in decoded], select_kwargs))
            for key, img, status, error in batch:
                if status != "ok":
                    log.warning("%s: %s (%s)", key, status, error)
                    writer.add_failure(key, status, error)
                    continue
                sel = next(selections)
                box_counts.append(len(sel))
                writer.add(key, image_w=int(img.shape[-1]), image_h=int(img.shape[-2]), boxes=sel.boxes.numpy(),
                           scores=sel.scores.numpy(), class_ids=sel.class_ids.numpy(),
                           class_scores=sel.class_scores.numpy())
            progress.set_postfix(ok=writer.status_counts["ok"], failed=sum(writer.status_counts.values())
                                 - writer.status_counts["ok"])
    num_ok = writer.status_counts["ok"]
    counts = {"rows": len(samples), "ok": num_ok, "failed": len(samples) - num_ok}
    mean_boxes = float(np.mean(box_counts)) if box_counts else 0.0
    log.info("%s: %d rows, %d ok, %d failed, %.1f RoIs per image", out_parquet, counts["rows"], counts["ok"],
             counts["failed"], mean_boxes)
    return counts


def _check_unique_keys(samples: Sequence[tuple[str, Any]], out_parquet: str | os.PathLike) -> None:
    seen: set[str] = set()
    for i, (key, _) in enumerate(samples):
        if key in seen:
            raise ValueError(f"{out_parquet}: duplicate sample key {key!r} (sample #{i})")
        seen.add(key)


def decoded_batches(samples: Sequence[tuple[str, Any]], batch_size: int,
                    num_workers: int = 0) -> Iterator[list[tuple[str, torch.Tensor | None, str, str]]]:
    """Batches of (key, [3, H, W] uint8 image or None, status, error), in sample order, decoded in a
    DataLoader (in worker processes when num_workers > 0)."""
    yield from DataLoader(_DecodeDataset(list(samples)), batch_size=max(1, int(batch_size)), shuffle=False,
                          num_workers=int(num_workers), collate_fn=_collate)


def read_cc_shard(tar_path: str | os.PathLike) -> Iterator[tuple[str, bytes]]:
    """Yield (key, image bytes) for each sample of a webdataset tar, in file order.

    Keys follow webdataset: the member path up to the first dot of its file name. A sample without
    an image member means a broken shard and raises.
    """
    current_key: str | None = None
    current_image: bytes | None = None

    def finish(key: str | None, image: bytes | None) -> Iterator[tuple[str, bytes]]:
        if key is None:
            return
        if image is None:
            raise ValueError(f"{tar_path}: sample {key!r} has no image member ({'/'.join(IMAGE_EXTENSIONS)})")
        yield key, image

    with tarfile.open(tar_path, "r") as tar:
        for member in tar:
            if not member.isfile():
                continue
            dirname, basename = posixpath.split(member.name)
            stem, _, ext = basename.partition(".")
            key = posixpath.join(dirname, stem) if dirname else stem
            if key != current_key:
                yield from finish(current_key, current_image)
                current_key, current_image = key, None
            if ext.lower() in IMAGE_EXTENSIONS:
                handle = tar.extractfile(member)
                if handle is None:
                    raise ValueError(f"{tar_path}: member {member.name!r} cannot be read")
                current_image = handle.read()
        yield from finish(current_key, current_image)


@dataclass
class RoIRecord:
    """One row of a RoI parquet, with arrays in their natural shapes (float32 class scores)."""

    key: str
    status: str
    error: str
    image_w: int | None
    image_h: int | None
    boxes: np.ndarray  # [N, 4] float32
    scores: np.ndarray  # [N] float32
    class_ids: np.ndarray  # [N] int32
    class_scores: np.ndarray  # [N, C] float32
    num_classes: int

    @property
    def ok(self) -> bool:
        return self.status == "ok"


def read_rois(parquet: str | os.PathLike) -> dict[str, RoIRecord]:
    """Read a RoI parquet into {key: RoIRecord}; checks each row's array lengths against num_boxes."""
    table = pq.read_table(parquet)
    missing = [name for name in ROI_SCHEMA.names if name not in table.column_names]
    if missing:
        raise ValueError(f"{parquet}: not a RoI parquet, missing columns {missing}")
    rows = table.to_pydict()
    records: dict[str, RoIRecord] = {}
    for i, key in enumerate(rows["key"]):
        n = int(rows["num_boxes"][i])
        c = int(rows["num_classes"][i])
        boxes = np.asarray(rows["boxes"][i], dtype=np.float32)
        scores = np.asarray(rows["scores"][i], dtype=np.float32)
        class_ids = np.asarray(rows["class_ids"][i], dtype=np.int32)
        class_scores = np.asarray(rows["class_scores"][i], dtype=np.float32)
        if boxes.size != 4 * n or scores.size != n or class_ids.size != n or class_scores.size != n * c:
            raise ValueError(
                f"{parquet}: row {i} (key {key!r}) has num_boxes={n}, num_classes={c} but {boxes.size} box "
                f"values, {scores.size} scores, {class_ids.size} class ids, {class_scores.size} class scores"
            )
        if key in records:
            raise ValueError(f"{parquet}: duplicate key {key!r} at row {i}")
        records[key] = RoIRecord(
            key=key, status=rows["status"][i], error=rows["error"][i], image_w=rows["image_w"][i],
            image_h=rows["image_h"][i], boxes=boxes.reshape(n, 4), scores=scores, class_ids=class_ids,
            class_scores=class_scores.reshape(n, c), num_classes=c,
        )
    return records


def extract_rois_with_detector(model_path: str | os.PathLike, samples: Iterable[tuple[str, bytes | str | os.PathLike]],
                               out_parquet: str | os.PathLike, rois_cfg: Mapping[str, Any],
                               device: str = "cpu") -> dict[str, int]:
    """Load the detector checkpoint and write the RoI parquet of `samples` with the config's `rois:` rule."""
    from .train import load_detector  # train imports this module

    model, _ = load_detector(model_path, map_location=device)
    return extract_rois_to_parquet(
        model.to(device),
        samples,
        out_parquet,
        batch_size=int(rois_cfg["batch_size"]),
        select_kwargs=selection_kwargs(rois_cfg),
        num_workers=int(rois_cfg.get("num_workers", 0)),
        metadata={"detector": str(model_path), "selection": selection_kwargs(rois_cfg)},
    )
