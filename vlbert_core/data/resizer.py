"""Decode downloaded bytes into an upright RGB image, resize it, and re-encode it as JPEG.

Sizes reported as "original" are those of the upright image (after the EXIF orientation is
applied), i.e. what a viewer of the source image sees; boxes computed on the stored JPEG scale
back to it by width/original_width. The orientation and the conversion of every Pillow mode to
8-bit RGB (alpha onto white, 16-bit scaled) are the one decoder's (vlbert_core/images.py).

A JPEG much larger than the output is decoded at a reduced scale (libjpeg's DCT scaling, through
Pillow's draft mode) and then resampled, never below the output size; the pixel cap is checked on
the header's full size before any decoding.
"""

from __future__ import annotations

import io
import math
from typing import NamedTuple

from PIL import Image

from vlbert_core.data import status as st
from vlbert_core.images import (DEFAULT_MAX_PIXELS, EXIF_TRANSPOSE, TURNS_SIDEWAYS, ImageTooLarge, ImageUnreadable,
                                NotAnImage, exif_orientation, open_image, to_rgb)

MODES = ("keep_ratio", "center_crop")
DEFAULT_JPEG_QUALITY = 95
# Pillow's antialiased bilinear (a triangle filter widened by the scale factor, like torchvision's
# Resize(antialias=True)). After the JPEG draft decode the remaining shrink is below 2x, where it
# stays within about 1 grey level (mean absolute difference) of a full-resolution LANCZOS resize,
# at less than half of LANCZOS's cost, which was most of the per-image CPU time.
RESAMPLING = Image.Resampling.BILINEAR


class ImageRejected(Exception):
    """The bytes cannot become a sample; `status` is one of status.py's failure kinds."""

    def __init__(self, status: str, message: str):
        super().__init__(message)
        self.status = status


class ResizedImage(NamedTuple):
    jpeg: bytes
    width: int
    height: int
    original_width: int
    original_height: int


def _downscale_factor(width: int, height: int, max_side: int, mode: str) -> float:
    """Output size / input size (1.0: no resize). The same for both axes and for either orientation,
    since keep_ratio scales by the longest side and center_crop by the shorter one."""
    kept_side = min(width, height) if mode == "center_crop" else max(width, height)
    return min(1.0, max_side / kept_side)


def _plan(width: int, height: int, max_side: int, mode: str) -> tuple[tuple[int, int, int, int], tuple[int, int]]:
    """The box of the upright full-resolution image to keep, and the size to give it (never larger)."""
    if mode == "center_crop":
        side = min(width, height)
        left, top = (width - side) // 2, (height - side) // 2
        box = (left, top, left + side, top + side)
    else:
        box = (0, 0, width, height)
    box_width, box_height = box[2] - box[0], box[3] - box[1]
    longest = max(box_width, box_height)
    if longest <= max_side:  # never upscale
        return box, (box_width, box_height)
    scale = max_side / longest
    return box, (max(1, round(box_width * scale)), max(1, round(box_height * scale)))


def resize_image(
    data: bytes,
    max_side: int,
    mode: str = "keep_ratio",
    *,
    max_pixels: int = DEFAULT_MAX_PIXELS,
    quality: int = DEFAULT_JPEG_QUALITY,
    name: str | None = None,
) -> ResizedImage:
    """Decode `data`, make it upright RGB, fit it to `max_side` and return it as JPEG bytes.

    mode: keep_ratio fits the longer side to max_side; center_crop takes the central square
    first. Neither upscales. Raises ImageRejected (status not_an_image, decode_error or
    too_large) for bytes that cannot become a sample; images over max_pixels (the config's
    max_image_pixels) are refused from their header, before any pixel is decoded
    (vlbert_core.images.open_image). `name` is what the messages call the image (its URL;
    default: its byte count).
    """
    if mode not in MODES:
        raise ValueError(f"resize mode must be one of {MODES}, got {mode!r}")
    if max_side < 1:
        raise ValueError(f"resize max_side must be >= 1, got {max_side}")
    try:
        image = open_image(data, max_pixels=max_pixels, name=name)  # the cap, from the header only
    except ImageTooLarge as err:
        raise ImageRejected(st.TOO_LARGE, str(err)) from None
    except NotAnImage as err:
        raise ImageRejected(st.NOT_AN_IMAGE, str(err)) from None
    except ImageUnreadable as err:
        raise ImageRejected(st.DECODE_ERROR, str(err)) from None
    with image:
        width, height = image.size
        # A JPEG much larger than the output is decoded at 1/2, 1/4 or 1/8 scale by libjpeg (DCT
        # scaling), which is several times cheaper than decoding every pixel and resampling them
        # all. draft() picks the largest reduction that stays >= the requested size in both axes,
        # and the request is >= the output size, so the final resampling still only shrinks.
        # Other formats ignore draft(). draft_scale maps full-resolution pixels to decoded ones.
        factor = _downscale_factor(width, height, max_side, mode)
        draft_scale = 1.0
        if factor < 1.0:
            drafted = image.draft("RGB", (math.ceil(width * factor), math.ceil(height * factor)))
            if drafted is not None:
                draft_scale = width / drafted[1][2]
        try:
            # With Pillow's default LOAD_TRUNCATED_IMAGES=False a truncated file fails here
            # instead of coming out grey at the bottom.
            image.load()
        except Image.DecompressionBombError as err:  # a GIF frame or TIFF tile larger than the header says
            raise ImageRejected(st.TOO_LARGE, f"image {name or '(downloaded bytes)'}: {err}") from None
        except Exception as err:  # corrupt data surfaces as arbitrary exception types from the decoders
            raise ImageRejected(
                st.DECODE_ERROR,
                f"image {name or '(downloaded bytes)'} cannot be decoded: {image.format}: {type(err).__name__}: {err}",
            ) from None
        # What ImageOps.exif_transpose does, without the full copy it makes of an image that needs no turn
        # (vlbert_core.images: the one decoder's orientation and modes).
        orientation = exif_orientation(image)
        upright = image.transpose(EXIF_TRANSPOSE[orientation]) if orientation != 1 else image
        # The original size is the full-resolution upright one, whatever scale was decoded.
        sideways = orientation in TURNS_SIDEWAYS
        original_width, original_height = (height, width) if sideways else (width, height)
        try:
            rgb = to_rgb(upright)
        except (ValueError, OSError) as err:
            raise ImageRejected(st.DECODE_ERROR, f"cannot convert {upright.mode} image to RGB: {err}") from None
        box, size = _plan(original_width, original_height, max_side, mode)
        decoded_box = tuple(edge / draft_scale for edge in box)
        if size == rgb.size and decoded_box == (0, 0) + rgb.size:
            resized = rgb  # already the right size: nothing to resample
        elif draft_scale == 1.0 and size == (box[2] - box[0], box[3] - box[1]):
            resized = rgb.crop(box)  # center_crop of an image no larger than max_side
        else:
            resized = rgb.resize(size, RESAMPLING, box=decoded_box, reducing_gap=3.0)
    buffer = io.BytesIO()
    resized.save(buffer, format="JPEG", quality=quality)
    return ResizedImage(buffer.getvalue(), resized.width, resized.height, original_width, original_height)
