"""Image files into the tensors the detector reads: decoded RGB uint8, then float in [0, 1]."""

from __future__ import annotations

import io
import os

import numpy as np
import torch
from PIL import Image


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
