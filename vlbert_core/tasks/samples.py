"""What every task's samples share: image loading, tokens, truncation, batching.

Each task's data class (in `tasks/modeling/<task>.py`) turns loaded records into sample dicts
(`sample(i)`) and pads a list of them into a `ModelBatch` plus the task's targets
(`collate(samples)`). Images are resized as `model.image_max_side` (and `model.image_min_side`) say, and
the boxes are scaled by the same factors. Box 0 of every sample is the whole image.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from vlbert_core.detector.pixels import DEFAULT_PIXEL_FORMAT
from vlbert_core.images import DEFAULT_MAX_PIXELS, checked_max_pixels
from vlbert_core.models.common.batch import image_to_tensor
from vlbert_core.models.common.inputs import InputSequence, boxes_with_whole_image, build_input_sequence
from vlbert_core.utils import get_logger

from .common import load_task_image, scale_boxes

log = get_logger(__name__)


class ImageLoader:
    """Decoded, resized and normalised task images, cached (several questions share an image). An image over
    `max_pixels` (the config's max_image_pixels) raises `vlbert_core.images.ImageTooLarge` naming it."""

    def __init__(self, max_side: int, cache_size: int = 512, pixel_format: str = DEFAULT_PIXEL_FORMAT,
                 min_side: int | None = None, max_pixels: int = DEFAULT_MAX_PIXELS):
        self.max_side = int(max_side)
        self.min_side = None if min_side is None else int(min_side)
        self.pixel_format = pixel_format
        self.max_pixels = checked_max_pixels(max_pixels)
        self._load = functools.lru_cache(maxsize=cache_size)(self._load_uncached)

    @classmethod
    def from_settings(cls, settings, pixel_format: str = DEFAULT_PIXEL_FORMAT, *,
                      max_pixels: int = DEFAULT_MAX_PIXELS) -> "ImageLoader":
        """The loader of a config's `model:` section or a fine-tuned model's meta: its `image_max_side` and
        (released sizing) `image_min_side`; `max_pixels` is the config's top-level max_image_pixels."""
        min_side = settings.get("image_min_side")
        return cls(int(settings["image_max_side"]), pixel_format=pixel_format,
                   min_side=None if min_side is None else int(min_side), max_pixels=max_pixels)

    def _load_uncached(self, path: str) -> tuple[torch.Tensor, tuple[float, float], int, int]:
        img, scale, (orig_w, orig_h) = load_task_image(path, self.max_side, self.min_side, max_pixels=self.max_pixels)
        return image_to_tensor(img, self.pixel_format), scale, orig_w, orig_h

    def __call__(self, path: str | os.PathLike) -> tuple[torch.Tensor, tuple[float, float], int, int]:
        """(image [3, H, W], scales (x, y) applied, original width, original height)."""
        return self._load(str(path))


class Tokens:
    """The tokenizer and its special ids."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.cls_id = tokenizer.cls_token_id
        self.sep_id = tokenizer.sep_token_id
        self.pad_id = tokenizer.pad_token_id
        self.mask_id = tokenizer.mask_token_id

    def ids(self, text: str) -> list[int]:
        return self.tokenizer.convert_tokens_to_ids(self.tokenizer.tokenize(text))

    def sequence(self, ids_a: list[int], ids_b: list[int] | None, num_rois: int) -> InputSequence:
        return build_input_sequence(ids_a, ids_b, num_rois, cls_id=self.cls_id, sep_id=self.sep_id,
                                    pad_id=self.pad_id)


def truncate_pair(a: list, b: list | None, max_tokens: int) -> tuple[list, list | None]:
    """Trim the longer of A and B from the end until both fit in `max_tokens` (BERT's rule)."""
    a = list(a)
    b = None if b is None else list(b)
    while len(a) + (len(b) if b is not None else 0) > max_tokens:
        if b is not None and len(b) > len(a):
            b.pop()
        else:
            a.pop()
    return a, b


def image_and_boxes(images: ImageLoader, path: Path, boxes_orig: np.ndarray, max_rois: int,
                     size_hint: tuple[int, int] | None, source: str):
    image, scale, orig_w, orig_h = images(path)
    if size_hint is not None and (size_hint[0] != orig_w or size_hint[1] != orig_h):
        raise ValueError(f"{source}: boxes are given for a {size_hint[0]}x{size_hint[1]} image but "
                         f"{path} is {orig_w}x{orig_h}")
    boxes = boxes_with_whole_image(scale_boxes(boxes_orig, scale), (image.shape[2], image.shape[1]),
                                   (orig_w, orig_h), max_rois)
    return image, torch.from_numpy(boxes)


class ConcatData:
    """Several datasets with the same collate, one after the other (RefCOCO+ gt + det tracks)."""

    def __init__(self, parts: Sequence):
        if not parts:
            raise ValueError("ConcatData needs at least one dataset")
        self.parts = list(parts)
        self.offsets = np.cumsum([0] + [len(p) for p in self.parts])

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def sample(self, i: int) -> dict:
        part = int(np.searchsorted(self.offsets, i, side="right")) - 1
        return self.parts[part].sample(i - int(self.offsets[part]))

    def collate(self, samples: list[dict]):
        return self.parts[0].collate(samples)


def iterate_batches(data, batch_size: int, *, shuffle: bool, generator: torch.Generator | None = None):
    """Yield (indices, batch, extras) over one pass of the data."""
    n = len(data)
    order = torch.randperm(n, generator=generator).tolist() if shuffle else list(range(n))
    for start in range(0, n, batch_size):
        indices = order[start:start + batch_size]
        batch, extras = data.collate([data.sample(i) for i in indices])
        yield indices, batch, extras
