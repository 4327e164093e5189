"""Train the Faster R-CNN on COCO-style instances on the CPU, evaluate AP@0.5, save and load it."""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, NamedTuple

import torch
from torchvision.models.detection import FasterRCNN
from vlbert_core.progress import Progress

from ..images import DEFAULT_MAX_PIXELS, ImageError
from ..optim import OptimizerSettings, build_optimizer, build_scheduler, detectron_step_decay
from ..typed_settings import read_fields
from ..utils import atomic_path, get_logger, seed_everything
from .images import decode_image
from .faster_rcnn import (IGNORE_ATTRIBUTE, MAX_ATTRIBUTES_PER_OBJECT, DetectorSettings, build_detector,
                          predict_attributes)
from .metrics import ImageDetections, ImageGroundTruth, evaluate_ap50
from ..safe_pickle import load_torch_file

log = get_logger(__name__)

MOMENTUM = 0.9
WARMUP_START_FACTOR = 1.0 / 3.0  # Detectron's linear warm-up starts at lr / 3
DEFAULT_DECAY_AT = (0.75, 0.9)  # fractions of the run where the lr drops by 10x


@dataclass(frozen=True)
class DetectorTrainSettings:
    """The `detector.train:` section, typed once (a missing key or a value of the wrong kind names the key)."""

    steps: int
    batch_size: int
    lr: float
    weight_decay: float
    warmup_steps: int | None = None              # default min(100, steps // 10)
    decay_at: tuple[float, ...] = DEFAULT_DECAY_AT
    clip_grad: float = 10.0

    @classmethod
    def from_config(cls, train_cfg: Mapping[str, Any], where: str = "detector.train") -> "DetectorTrainSettings":
        return cls(**read_fields(cls, train_cfg, where))


@dataclass
class DetectionImage:
    file_name: str
    image: torch.Tensor  # [3, H, W] uint8
    boxes: torch.Tensor  # [G, 4] float32 x1,y1,x2,y2
    labels: torch.Tensor  # [G] int64 in 1..K
    # [G, MAX_ATTRIBUTES_PER_OBJECT] int64 attribute ids 1..A padded with IGNORE_ATTRIBUTE; None when the
    # file has no attribute vocabulary
    attributes: torch.Tensor | None = None


class CocoSplit(NamedTuple):
    categories: list[dict]        # [{"id", "name"}] in label order 1..K
    images: list[DetectionImage]
    attributes: list[str] | None  # attribute names in id order 1..A, or None


