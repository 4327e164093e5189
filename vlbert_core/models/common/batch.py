"""Batches of model inputs (every family reads the same batches): padded sequences, padded images and padded boxes."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image

from vlbert_core.detector.pixels import DEFAULT_PIXEL_FORMAT, normalise_pixels

from .inputs import IMG, InputSequence


@dataclass
class ModelBatch:
    """B samples, L sequence length, R boxes (padded). Box 0 of every image sample is the whole image."""

    input_ids: torch.Tensor          # Long [B, L]
    element_kind: torch.Tensor       # Long [B, L]
    segment_ids: torch.Tensor        # Long [B, L]
    position_ids: torch.Tensor       # Long [B, L]
    roi_index: torch.Tensor          # Long [B, L]
    attention_mask: torch.Tensor     # Bool [B, L], True on real elements
    images: torch.Tensor | None      # Float [B, 3, H, W], normalised, zero-padded to the batch's max H, W
    boxes: torch.Tensor | None       # Float [B, R, 4], pixel x1,y1,x2,y2 in the (resized) image
    box_valid: torch.Tensor | None   # Bool [B, R]
    roi_masked: torch.Tensor | None  # Bool [B, R]
    has_image: torch.Tensor          # Bool [B]
    # Float [B, 2]: width and height of each sample's image as the model sees it (resized, before padding; the
    # released im_info[:2]), which the box geometry is normalised by. Zeros for text-only samples.
    image_size: torch.Tensor | None
    # Float [B, R, S, S]: each box's object segmentation (VCR; box 0 all ones), or None (FastRCNNVisualNetwork)
    instance_masks: torch.Tensor | None = None

    def to(self, device) -> "ModelBatch":
        moved = {f.name: (None if getattr(self, f.name) is None else getattr(self, f.name).to(device))
                 for f in dataclasses.fields(self)}
        return ModelBatch(**moved)

    @property
    def batch_size(self) -> int:
        return self.input_ids.shape[0]

    def select_rows(self, rows: torch.Tensor) -> "ModelBatch":
        """The batch of the given rows (Long indices), cut to their longest sequence; without image fields
        when none of them has an image, as collate_samples would build it from those samples alone."""
        length = int(self.attention_mask[rows].sum(1).max())
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        selected = {}
        for name, value in fields.items():
            if value is None:
                selected[name] = None
            elif name in ("input_ids", "element_kind", "segment_ids", "position_ids", "roi_index", "attention_mask"):
                selected[name] = value[rows, :length]
            else:
                selected[name] = value[rows]
        if not bool(selected["has_image"].any()):
            for name in ("images", "boxes", "box_valid", "roi_masked", "image_size", "instance_masks"):
                selected[name] = None
        return ModelBatch(**selected)


def fitted_size(width: int, height: int, max_side: int, min_side: int | None = None) -> tuple[int, int]:
    """The (width, height) an image of `width` x `height` is resized to.

    Without `min_side`, the longer side becomes exactly `max_side`, up or down (the detector's own transform,
    so the visual network sees objects at the scale the detector was trained at). With `min_side`, the
    released rule (the authors' Resize, SCALES [min_side, max_side]): the shorter side becomes `min_side`
    unless the longer side would then exceed `max_side`, in which case the shorter side shrinks to fit;
    sides are truncated to whole pixels as theirs are (400x280 with [600, 1000] -> 857x600).
    """
    if min_side is None:
        scale = max_side / max(width, height)
        return max(1, round(width * scale)), max(1, round(height * scale))
    size = min_side
    short, long = float(min(width, height)), float(max(width, height))
    if long / short * size > max_side:
        size = int(max_side * short / long)
    if (width <= height and width == size) or (height <= width and height == size):
        return width, height
    if width < height:
        return size, int(size * height / width)
    return int(size * width / height), size


def fit_image(img: Image.Image, max_side: int, min_side: int | None = None) -> tuple[Image.Image, tuple[float, float]]:
    """The image resized to `fitted_size` (bilinear), and the factors (x, y) it was scaled by.

    Boxes in original pixels are multiplied by the same per-axis factors (the new size over the old one,
    as the authors' Resize computes them).
    """
    w, h = img.size
    new_w, new_h = fitted_size(w, h, int(max_side), None if min_side is None else int(min_side))
    if (new_w, new_h) != (w, h):
        img = img.resize((new_w, new_h), Image.BILINEAR)
    return img, (new_w / w, new_h / h)


def image_to_tensor(img: Image.Image, pixel_format: str = DEFAULT_PIXEL_FORMAT) -> torch.Tensor:
    """RGB image -> Float [3, H, W] normalised as the visual network's weights expect (`pixel_format`
    of its backbone, detector/pixels.py), as the detector saw it."""
    array = np.asarray(img.convert("RGB"), dtype=np.float32) / 255.0
    tensor = torch.from_numpy(array).permute(2, 0, 1).contiguous()
    return normalise_pixels(tensor, pixel_format)


def fixed_canvas(height: int, width: int, canvas: Sequence[int]) -> tuple[int, int]:
    """(H, W) of the canvas an image of that size is padded to: (short, long) sides as `canvas` = (short, long)
    gives them, by the image's orientation (the authors' VCR FixPadding, vcr/data/transforms/transforms.py:
    a landscape image to short x long, a portrait one to long x short, zeros after normalisation)."""
    short, long = int(canvas[0]), int(canvas[1])
    h1, w1 = (short, long) if height <= width else (long, short)
    if height > h1 or width > w1:
        raise ValueError(f"a {width}x{height} image does not fit its fixed canvas {w1}x{h1} "
                         f"(canvas {list(canvas)}: check model.image_min_side / image_max_side)")
    return h1, w1


def _pad_2d(rows: list[list[int]], pad_value: int) -> torch.Tensor:
    length = max(len(r) for r in rows)
    out = torch.full((len(rows), length), pad_value, dtype=torch.long)
    for i, row in enumerate(rows):
        out[i, : len(row)] = torch.as_tensor(row, dtype=torch.long)
    return out


def _collate_instance_masks(samples: list[dict], image_samples: list[dict], max_r: int) -> torch.Tensor | None:
    """[B, max_r, S, S] of the samples' "instance_masks" (zeros on padding), or None when no sample has any."""
    with_masks = [s.get("instance_masks") is not None for s in image_samples]
    if not any(with_masks):
        return None
    if not all(with_masks):
        raise ValueError("collate_samples: some image samples have instance_masks and some do not")
    size = tuple(image_samples[0]["instance_masks"].shape[-2:])
    out = torch.zeros(len(samples), max_r, *size)
    for i, sample in enumerate(samples):
        if sample.get("image") is None:
            continue
        masks = torch.as_tensor(sample["instance_masks"], dtype=torch.float32)
        if tuple(masks.shape) != (sample["boxes"].shape[0], *size):
            raise ValueError(f"collate_samples: sample {i}: instance_masks shape {tuple(masks.shape)}, expected "
                             f"{(sample['boxes'].shape[0], *size)}")
        out[i, : masks.shape[0]] = masks
    return out


