"""Pieces shared by the task loaders: task image loading and RoI look-up.

Torch-free on purpose (the metric scripts import the task modules without torch).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
from PIL import Image

from vlbert_core.images import DEFAULT_MAX_PIXELS, check_resizable, load_rgb
from vlbert_core.models.common.batch import fit_image
from vlbert_core.utils import get_logger

log = get_logger(__name__)


def load_task_image(path: str | os.PathLike, max_side: int, min_side: int | None = None, *,
                    max_pixels: int = DEFAULT_MAX_PIXELS) -> tuple[Image.Image, tuple[float, float], tuple[int, int]]:
    """Open an image as RGB, resized as `model.batch.fit_image` says (`max_side`, and the released short side
    `min_side` if given). An image over `max_pixels` (the config's max_image_pixels) raises
    `vlbert_core.images.ImageTooLarge` from its header, before it is decoded; one whose shorter side the resize
    would make 0 pixels raises `ImageTooThin`.

    Returns the image, the factors (x, y) applied to it and the original (width, height); boxes given in
    original pixels must be multiplied by the same factors (`scale_boxes`).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"task image {path} does not exist")
    img = load_rgb(path, max_pixels=max_pixels)  # ImageTooLarge / ImageUnreadable name the file
    original = img.size
    check_resizable(str(path), *original, int(max_side), "the model's image_max_side")
    img, scale = fit_image(img, int(max_side), None if min_side is None else int(min_side))
    return img, scale, original


def scale_boxes(boxes: np.ndarray, scale: tuple[float, float]) -> np.ndarray:
    """Boxes (N x 4, x1,y1,x2,y2) in original pixels -> pixels of the resized image, scaled by (x, y)."""
    factors = np.array([scale[0], scale[1], scale[0], scale[1]], dtype=np.float32)
    return np.asarray(boxes, dtype=np.float32).reshape(-1, 4) * factors


def rois_for_key(records: dict, key: str, source: str | os.PathLike):
    """The usable record (from `vlbert_core.rois.read_rois`) of one image, or an error
    naming the RoI file, the key and the problem."""
    record = records.get(key)
    if record is None:
        raise KeyError(f"RoI parquet {source} has no row for image key {key!r}")
    if not record.ok:
        raise ValueError(f"RoI parquet {source}: image {key!r} has status {record.status!r} "
                         f"({record.error}); its detected RoIs are needed for this task")
    return record