def load_coco_split(annotations_path: str | os.PathLike, images_dir: str | os.PathLike,
                    categories: list[dict] | None = None, *, max_pixels: int = DEFAULT_MAX_PIXELS) -> CocoSplit:
    """Read a COCO instances file and its images (each at most `max_pixels`, the config's max_image_pixels:
    a larger one raises ImageTooLarge naming it and the file, from its header).

    Categories are mapped to detector labels 1..K in ascending category-id order (0 is
    background). Pass the training split's categories when reading another split: they must
    agree. Crowd annotations are skipped; every other annotation must have a known category and a
    positive-size bbox inside its image.

    Attributes, as in Visual Genome and the embedded world's detector files: a top-level
    `attributes` vocabulary [{"id", "name"}] (ids 1..A) and per annotation an `attributes` list of
    names from it (possibly empty, at most MAX_ATTRIBUTES_PER_OBJECT). A file without the vocabulary
    has no attributes (CocoSplit.attributes None); an annotation naming an unknown attribute is an
    error naming the file and the annotation.
    """
    path = Path(annotations_path)
    with open(path) as f:
        coco = json.load(f)
    for key in ("images", "annotations", "categories"):
        if key not in coco:
            raise ValueError(f"{path}: COCO instances file lacks '{key}'")
    file_categories = sorted(({"id": int(c["id"]), "name": str(c["name"])} for c in coco["categories"]),
                             key=lambda c: c["id"])
    if categories is not None and file_categories != categories:
        raise ValueError(f"{path}: categories {file_categories} differ from the training split's {categories}")
    label_of = {c["id"]: i + 1 for i, c in enumerate(file_categories)}
    attribute_names = _attribute_vocabulary(path, coco.get("attributes"))
    attribute_id = {name: i + 1 for i, name in enumerate(attribute_names or [])}

    images_by_id: dict[int, dict] = {}
    for i, img in enumerate(coco["images"]):
        for key in ("id", "file_name", "width", "height"):
            if key not in img:
                raise ValueError(f"{path}: images[{i}] lacks '{key}'")
        if img["id"] in images_by_id:
            raise ValueError(f"{path}: images[{i}] repeats image id {img['id']}")
        images_by_id[img["id"]] = img
    boxes_by_image: dict[int, list] = {image_id: [] for image_id in images_by_id}
    labels_by_image: dict[int, list] = {image_id: [] for image_id in images_by_id}
    attributes_by_image: dict[int, list] = {image_id: [] for image_id in images_by_id}
    for i, ann in enumerate(coco["annotations"]):
        where = f"{path}: annotations[{i}] (id {ann.get('id')})"
        if ann.get("iscrowd", 0):
            continue
        if ann.get("image_id") not in images_by_id:
            raise ValueError(f"{where}: unknown image_id {ann.get('image_id')}")
        if ann.get("category_id") not in label_of:
            raise ValueError(f"{where}: unknown category_id {ann.get('category_id')}")
        img = images_by_id[ann["image_id"]]
        x, y, w, h = (float(v) for v in ann["bbox"])
        if w <= 0 or h <= 0 or x < -1 or y < -1 or x + w > img["width"] + 1 or y + h > img["height"] + 1:
            raise ValueError(f"{where}: bbox {ann['bbox']} is empty or outside the {img['width']}x{img['height']} image")
        boxes_by_image[img["id"]].append([x, y, x + w, y + h])
        labels_by_image[img["id"]].append(label_of[ann["category_id"]])
        if attribute_names is not None:
            attributes_by_image[img["id"]].append(_annotation_attributes(where, ann.get("attributes", []), attribute_id))

    images_dir = Path(images_dir)
    out = []
    for image_id, img in Progress(images_by_id.items(), desc=f"load {path.name}", unit="img"):
        file_path = images_dir / img["file_name"]
        try:
            pixels = decode_image(file_path, max_pixels=max_pixels, name=f"{file_path} (image {image_id} of {path})")
        except ImageError:
            raise  # its message names the image file and the annotations file
        except Exception as exc:
            raise ValueError(f"{path}: image {image_id} ({file_path}) cannot be read: {exc}") from exc
        if tuple(pixels.shape[-2:]) != (img["height"], img["width"]):
            raise ValueError(f"{path}: image {image_id} ({file_path}) is {pixels.shape[-1]}x{pixels.shape[-2]}, "
                             f"annotated as {img['width']}x{img['height']}")
        out.append(DetectionImage(
            file_name=img["file_name"],
            image=pixels,
            boxes=torch.tensor(boxes_by_image[image_id], dtype=torch.float32).reshape(-1, 4),
            labels=torch.tensor(labels_by_image[image_id], dtype=torch.int64),
            attributes=None if attribute_names is None else torch.tensor(
                attributes_by_image[image_id], dtype=torch.int64).reshape(-1, MAX_ATTRIBUTES_PER_OBJECT),
        ))
    log.info("%s: %d images, %d boxes, %d categories, %s attributes", path, len(out),
             sum(len(d.labels) for d in out), len(file_categories),
             "no" if attribute_names is None else len(attribute_names))
    return CocoSplit(file_categories, out, attribute_names)


def _attribute_vocabulary(path: Path, entries) -> list[str] | None:
    """The names of a file's `attributes` vocabulary in id order; its ids must be 1..A."""
    if entries is None:
        return None
    if not isinstance(entries, list) or not all(isinstance(e, dict) and "id" in e and "name" in e for e in entries):
        raise ValueError(f"{path}: 'attributes' must be a list of {{'id', 'name'}} entries")
    entries = sorted(entries, key=lambda e: int(e["id"]))
    if [int(e["id"]) for e in entries] != list(range(1, len(entries) + 1)):
        raise ValueError(f"{path}: 'attributes' ids must be 1..{len(entries)} (0 is 'no attribute'), "
                         f"got {[e['id'] for e in entries]}")
    names = [str(e["name"]) for e in entries]
    if len(set(names)) != len(names):
        raise ValueError(f"{path}: 'attributes' repeats a name: {names}")
    return names