def collate_samples(samples: list[dict], *, canvas: Sequence[int] | None = None) -> ModelBatch:
    """Pad a list of samples into a ModelBatch; with `canvas` (short, long) every image is padded at least to
    its fixed canvas (fixed_canvas), as the authors' VCR code does, so a feature does not depend on the batch.

    Each sample: "sequence" (InputSequence) and, for image samples, "image" (Float [3, H, W]) and
    "boxes" (Float [R_i, 4], box 0 = whole image), optionally "roi_masked" (Bool [R_i]) and "instance_masks"
    (Float [R_i, S, S]; all image samples or none). Extra keys are ignored (task and pre-training collates gather
    their own labels).
    """
    if not samples:
        raise ValueError("collate_samples: empty sample list")
    sequences: list[InputSequence] = []
    for i, sample in enumerate(samples):
        seq = sample.get("sequence")
        if not isinstance(seq, InputSequence):
            raise ValueError(f"collate_samples: sample {i} has no InputSequence under 'sequence'")
        n = len(seq.input_ids)
        if not (len(seq.element_kind) == len(seq.segment_ids) == len(seq.position_ids) == len(seq.roi_index) == n):
            raise ValueError(f"collate_samples: sample {i}: sequence fields have different lengths")
        sequences.append(seq)
        has_img_elements = IMG in seq.element_kind
        has_image = sample.get("image") is not None
        if has_img_elements != has_image:
            raise ValueError(f"collate_samples: sample {i} has {'[IMG] elements' if has_img_elements else 'no [IMG] elements'} "
                             f"but {'an image' if has_image else 'no image'}")
        if has_image:
            boxes = sample.get("boxes")
            if boxes is None or boxes.ndim != 2 or boxes.shape[1] != 4:
                raise ValueError(f"collate_samples: image sample {i} needs 'boxes' of shape [R, 4]")
            needed = max(r for r, k in zip(seq.roi_index, seq.element_kind) if k == IMG) + 1
            if boxes.shape[0] < needed:
                raise ValueError(f"collate_samples: sample {i} refers to box {needed - 1} but has {boxes.shape[0]} boxes")
            masked = sample.get("roi_masked")
            if masked is not None and masked.shape != (boxes.shape[0],):
                raise ValueError(f"collate_samples: sample {i}: roi_masked shape {tuple(masked.shape)} != ({boxes.shape[0]},)")

    lengths = torch.tensor([len(s.input_ids) for s in sequences])
    input_ids = _pad_2d([s.input_ids for s in sequences], 0)
    attention_mask = torch.arange(input_ids.shape[1])[None, :] < lengths[:, None]
    has_image = torch.tensor([s.get("image") is not None for s in samples], dtype=torch.bool)

    images = boxes = box_valid = roi_masked = image_size = instance_masks = None
    if bool(has_image.any()):
        image_samples = [s for s in samples if s.get("image") is not None]
        max_h = max(s["image"].shape[1] for s in image_samples)
        max_w = max(s["image"].shape[2] for s in image_samples)
        if canvas is not None:
            sizes = [fixed_canvas(s["image"].shape[1], s["image"].shape[2], canvas) for s in image_samples]
            max_h, max_w = max(max_h, *(h for h, _ in sizes)), max(max_w, *(w for _, w in sizes))
        max_r = max(s["boxes"].shape[0] for s in image_samples)
        images = torch.zeros(len(samples), 3, max_h, max_w)
        boxes = torch.zeros(len(samples), max_r, 4)
        box_valid = torch.zeros(len(samples), max_r, dtype=torch.bool)
        roi_masked = torch.zeros(len(samples), max_r, dtype=torch.bool)
        image_size = torch.zeros(len(samples), 2)
        for i, sample in enumerate(samples):
            if sample.get("image") is None:
                continue
            img, bx = sample["image"], sample["boxes"]
            images[i, :, : img.shape[1], : img.shape[2]] = img
            image_size[i] = torch.tensor([img.shape[2], img.shape[1]], dtype=torch.float32)
            boxes[i, : bx.shape[0]] = torch.as_tensor(bx, dtype=torch.float32)
            box_valid[i, : bx.shape[0]] = True
            if sample.get("roi_masked") is not None:
                roi_masked[i, : bx.shape[0]] = torch.as_tensor(sample["roi_masked"], dtype=torch.bool)
        instance_masks = _collate_instance_masks(samples, image_samples, max_r)
    return ModelBatch(
        input_ids=input_ids,
        element_kind=_pad_2d([s.element_kind for s in sequences], 0),
        segment_ids=_pad_2d([s.segment_ids for s in sequences], 0),
        position_ids=_pad_2d([s.position_ids for s in sequences], 0),
        roi_index=_pad_2d([s.roi_index for s in sequences], 0),
        attention_mask=attention_mask,
        images=images, boxes=boxes, box_valid=box_valid, roi_masked=roi_masked, has_image=has_image,
        image_size=image_size, instance_masks=instance_masks,
    )
