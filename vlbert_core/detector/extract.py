"""Run the detector over images and store each image's selected RoIs in a parquet file.

The file format (schema, statuses, writer, reader, metadata) is vlbert_core/rois.py.
"""

from __future__ import annotations

import math
import os
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Mapping, Sequence

import numpy as np
import torch
import torch.nn.functional as F
import webdataset as wds
from torch.utils.data import DataLoader, Dataset
from torchvision.ops import boxes as box_ops
from vlbert_core.progress import Progress
from webdataset.tariterators import base_plus_ext

from ..damaged import read_shard_samples
from ..images import DEFAULT_MAX_PIXELS, checked_max_pixels
from ..rois import STATUS_DECODE_ERROR, STATUS_MISSING_FILE, STATUS_OK, STATUS_TOO_FEW_BOXES, RoIParquetWriter
from ..typed_settings import read_fields
from ..utils import get_logger
from .faster_rcnn import clip_boxes_legacy, uses_legacy_boxes
from .images import decode_image, to_unit_float
from .select import SelectedRoIs, select_rois, select_rois_bottom_up
from .train import load_detector

log = get_logger(__name__)

# rois.rule: which function picks an image's RoIs from the detector's outputs
SELECTION_RULES = ("per_class", "bottom_up")


@dataclass(frozen=True)
class RoISelection:
    """The `rois:` section's selection rule, typed once: `per_class` (select_rois, DESIGN §4) or `bottom_up`
    (select_rois_bottom_up, the released bottom-up-attention features' rule). `kwargs()` is what detect_rois
    takes and what a RoI parquet's metadata records."""

    score_threshold: float
    min_boxes: int
    max_boxes: int
    nms_iou: float
    rule: str = "per_class"

    def __post_init__(self):
        if self.rule not in SELECTION_RULES:
            raise ValueError(f"config rois.rule must be one of {', '.join(SELECTION_RULES)}, not {self.rule!r}")

    @classmethod
    def from_config(cls, rois_cfg: Mapping[str, Any], where: str = "rois") -> "RoISelection":
        return cls(**read_fields(cls, rois_cfg, where))

    def kwargs(self) -> dict[str, Any]:
        return {"score_threshold": self.score_threshold, "min_boxes": self.min_boxes, "max_boxes": self.max_boxes,
                "nms_iou": self.nms_iou, "rule": self.rule}


@dataclass(frozen=True)
class RoIBounds:
    """The `rois:` section's box-count bounds (at least min_boxes, at most max_boxes per image), typed once."""

    min_boxes: int
    max_boxes: int

    @classmethod
    def from_config(cls, rois_cfg: Mapping[str, Any], where: str = "rois") -> "RoIBounds":
        return cls(**read_fields(cls, rois_cfg, where))


@dataclass(frozen=True)
class RoIJobSettings:
    """How a RoI job runs (the `rois:` section's batch size and loader workers), typed once."""

    batch_size: int
    num_workers: int = 0

    @classmethod
    def from_config(cls, rois_cfg: Mapping[str, Any], where: str = "rois") -> "RoIJobSettings":
        return cls(**read_fields(cls, rois_cfg, where))
IMAGE_EXTENSIONS = ("jpg", "jpeg", "png")

def selection_kwargs(rois_cfg: Mapping[str, Any]) -> dict[str, Any]:
    """The select_rois keyword arguments out of the config's `rois:` section."""
    return RoISelection.from_config(rois_cfg).kwargs()


def _backbone_features(model, images: Sequence[torch.Tensor], device: torch.device):
    """The detector's transform and backbone on `images`: (ImageList, feature maps, original sizes)."""
    images = [img.to(device) for img in images]
    original_sizes = [(int(img.shape[-2]), int(img.shape[-1])) for img in images]
    image_list, _ = model.transform(images)
    features = model.backbone(image_list.tensors)
    if isinstance(features, torch.Tensor):
        features = OrderedDict([("0", features)])
    return image_list, features, original_sizes