def _annotation_attributes(where: str, names, attribute_id: dict[str, int]) -> list[int]:
    """An annotation's attribute names as ids padded to MAX_ATTRIBUTES_PER_OBJECT with IGNORE_ATTRIBUTE."""
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise ValueError(f"{where}: 'attributes' must be a list of attribute names, got {names!r}")
    unknown = [n for n in names if n not in attribute_id]
    if unknown:
        raise ValueError(f"{where}: unknown attribute(s) {unknown}; the file's 'attributes' vocabulary has "
                         f"{sorted(attribute_id)}")
    ids = sorted({attribute_id[n] for n in names})
    if len(ids) > MAX_ATTRIBUTES_PER_OBJECT:
        raise ValueError(f"{where}: {len(ids)} attributes, at most {MAX_ATTRIBUTES_PER_OBJECT} per object")
    return ids + [IGNORE_ATTRIBUTE] * (MAX_ATTRIBUTES_PER_OBJECT - len(ids))


def _hflip(image: torch.Tensor, boxes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    width = image.shape[-1]
    flipped = boxes.clone()
    flipped[:, 0] = width - boxes[:, 2]
    flipped[:, 2] = width - boxes[:, 0]
    return image.flip(-1), flipped


def evaluate_detector(model: FasterRCNN, data: list[DetectionImage], num_classes: int, batch_size: int = 16) -> dict:
    """AP@0.5 of the model's standard detections (score > box_score_thresh, per-class NMS)."""
    model.eval()
    detections, truths = [], []
    with torch.inference_mode():
        for start in Progress(range(0, len(data), batch_size), desc="eval", unit="batch"):
            chunk = data[start:start + batch_size]
            outputs = model([d.image.float().div(255.0) for d in chunk])
            for d, out in zip(chunk, outputs):
                detections.append(ImageDetections(out["boxes"].numpy(), out["scores"].numpy(), out["labels"].numpy()))
                truths.append(ImageGroundTruth(d.boxes.numpy(), d.labels.numpy()))
    return evaluate_ap50(detections, truths, num_classes)


def evaluate_attributes(model: FasterRCNN, data: list[DetectionImage], batch_size: int = 16) -> float:
    """Attribute recall of the ground-truth boxes: per object with k attributes, the share of them among
    the k most probable predicted attributes ("no attribute" excluded), averaged over those objects."""
    model.eval()
    hits, objects = 0.0, 0
    with torch.inference_mode():
        for start in range(0, len(data), batch_size):
            chunk = [d for d in data[start:start + batch_size] if len(d.boxes)]
            if not chunk:
                continue
            images, targets = model.transform([d.image.float().div(255.0) for d in chunk],
                                              [{"boxes": d.boxes.clone(), "labels": d.labels} for d in chunk])
            features = model.backbone(images.tensors)
            probs = predict_attributes(model, {"0": features}, [t["boxes"] for t in targets], images.image_sizes)
            truth = torch.cat([d.attributes for d in chunk])
            for p, row in zip(probs[:, 1:], truth):
                wanted = set((row[row != IGNORE_ATTRIBUTE]).tolist())
                if wanted:
                    top = set((p.topk(len(wanted)).indices + 1).tolist())
                    hits += len(top & wanted) / len(wanted)
                    objects += 1
    return hits / max(objects, 1)


def train_detector(
    cfg: Mapping[str, Any],
    annotations_train: str | os.PathLike,
    annotations_val: str | os.PathLike,
    images_dir: str | os.PathLike,
    out_model: str | os.PathLike,
    out_metrics: str | os.PathLike,
    seed: int,
    *,
    max_image_pixels: int = DEFAULT_MAX_PIXELS,
) -> dict:
    """Train on the train split, report AP@0.5 on val, write the model (torch.save) and metrics JSON.

    cfg is the config's `detector:` section; training settings come from cfg['train']: steps,
    batch_size, lr, weight_decay, and optionally warmup_steps (default min(100, steps // 10)),
    decay_at (fractions of steps where lr drops 10x, default [0.75, 0.9]), clip_grad (default 10).
    SGD with momentum 0.9 and horizontal-flip augmentation. With cfg['attribute_loss_weight'] > 0 the
    annotations must carry attributes (load_coco_split): the detector gets bottom-up attention's attribute
    head (num_attributes = the vocabulary's size), trained with them, its val attribute recall reported.
    Every image is at most `max_image_pixels` (the config's top-level key), checked from its header.
    """
    seed_everything(seed)
    train = DetectorTrainSettings.from_config(cfg["train"])
    steps, batch_size, clip_grad = train.steps, train.batch_size, train.clip_grad
    warmup_steps = min(100, steps // 10) if train.warmup_steps is None else train.warmup_steps
    decay_at = train.decay_at

    categories, train_data, attribute_names = load_coco_split(annotations_train, images_dir,
                                                              max_pixels=max_image_pixels)
    _, val_data, val_attribute_names = load_coco_split(annotations_val, images_dir, categories,
                                                       max_pixels=max_image_pixels)
    if not train_data:
        raise ValueError(f"{annotations_train}: no training images")
    num_classes = len(categories)
    cfg = dict(cfg)
    train_attributes = DetectorSettings.from_config(cfg).attribute_loss_weight > 0
    if train_attributes:
        if attribute_names is None:
            raise ValueError(f"{annotations_train}: detector.attribute_loss_weight is {cfg['attribute_loss_weight']}, "
                             "but the file has no 'attributes' vocabulary (set attribute_loss_weight: 0 to train "
                             "without attributes)")
        if val_attribute_names != attribute_names:
            raise ValueError(f"{annotations_val}: attributes {val_attribute_names} differ from the training "
                             f"split's {attribute_names}")
        if cfg.get("num_attributes") not in (None, len(attribute_names)):
            raise ValueError(f"detector.num_attributes={cfg['num_attributes']}, but {annotations_train} has "
                             f"{len(attribute_names)} attributes")
        cfg["num_attributes"] = len(attribute_names)
    model = build_detector(cfg, num_classes)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = build_optimizer(model, OptimizerSettings(
        "sgd", lr=train.lr, weight_decay=train.weight_decay, momentum=MOMENTUM,
        decay_all=True))
    decay_steps = [int(frac * steps) for frac in decay_at]
    scheduler = build_scheduler(
        optimizer, lambda s: detectron_step_decay(s, warmup_steps, decay_steps, WARMUP_START_FACTOR))

    generator = torch.Generator().manual_seed(seed)
    order: list[int] = []
    model.train()
    started = time.time()
    running: dict[str, float] = {}
    progress = Progress(range(steps), desc="detector", unit="step")
    for step in progress:
        batch_images, batch_targets = [], []
        for _ in range(batch_size):
            if not order:
                order = torch.randperm(len(train_data), generator=generator).tolist()
            item = train_data[order.pop()]
            image, boxes = item.image, item.boxes
            if torch.rand((), generator=generator).item() < 0.5:
                image, boxes = _hflip(image, boxes)
            batch_images.append(image.float().div(255.0))
            target = {"boxes": boxes, "labels": item.labels}
            if train_attributes:
                target["attributes"] = item.attributes
            batch_targets.append(target)
        losses = model(batch_images, batch_targets)
        loss = sum(losses.values())
        if not torch.isfinite(loss):
            raise FloatingPointError(
                f"detector training diverged at step {step}: losses {({k: float(v) for k, v in losses.items()})}")
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, clip_grad)
        optimizer.step()
        scheduler.step()
        for k, v in losses.items():
            value = v.item()
            running[k] = 0.9 * running.get(k, value) + 0.1 * value
        progress.set_postfix(loss=f"{sum(running.values()):.3f}", lr=f"{scheduler.get_last_lr()[0]:.4f}")
        if step % 50 == 0 or step == steps - 1:
            log.info("step %d/%d lr %.5f %s", step + 1, steps, scheduler.get_last_lr()[0],
                     " ".join(f"{k}={v:.3f}" for k, v in running.items()))
    train_seconds = time.time() - started

    result = evaluate_detector(model, val_data, num_classes)
    per_class = {categories[cls - 1]["name"]: ap for cls, ap in result["per_class"].items()}
    metrics = {
        "ap50": result["ap50"],
        "per_class": per_class,
        "num_images": len(val_data),
        "num_train_images": len(train_data),
        "steps": steps,
        "train_seconds": round(train_seconds, 1),
        "final_losses": {k: round(v, 4) for k, v in running.items()},
    }
    if train_attributes:
        metrics["attribute_recall"] = round(evaluate_attributes(model, val_data), 4)
        log.info("val attribute recall = %.3f", metrics["attribute_recall"])
    log.info("val AP@0.5 = %s over %d images (%.0f s of training)", result["ap50"], len(val_data), train_seconds)

    checkpoint = {"config": cfg, "categories": categories, "num_classes": num_classes,
                  "state_dict": model.state_dict()}
    if train_attributes:
        checkpoint["attributes"] = attribute_names  # as the bottom-up conversion stores attributes_vocab.txt
    with atomic_path(out_model) as tmp:
        torch.save(checkpoint, tmp)
    with atomic_path(out_metrics) as tmp:
        tmp.write_text(json.dumps(metrics, indent=2) + "\n")
    return metrics


CHECKPOINT_KEYS = ("config", "categories", "num_classes", "state_dict")


def load_detector(path: str | os.PathLike, map_location: str | torch.device = "cpu") -> tuple[FasterRCNN, dict]:
    """Load a detector checkpoint; returns (model in eval mode, meta without state_dict).

    The format is what train_detector writes and what `detector.weights` must point at
    (config/schema.yaml): a dict saved with torch.save, loadable with weights_only=True, holding
      config:      the `detector:` config section the model was built with (build_detector keys:
                   backbone, min_size, max_size, rpn_post_nms_*, box_batch_size_per_image, ...);
                   the architecture comes from here, not from the running config;
      categories:  [{"id", "name"}, ...], the K foreground classes in label order 1..K;
      num_classes: K;
      state_dict:  the torchvision FasterRCNN state dict of that architecture with K+1 outputs.
    Any other file fails with a ValueError naming the file and what is wrong with it (not a
    checkpoint, missing entries, missing / unexpected state-dict keys, wrong tensor shapes).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"detector weights {path} do not exist")
    checkpoint = load_torch_file(path, "a detector checkpoint")
    if not isinstance(checkpoint, dict):
        raise ValueError(f"{path}: a detector checkpoint is a dict with keys {list(CHECKPOINT_KEYS)}, "
                         f"this file holds a {type(checkpoint).__name__}")
    missing = [key for key in CHECKPOINT_KEYS if key not in checkpoint]
    if missing:
        raise ValueError(f"{path}: detector checkpoint lacks {missing} (it has {sorted(map(str, checkpoint))}); "
                         f"expected {list(CHECKPOINT_KEYS)} as written by train_detector")
    config, categories = checkpoint["config"], checkpoint["categories"]
    num_classes, state_dict = checkpoint["num_classes"], checkpoint["state_dict"]
    if not isinstance(config, dict) or not isinstance(config.get("backbone"), dict):
        raise ValueError(f"{path}: checkpoint 'config' must be the detector config section with a 'backbone' mapping")
    if not isinstance(num_classes, int) or num_classes < 1:
        raise ValueError(f"{path}: checkpoint 'num_classes' must be a positive int, got {num_classes!r}")
    if not isinstance(categories, list) or len(categories) != num_classes:
        raise ValueError(f"{path}: checkpoint 'categories' must list the {num_classes} classes, "
                         f"got {type(categories).__name__} of length {len(categories) if hasattr(categories, '__len__') else '?'}")
    if not isinstance(state_dict, dict) or not all(isinstance(v, torch.Tensor) for v in state_dict.values()):
        raise ValueError(f"{path}: checkpoint 'state_dict' must map parameter names to tensors")
    config = dict(config)
    # The trained state dict replaces any ImageNet initialisation, which need not exist here.
    config["backbone"] = {k: v for k, v in dict(config["backbone"]).items() if k != "init_weights"}
    try:
        model = build_detector(config, num_classes)
    except (KeyError, ValueError, TypeError) as exc:
        raise ValueError(f"{path}: checkpoint config does not describe a detector: {exc}") from exc
    _check_state_dict(path, model.state_dict(), state_dict)
    model.load_state_dict(state_dict)
    model.to(map_location).eval()
    meta = {k: v for k, v in checkpoint.items() if k != "state_dict"}
    return model, meta


def _check_state_dict(path: Path, expected: Mapping[str, torch.Tensor], given: Mapping[str, torch.Tensor]) -> None:
    """Name every difference between a checkpoint's state dict and the model its config builds."""
    missing = [k for k in expected if k not in given]
    unexpected = [k for k in given if k not in expected]
    wrong_shape = [f"{k}: file {list(given[k].shape)}, model {list(expected[k].shape)}"
                   for k in expected if k in given and given[k].shape != expected[k].shape]
    problems = []
    for what, items in (("missing keys", missing), ("unexpected keys", unexpected), ("wrong shapes", wrong_shape)):
        if items:
            shown = ", ".join(items[:5]) + (f", ... ({len(items) - 5} more)" if len(items) > 5 else "")
            problems.append(f"{len(items)} {what} ({shown})")
    if problems:
        raise ValueError(f"{path}: state_dict does not fit the detector that its config describes: "
                         + "; ".join(problems))
