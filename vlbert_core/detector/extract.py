"""Run the detector over images and store each image's selected RoIs in a parquet file.

Parquet schema (docs/architecture.md): key, status ('ok' | 'decode_error' | 'missing_file'),
error, image_w, image_h, num_boxes, boxes (N*4 float32, x1,y1,x2,y2 in original pixels),
scores (N float32), class_ids (N int32), class_scores (N*C float16, C = K+1 with background at
index 0), num_classes (C). Boxes are sorted by score, descending. Failed rows have null
image_w/image_h, zero boxes and the error text.
"""

from __future__ import annotations

import io
import math
import os
import posixpath
import tarfile
from collections import OrderedDict
from dataclasses import dataclass
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
from .select import SelectedRoIs, select_rois

log = get_logger(__name__)

SELECT_KEYS = ("score_threshold", "min_boxes", "max_boxes", "nms_iou")
IMAGE_EXTENSIONS = ("jpg", "jpeg", "png")

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


def detect_rois(model: torch.nn.Module, images: Sequence[torch.Tensor], select_kwargs: Mapping[str, Any]) -> list[SelectedRoIs]:
    """Detect and select the RoIs of a batch of images ([3, H, W] float in [0, 1]).

    Runs the Faster R-CNN stages by hand so that every kept box keeps the class-score vector of
    its proposal (torchvision's postprocess_detections drops it). Boxes come back in the pixel
    coordinates of the input images, on the CPU.
    """
    if len(images) == 0:
        return []
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            images = [img.to(device) for img in images]
            original_sizes = [(int(img.shape[-2]), int(img.shape[-1])) for img in images]
            image_list, _ = model.transform(images)
            features = model.backbone(image_list.tensors)
            if isinstance(features, torch.Tensor):
                features = OrderedDict([("0", features)])
            proposals, _ = model.rpn(image_list, features)
            heads = model.roi_heads
            box_features = heads.box_head(heads.box_roi_pool(features, proposals, image_list.image_sizes))
            class_logits, box_regression = heads.box_predictor(box_features)
            pred_boxes = heads.box_coder.decode(box_regression, proposals)  # [sum P, K+1, 4]
            pred_scores = F.softmax(class_logits, dim=-1)

            counts = [len(p) for p in proposals]
            results = []
            for boxes, scores, resized, original in zip(
                pred_boxes.split(counts), pred_scores.split(counts), image_list.image_sizes, original_sizes
            ):
                boxes = box_ops.clip_boxes_to_image(boxes, resized)
                ratio_h = original[0] / resized[0]
                ratio_w = original[1] / resized[1]
                boxes = boxes * boxes.new_tensor([ratio_w, ratio_h, ratio_w, ratio_h])
                selected = select_rois(boxes[:, 1:], scores, **select_kwargs)
                results.append(SelectedRoIs(*(t.cpu() for t in (selected.boxes, selected.scores,
                                                                  selected.class_ids, selected.class_scores))))
    finally:
        model.train(was_training)
    return results


def decode_image(source: bytes | str | os.PathLike) -> torch.Tensor:
    """Decode JPEG/PNG bytes or a file into a [3, H, W] uint8 RGB tensor (fully decoded)."""
    fp = io.BytesIO(source) if isinstance(source, (bytes, bytearray, memoryview)) else source
    with Image.open(fp) as image:
        rgb = image.convert("RGB")  # convert() forces the full decode, so truncation shows here
    return torch.from_numpy(np.array(rgb, dtype=np.uint8)).permute(2, 0, 1).contiguous()


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


def extract_rois_to_parquet(
    model: torch.nn.Module,
    samples: Iterable[tuple[str, bytes | str | os.PathLike]],
    out_parquet: str | os.PathLike,
    batch_size: int,
    select_kwargs: Mapping[str, Any],
    num_workers: int = 0,
) -> dict[str, int]:
    """Detect RoIs for every (key, image bytes or path) sample and write one parquet row per sample.

    Images are decoded in a DataLoader (worker processes when num_workers > 0). An image that
    cannot be read becomes a row with status 'decode_error' (or 'missing_file') and its error; the
    others go on. Returns counts {'rows', 'ok', 'failed'}.
    """
    samples = list(samples)
    seen: set[str] = set()
    for i, (key, _) in enumerate(samples):
        if key in seen:
            raise ValueError(f"{out_parquet}: duplicate sample key {key!r} (sample #{i})")
        seen.add(key)
    num_classes = int(model.roi_heads.box_predictor.cls_score.out_features)
    loader = DataLoader(_DecodeDataset(samples), batch_size=max(1, int(batch_size)), shuffle=False,
                        num_workers=int(num_workers), collate_fn=_collate)
    columns: dict[str, list] = {name: [] for name in ROI_SCHEMA.names}
    num_ok = 0
    box_counts = []
    progress = tqdm(loader, total=math.ceil(len(samples) / max(1, int(batch_size))), desc="rois", unit="batch")
    for batch in progress:
        decoded = [(key, img) for key, img, status, _ in batch if status == "ok"]
        selections = detect_rois(model, [img.float().div_(255.0) for _, img in decoded], select_kwargs)
        by_key = {key: (img, sel) for (key, img), sel in zip(decoded, selections)}
        for key, _, status, error in batch:
            columns["key"].append(key)
            columns["status"].append(status)
            columns["error"].append(error)
            columns["num_classes"].append(num_classes)
            if status != "ok":
                log.warning("%s: %s (%s)", key, status, error)
                columns["image_w"].append(None)
                columns["image_h"].append(None)
                columns["num_boxes"].append(0)
                for name in ("boxes", "scores", "class_ids", "class_scores"):
                    columns[name].append([])
                continue
            img, sel = by_key[key]
            num_ok += 1
            box_counts.append(len(sel))
            columns["image_w"].append(int(img.shape[-1]))
            columns["image_h"].append(int(img.shape[-2]))
            columns["num_boxes"].append(len(sel))
            columns["boxes"].append(sel.boxes.numpy().astype(np.float32).reshape(-1))
            columns["scores"].append(sel.scores.numpy().astype(np.float32))
            columns["class_ids"].append(sel.class_ids.numpy().astype(np.int32))
            columns["class_scores"].append(sel.class_scores.numpy().astype(np.float16).reshape(-1))
        progress.set_postfix(ok=num_ok, failed=len(columns["key"]) - num_ok)

    table = pa.table({name: _column(columns[name], ROI_SCHEMA.field(name).type) for name in ROI_SCHEMA.names},
                     schema=ROI_SCHEMA)
    with atomic_path(out_parquet) as tmp:
        pq.write_table(table, tmp)
    counts = {"rows": len(samples), "ok": num_ok, "failed": len(samples) - num_ok}
    mean_boxes = float(np.mean(box_counts)) if box_counts else 0.0
    log.info("%s: %d rows, %d ok, %d failed, %.1f RoIs per image", out_parquet, counts["rows"], counts["ok"],
             counts["failed"], mean_boxes)
    return counts


def _column(values: list, arrow_type: pa.DataType) -> pa.Array:
    if pa.types.is_list(arrow_type):
        lengths = np.array([len(v) for v in values], dtype=np.int64)
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
        dtype = arrow_type.value_type.to_pandas_dtype()
        flat = np.concatenate([np.asarray(v, dtype=dtype) for v in values]) if values else np.empty(0, dtype)
        return pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), pa.array(flat.astype(dtype), arrow_type.value_type))
    return pa.array(values, type=arrow_type)


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
    )