def run_detector(model: torch.nn.Module, images: Sequence[torch.Tensor], *,
                 with_proposals: bool = False) -> list[tuple[torch.Tensor, ...]]:
    """The detector network on a batch of images ([3, H, W] float in [0, 1]): per image, the box
    regressed for every proposal and foreground class, [P, K, 4] in the pixels of the input image
    (clipped to it), and the proposal's class-score vector [P, K+1] (softmax, background at 0);
    `with_proposals` adds a third element, the RPN's proposals [P, 4] in the input image's pixels
    (what the bottom-up rule keeps as boxes).

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
            ratios = [proposals[0].new_tensor(r) for r in _to_original(image_list, original_sizes)]
            legacy = uses_legacy_boxes(model)
            if legacy:
                # py-faster-rcnn decodes in original-image pixels (rois / im_scale), where the +1 of
                # its box widths is measured, and clips there to [0, W - 1].
                original_proposals = [p * r for p, r in zip(proposals, ratios)]
                pred_boxes = heads.box_coder.decode(box_regression, original_proposals)  # [sum P, K+1, 4]
            else:
                pred_boxes = heads.box_coder.decode(box_regression, proposals)

            # BoxCoder.decode leaves [0, 4 (K+1)] for an image batch without proposals: keep [P, K+1, 4]
            pred_boxes = pred_boxes.reshape(-1, pred_scores.shape[-1], 4)
            results = []
            for boxes, scores, resized, original, ratio in zip(
                pred_boxes.split(counts), pred_scores.split(counts), image_list.image_sizes, original_sizes, ratios
            ):
                if legacy:
                    boxes = clip_boxes_legacy(boxes, original)
                else:
                    boxes = box_ops.clip_boxes_to_image(boxes, resized) * ratio
                results.append((boxes[:, 1:], scores))
            if with_proposals:
                results = [(*result, p * r) for result, p, r in zip(results, proposals, ratios)]
    finally:
        model.train(was_training)
    return results


def _to_original(image_list, original_sizes) -> list[list[float]]:
    """[sx, sy, sx, sy] per image: resized-frame boxes times it are in the original image's pixels
    (the transform's own, faster_rcnn.PixelFormatTransform; otherwise the ratio of the sizes)."""
    if hasattr(image_list, "to_original"):
        return image_list.to_original
    return [[original[1] / resized[1], original[0] / resized[0]] * 2
            for resized, original in zip(image_list.image_sizes, original_sizes)]


def detector_stages(model: torch.nn.Module, images: Sequence[torch.Tensor]) -> list[dict[str, torch.Tensor]]:
    """Every stage of the detector on a batch of images ([3, H, W] float in [0, 1]), per image: `input`
    (the normalised, resized image [3, h, w]), `res4` (the body's map), `proposals` ([P, 4], resized frame),
    `pooled` (the RoI pooler's [P, C, 14, 14]), `features` (the head's [P, 2048]), `class_logits`,
    `box_deltas`, `class_scores` (softmax, background 0), `boxes_per_class` ([P, K, 4], original pixels, as
    run_detector), `proposals_original` (the proposals in original pixels) and, with an attribute head,
    `attribute_logits` / `attribute_scores` (softmax, 0 = no attribute) of each proposal's arg-max class.
    For comparisons with the released detectors (convert.verify's detector layouts, docs/bottom-up-detector.md)."""
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            image_list, features, original_sizes = _backbone_features(model, images, device)
            proposals, _ = model.rpn(image_list, features)
            heads = model.roi_heads
            pooled = heads.box_roi_pool(features, proposals, image_list.image_sizes)
            box_features = heads.box_head(pooled)
            class_logits, box_regression = heads.box_predictor(box_features)
            attribute_logits = None
            if hasattr(heads, "attribute_predictor"):
                attribute_logits = heads.attribute_predictor(box_features.flatten(1), class_logits.argmax(dim=1))
            per_class = run_detector(model, images)
            counts = [len(p) for p in proposals]
            out = []
            to_original = _to_original(image_list, original_sizes)
            for i, count in enumerate(counts):
                sl = slice(sum(counts[:i]), sum(counts[:i]) + count)
                h, w = image_list.image_sizes[i]
                stage = {"input": image_list.tensors[i, :, :h, :w], "res4": features["0"][i],
                         "proposals": proposals[i], "pooled": pooled[sl], "features": box_features[sl],
                         "class_logits": class_logits[sl], "box_deltas": box_regression[sl],
                         "class_scores": F.softmax(class_logits[sl], dim=-1), "boxes_per_class": per_class[i][0],
                         "proposals_original": proposals[i] * proposals[i].new_tensor(to_original[i])}
                if attribute_logits is not None:
                    stage["attribute_logits"] = attribute_logits[sl]
                    stage["attribute_scores"] = F.softmax(attribute_logits[sl], dim=-1)
                out.append(stage)
    finally:
        model.train(was_training)
    return out


def detect_rois(model: torch.nn.Module, images: Sequence[torch.Tensor], select_kwargs: Mapping[str, Any]) -> list[SelectedRoIs]:
    """Detect and select the RoIs of a batch of images ([3, H, W] float in [0, 1]).

    `run_detector`, then per image the rule `select_kwargs["rule"]` names (RoISelection; without it the
    DESIGN §4 rule, `select_rois`). Boxes come back in the pixel coordinates of the input images, on the CPU.
    """
    results = []
    legacy = uses_legacy_boxes(model)
    kwargs = {key: value for key, value in select_kwargs.items() if key != "rule"}
    bottom_up = select_kwargs.get("rule", "per_class") == "bottom_up"
    with torch.inference_mode():
        for boxes_per_class, class_scores, *proposals in run_detector(model, images, with_proposals=bottom_up):
            if bottom_up:
                selected = select_rois_bottom_up(proposals[0], class_scores, **kwargs, legacy_iou=legacy)
            else:
                selected = select_rois(boxes_per_class, class_scores, **kwargs, legacy_iou=legacy)
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


class _DecodeDataset(Dataset):
    def __init__(self, samples: list[tuple[str, Any]], max_pixels: int = DEFAULT_MAX_PIXELS):
        self.samples = samples
        self.max_pixels = checked_max_pixels(max_pixels)

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> tuple[str, torch.Tensor | None, str, str]:
        key, source = self.samples[index]
        try:
            # bytes (a CC shard's image) are named by their sample key, files by their path
            name = f"{key!r}" if isinstance(source, (bytes, bytearray, memoryview)) else None
            return key, decode_image(source, max_pixels=self.max_pixels, name=name), STATUS_OK, ""
        except FileNotFoundError as exc:
            return key, None, STATUS_MISSING_FILE, f"{type(exc).__name__}: {exc}"
        except Exception as exc:  # noqa: BLE001 - any decoder failure (ImageTooLarge too) is this row's error
            return key, None, STATUS_DECODE_ERROR, f"{type(exc).__name__}: {exc}"


def _collate(batch: list) -> list:
    return batch


def extract_rois_to_parquet(
    model: torch.nn.Module,
    samples: Iterable[tuple[str, bytes | str | os.PathLike]],
    out_parquet: str | os.PathLike,
    batch_size: int,
    select_kwargs: Mapping[str, Any],
    num_workers: int = 0,
    metadata: Mapping[str, Any] | None = None,
    *,
    max_pixels: int = DEFAULT_MAX_PIXELS,
) -> dict[str, int]:
    """Detect RoIs for every (key, image bytes or path) sample and write one parquet row per sample.

    Images are decoded in a DataLoader (worker processes when num_workers > 0). An image that
    cannot be read becomes a row with status 'decode_error' (or 'missing_file') and its error; the
    others go on. So does one over `max_pixels` (the config's max_image_pixels), refused from its header
    (error "ImageTooLarge: ..."). An image on which the detector gives fewer candidate boxes than
    rois.min_boxes (its RPN kept no proposal, or too few) becomes a row with status 'too_few_boxes'.
    `metadata` goes into the file's `vlbert_rois` metadata (with source 'detector'). Returns counts
    {'rows', 'ok', 'failed'}.
    """
    samples = list(samples)
    _check_unique_keys(samples, out_parquet)
    num_classes = int(model.roi_heads.box_predictor.cls_score.out_features)
    batch_size = max(1, int(batch_size))
    box_counts = []
    with RoIParquetWriter(out_parquet, num_classes, {"source": "detector", **(metadata or {})}) as writer:
        progress = Progress(decoded_batches(samples, batch_size, num_workers, max_pixels=max_pixels),
                            total=math.ceil(len(samples) / batch_size), desc="rois", unit="batch")
        for batch in progress:
            decoded = [img for _, img, status, _ in batch if status == STATUS_OK]
            selections = iter(detect_rois(model, [to_unit_float(img) for img in decoded], select_kwargs))
            for key, img, status, error in batch:
                if status != STATUS_OK:
                    log.warning("%s: %s (%s)", key, status, error)
                    writer.add_failure(key, status, error)
                    continue
                sel = next(selections)
                if len(sel) < select_kwargs["min_boxes"]:
                    # both rules top up to min_boxes, so this happens only when the proposals (x K classes for
                    # per_class) are fewer than min_boxes
                    error = (f"the detector gives {len(sel)} candidate boxes, rois.min_boxes is "
                             f"{select_kwargs['min_boxes']}")
                    log.warning("%s: %s (%s)", key, STATUS_TOO_FEW_BOXES, error)
                    writer.add_failure(key, STATUS_TOO_FEW_BOXES, error)
                    continue
                box_counts.append(len(sel))
                writer.add(key, image_w=int(img.shape[-1]), image_h=int(img.shape[-2]), boxes=sel.boxes.numpy(),
                           scores=sel.scores.numpy(), class_ids=sel.class_ids.numpy(),
                           class_scores=sel.class_scores.numpy())
            progress.set_postfix(ok=writer.status_counts[STATUS_OK], failed=sum(writer.status_counts.values())
                                 - writer.status_counts[STATUS_OK])
    num_ok = writer.status_counts[STATUS_OK]
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


def decoded_batches(samples: Sequence[tuple[str, Any]], batch_size: int, num_workers: int = 0, *,
                    max_pixels: int = DEFAULT_MAX_PIXELS) -> Iterator[list[tuple[str, torch.Tensor | None, str, str]]]:
    """Batches of (key, [3, H, W] uint8 image or None, status, error), in sample order, decoded in a
    DataLoader (in worker processes when num_workers > 0); images over `max_pixels` are decode_error rows."""
    yield from DataLoader(_DecodeDataset(list(samples), max_pixels), batch_size=max(1, int(batch_size)), shuffle=False,
                          num_workers=int(num_workers), collate_fn=_collate)


def read_cc_shard(tar_path: str | os.PathLike) -> Iterator[tuple[str, bytes]]:
    """Yield (key, image bytes) for each sample of a webdataset tar, in file order.

    The samples are webdataset's own (`tarfile_to_samples`, as pre-training reads the same shards), so
    the RoI rows carry the keys pre-training looks up. A member whose name has no extension (webdataset
    would drop it), a file name twice in one sample, or a sample without an image member means a
    broken shard and raises; a tar damaged on disk raises DamagedFile (vlbert_core/damaged.py).
    """
    def check_member(name: str) -> str:
        if base_plus_ext(name)[0] is None:
            raise ValueError(f"{tar_path}: member {name!r} has no extension, so it belongs to no sample")
        return name

    for sample in read_shard_samples([tar_path], verify_checksum=True, rename_files=check_member):
        image_ext = next((ext for ext in IMAGE_EXTENSIONS if ext in sample), None)
        if image_ext is None:
            raise ValueError(f"{tar_path}: sample {sample['__key__']!r} has no image member ({'/'.join(IMAGE_EXTENSIONS)})")
        yield sample["__key__"], sample[image_ext]


def extract_rois_with_detector(model_path: str | os.PathLike, samples: Iterable[tuple[str, bytes | str | os.PathLike]],
                               out_parquet: str | os.PathLike, rois_cfg: Mapping[str, Any],
                               device: str = "cpu", *, max_image_pixels: int = DEFAULT_MAX_PIXELS) -> dict[str, int]:
    """Load the detector checkpoint and write the RoI parquet of `samples` with the config's `rois:` rule;
    an image over `max_image_pixels` (the config's top-level key) is a decode_error row."""
    job = RoIJobSettings.from_config(rois_cfg)
    model, _ = load_detector(model_path, map_location=device)
    return extract_rois_to_parquet(
        model.to(device),
        samples,
        out_parquet,
        batch_size=job.batch_size,
        select_kwargs=selection_kwargs(rois_cfg),
        num_workers=job.num_workers,
        metadata={"detector": str(model_path), "selection": selection_kwargs(rois_cfg)},
        max_pixels=max_image_pixels,
    )
