"""Decode downloaded bytes into an upright RGB image, resize it, and re-encode it as JPEG.

Sizes reported as "original" are those of the upright image (after the EXIF orientation is
applied), i.e. what a viewer of the source image sees; boxes computed on the stored JPEG scale
back to it by width/original_width.
"""

from __future__ import annotations

import io
from typing import NamedTuple

from PIL import Image, ImageOps, UnidentifiedImageError

from vlbert_core.data import status as st

MODES = ("keep_ratio", "center_crop")
DEFAULT_MAX_PIXELS = 89_478_485  # Pillow's own Image.MAX_IMAGE_PIXELS default (about 0.25 GB of RGBA)
DEFAULT_JPEG_QUALITY = 95
_WHITE = (255, 255, 255)


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


def _to_rgb(image: Image.Image) -> Image.Image:
    """RGB without surprises: alpha is composited onto white (not dropped to black)."""
    if image.mode == "P" and "transparency" in image.info:
        image = image.convert("RGBA")
    if image.mode in ("RGBA", "LA", "PA", "RGBa", "La"):
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, _WHITE + (255,))
        return Image.alpha_composite(background, rgba).convert("RGB")
    if image.mode in ("I", "I;16", "I;16B", "I;16L", "F"):
        # High bit-depth greyscale: scale to 8 bits instead of clipping everything above 255 to white.
        image = image.convert("F")
        low, high = image.getextrema()
        scale = 255.0 / (high - low) if high > low else 0.0
        image = image.point(lambda value: (value - low) * scale).convert("L")
    return image.convert("RGB") if image.mode != "RGB" else image


def _fit(image: Image.Image, max_side: int, mode: str) -> Image.Image:
    width, height = image.size
    if mode == "center_crop":
        side = min(width, height)
        left, top = (width - side) // 2, (height - side) // 2
        image = image.crop((left, top, left + side, top + side))
        width = height = side
    longest = max(width, height)
    if longest <= max_side:  # never upscale
        return image
    scale = max_side / longest
    size = (max(1, round(width * scale)), max(1, round(height * scale)))
    return image.resize(size, Image.Resampling.LANCZOS, reducing_gap=3.0)


def resize_image(
    data: bytes,
    max_side: int,
    mode: str = "keep_ratio",
    *,
    max_pixels: int = DEFAULT_MAX_PIXELS,
    quality: int = DEFAULT_JPEG_QUALITY,
) -> ResizedImage:
    """Decode `data`, make it upright RGB, fit it to `max_side` and return it as JPEG bytes.

    mode: keep_ratio fits the longer side to max_side; center_crop takes the central square
    first. Neither upscales. Raises ImageRejected (status not_an_image, decode_error or
    too_large) for bytes that cannot become a sample; images over max_pixels are refused from
    their header, before any pixel is decoded.
    """
    if mode not in MODES:
        raise ValueError(f"resize mode must be one of {MODES}, got {mode!r}")
    if max_side < 1:
        raise ValueError(f"resize max_side must be >= 1, got {max_side}")
    if not data:
        raise ImageRejected(st.NOT_AN_IMAGE, "empty body")
    try:
        # Pillow itself warns above Image.MAX_IMAGE_PIXELS and raises above twice that; such an
        # image is over our cap too (unless max_pixels is raised past Pillow's) and is refused below.
        image = Image.open(io.BytesIO(data))
    except UnidentifiedImageError:
        preview = data[:40].decode("latin-1").replace("\n", " ")
        raise ImageRejected(st.NOT_AN_IMAGE, f"not a recognised image format (starts with {preview!r})") from None
    except Image.DecompressionBombError as err:
        raise ImageRejected(st.TOO_LARGE, f"decompression bomb: {err}") from None
    except Exception as err:  # Pillow's format plugins raise many types (struct.error, IndexError...) on junk
        raise ImageRejected(st.DECODE_ERROR, f"cannot read image header: {type(err).__name__}: {err}") from None
    with image:
        width, height = image.size
        if width < 1 or height < 1:
            raise ImageRejected(st.DECODE_ERROR, f"image has no pixels ({width}x{height})")
        if width * height > max_pixels:
            raise ImageRejected(
                st.TOO_LARGE, f"decompression bomb guard: {width}x{height} = {width * height} pixels > {max_pixels}"
            )
        try:
            # With Pillow's default LOAD_TRUNCATED_IMAGES=False a truncated file fails here
            # instead of coming out grey at the bottom.
            image.load()
        except Image.DecompressionBombError as err:
            raise ImageRejected(st.TOO_LARGE, f"decompression bomb: {err}") from None
        except Exception as err:  # corrupt data surfaces as arbitrary exception types from the decoders
            raise ImageRejected(
                st.DECODE_ERROR, f"cannot decode {image.format} image: {type(err).__name__}: {err}"
            ) from None
        try:
            upright = ImageOps.exif_transpose(image)
        except (OSError, ValueError, KeyError, TypeError, SyntaxError):
            upright = image  # unreadable EXIF: the pixels are fine, keep them as stored
        original_width, original_height = upright.size
        try:
            rgb = _to_rgb(upright)
        except (ValueError, OSError) as err:
            raise ImageRejected(st.DECODE_ERROR, f"cannot convert {upright.mode} image to RGB: {err}") from None
        resized = _fit(rgb, max_side, mode)
    buffer = io.BytesIO()
    resized.save(buffer, format="JPEG", quality=quality)
    return ResizedImage(buffer.getvalue(), resized.width, resized.height, original_width, original_height)
