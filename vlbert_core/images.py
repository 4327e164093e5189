"""One pixel cap for every image the package opens (issue #36): `open_image` is the only place that calls
`PIL.Image.open`.

A PNG or JPEG of a few hundred kB can declare 12000 x 12000 pixels (a "decompression bomb"): decoding it
takes seconds and gigabytes. `open_image` reads the file's header only and refuses an image whose width x
height is over the cap with `ImageTooLarge`, before a single pixel is decoded. The cap is the config's
top-level `max_image_pixels` (MAX_PIXELS_KEY; default DEFAULT_MAX_PIXELS, Pillow's own default limit),
passed by every caller as an argument: predict (`Predictor`, the CLI's `--config`), the task datasets
(`ImageLoader`), RoI extraction and the detector's training images (`detector.images.decode_image`), the
CC resizer (`data.resizer.resize_image`, which records it as status `too_large`), the pre-training CC
samples (`pretrain.data.decode_cc_sample`) and the custom task's row check (`tasks.custom_rows`).

Pillow's own guard (`Image.MAX_IMAGE_PIXELS`: a DecompressionBombWarning above it, a DecompressionBombError
above twice it) is not what the user meets:
- `open_image` switches it off while it reads the header (under a lock, restored at once), so that the cap
  is checked first and its error, which names the file and this config key, is the one raised;
- a cap above Pillow's limit raises `Image.MAX_IMAGE_PIXELS` to the cap for the rest of the process, so that
  Pillow's later checks (while decoding GIF frames or TIFF tiles, on crops) let through what the cap allows.
  Pillow's limit is never lowered, and `Image.open` calls elsewhere keep it.

Other failures to read an image raise `ImageUnreadable` (`NotAnImage` when no format recognises the bytes),
naming the file as well. All three are ValueErrors.

`load_rgb` is the one decoder (issue #56): every place that reads an image's pixels (predict, the task datasets,
RoI extraction and the detector's training images through `detector.images.decode_image`, the pre-training CC
samples, the custom task's row check, `--draw`) gets the same upright 8-bit RGB image from it, and the CC resizer
(`data.resizer`) uses its pieces (`exif_orientation`, `to_rgb`) after its draft decode:
- the EXIF orientation is applied (`exif_orientation`: what `ImageOps.exif_transpose` does; an unreadable EXIF
  block keeps the stored pixels), so sizes and boxes are those of the upright image a viewer sees;
- every Pillow mode becomes 8-bit RGB with its real range (`to_rgb`): 16-bit greyscale (I;16, I;16L, I;16B,
  I;16N, and mode I holding 0..65535) scaled by 255/65535; mode I outside that range, and F, stretched over
  their own minimum..maximum (F within 0..1 scaled by 255); alpha (RGBA, LA, PA, RGBa, La, and palette images
  with a transparent colour) composited onto white, the CC resizer's choice since its first version; CMYK,
  YCbCr, LAB, HSV, L, 1 and P converted by Pillow;
- an animation (GIF, APNG, WebP, multi-page TIFF) gives its first frame, and the log says so;
- `check_resizable`: an image so thin that a resize to `max_side` pixels on its longer side would leave its
  shorter side 0 pixels is refused (`ImageTooThin`) naming it and its size.
A plain 8-bit RGB PNG or JPEG without EXIF decodes to the same pixels as `Image.convert("RGB")` gives it.
"""

from __future__ import annotations

import io
import os
import threading
from pathlib import Path

from PIL import ExifTags, Image, UnidentifiedImageError

from vlbert_core.utils import get_logger

log = get_logger(__name__)

DEFAULT_MAX_PIXELS = 89_478_485  # Pillow's own Image.MAX_IMAGE_PIXELS default (about 0.25 GB of RGBA)
MAX_PIXELS_KEY = "max_image_pixels"  # the config key of the cap (config/schema.yaml)

_PILLOW_LIMIT = threading.Lock()  # Image.MAX_IMAGE_PIXELS is process-wide: one header read at a time changes it


class ImageError(ValueError):
    """An image the pipeline will not use; the message names it (a file, a URL, a shard and sample)."""

    def __init__(self, message: str, name: str):
        super().__init__(message)
        self.name = name


class ImageTooLarge(ImageError):
    """An image whose header declares more pixels than the cap; refused before any pixel is decoded."""

    def __init__(self, name: str, width: int, height: int, max_pixels: int):
        super().__init__(
            f"image {name} is {width}x{height} = {width * height:,} pixels, over the cap of {max_pixels:,} "
            f"pixels (config key {MAX_PIXELS_KEY}): refused before decoding; raise {MAX_PIXELS_KEY} to use it",
            name)
        self.width, self.height, self.max_pixels = width, height, max_pixels


class ImageUnreadable(ImageError):
    """An image whose header or pixels cannot be read."""


class NotAnImage(ImageUnreadable):
    """Bytes that no image format recognises (an HTML page, an empty file, random bytes)."""


class ImageTooThin(ImageError):
    """An image whose shorter side would be 0 pixels once resized to the pipeline's size."""

    def __init__(self, name: str, width: int, height: int, max_side: int, what: str):
        short = min(width, height) * max_side // max(width, height)
        super().__init__(
            f"image {name} is {width}x{height} pixels: {what} resizes its longer side to {max_side} pixels, which "
            f"leaves its shorter side {short} pixels; an image must be at most {max_side}:1 (longer:shorter side)",
            name)
        self.width, self.height, self.max_side = width, height, max_side


# EXIF orientation -> the transpose that makes the stored pixels upright (what ImageOps.exif_transpose does)
EXIF_TRANSPOSE = {
    2: Image.Transpose.FLIP_LEFT_RIGHT,
    3: Image.Transpose.ROTATE_180,
    4: Image.Transpose.FLIP_TOP_BOTTOM,
    5: Image.Transpose.TRANSPOSE,
    6: Image.Transpose.ROTATE_270,
    7: Image.Transpose.TRANSVERSE,
    8: Image.Transpose.ROTATE_90,
}
TURNS_SIDEWAYS = frozenset({5, 6, 7, 8})  # orientations whose upright image swaps width and height
ALPHA_BACKGROUND = (255, 255, 255)  # what transparent pixels become (the CC resizer's white, since its first version)
_ALPHA_MODES = ("RGBA", "LA", "PA", "RGBa", "La")
_SIXTEEN_BIT_MODES = ("I;16", "I;16L", "I;16B", "I;16N")


def exif_orientation(image: Image.Image) -> int:
    """The EXIF orientation of an opened image (1 = stored upright), read from its header; 1 when the EXIF cannot
    be read: the pixels are fine then, and are kept as stored."""
    try:
        orientation = image.getexif().get(ExifTags.Base.Orientation, 1)
        return orientation if orientation in EXIF_TRANSPOSE else 1
    except (OSError, ValueError, KeyError, TypeError, SyntaxError, AttributeError):
        return 1


def upright_size(image: Image.Image) -> tuple[int, int]:
    """(width, height) of an opened image once its EXIF orientation is applied, from its header."""
    width, height = image.size
    return (height, width) if exif_orientation(image) in TURNS_SIDEWAYS else (width, height)


def _stretched(image: Image.Image, low: float, high: float) -> Image.Image:
    """A one-band image of any depth mapped linearly from low..high onto 0..255 (mode L), rounded to the nearest
    level (Pillow's F -> L conversion truncates, hence the half added)."""
    scale = 255.0 / (high - low) if high > low else 0.0
    return image.convert("F").point(lambda value: (value - low) * scale + 0.5).convert("L")


def to_rgb(image: Image.Image) -> Image.Image:
    """A decoded image of any Pillow mode as 8-bit RGB with its real range (module docstring): 16-bit scaled by
    255/65535, alpha composited onto ALPHA_BACKGROUND, the rest converted by Pillow. An RGB image is returned as
    it is."""
    if image.mode == "RGB":
        return image
    if image.mode == "P" and "transparency" in image.info:
        image = image.convert("RGBA")
    if image.mode in _ALPHA_MODES:
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, ALPHA_BACKGROUND + (255,))
        return Image.alpha_composite(background, rgba).convert("RGB")
    if image.mode in _SIXTEEN_BIT_MODES:
        return _stretched(image, 0.0, 65535.0).convert("RGB")
    if image.mode in ("I", "F"):
        low, high = image.getextrema()
        if image.mode == "I" and low >= 0 and high <= 65535:
            low, high = 0.0, 65535.0   # 16-bit samples (Pillow opens some 16-bit files as I)
        elif image.mode == "F" and low >= 0 and high <= 1:
            low, high = 0.0, 1.0
        return _stretched(image, float(low), float(high)).convert("RGB")
    return image.convert("RGB")


def check_resizable(name: str, width: int, height: int, max_side: int, what: str = "the model") -> None:
    """ImageTooThin when resizing the image's longer side to `max_side` pixels leaves its shorter side 0 pixels
    (`what`: who resizes it, for the message)."""
    if min(width, height) * int(max_side) < max(width, height):
        raise ImageTooThin(name, width, height, int(max_side), what)


def checked_max_pixels(max_pixels) -> int:
    """The cap as a positive int, or a ValueError naming the config key."""
    if isinstance(max_pixels, bool) or not isinstance(max_pixels, int) or max_pixels < 1:
        raise ValueError(f"config {MAX_PIXELS_KEY} must be a positive integer, got {max_pixels!r}")
    return max_pixels


def _name_of(source, name: str | None) -> str:
    if name is not None:
        return name
    if isinstance(source, (bytes, bytearray, memoryview)):
        return f"({len(source)} bytes)"
    return str(source)


def open_image(source: str | os.PathLike | bytes, *, max_pixels: int, name: str | None = None) -> Image.Image:
    """Open an image file (a path) or encoded image bytes, lazily as Pillow does, after checking its size.

    Reads the header only: raises ImageTooLarge when width x height > max_pixels, NotAnImage when no
    format recognises it, ImageUnreadable when its header cannot be read or it has no pixels (and
    FileNotFoundError for a missing file). Nothing is decoded: call `load()` / `convert()` on the result,
    preferably in a `with` block, or `load_rgb`. `name` is what errors call the image (default: the path,
    or the byte count of bytes).
    """
    max_pixels = checked_max_pixels(max_pixels)
    name = _name_of(source, name)
    if isinstance(source, (bytes, bytearray, memoryview)):
        if not len(source):
            raise NotAnImage(f"image {name} cannot be decoded: it is empty (no bytes)", name)
        fp = io.BytesIO(source)
    else:
        path = Path(source)
        if not path.exists():
            raise FileNotFoundError(f"image {name} does not exist")
        if not path.is_file():
            raise ImageUnreadable(f"image {name} is not a file", name)
        fp = path
    with _PILLOW_LIMIT:
        pillow_limit = Image.MAX_IMAGE_PIXELS
        Image.MAX_IMAGE_PIXELS = None  # the cap below is checked instead, with its own error
        try:
            image = Image.open(fp)
        except UnidentifiedImageError:
            if isinstance(fp, Path):
                with fp.open("rb") as f:
                    head = f.read(40)
            else:
                head = bytes(source[:40])
            preview = head.decode("latin-1").replace("\n", " ")
            raise NotAnImage(f"image {name} cannot be decoded: not in an image format Pillow reads (it starts with "
                             f"{preview!r})", name) from None
        except Exception as err:  # Pillow's plugins raise many types (struct.error, IndexError...) on junk
            raise ImageUnreadable(f"image {name} cannot be decoded: its header does not read: {type(err).__name__}: "
                                  f"{err}", name) from None
        finally:
            if pillow_limit is not None and max_pixels > pillow_limit:
                pillow_limit = max_pixels  # Pillow's later checks must let through what the cap allows
            Image.MAX_IMAGE_PIXELS = pillow_limit
    width, height = image.size
    if width * height > max_pixels:
        image.close()
        raise ImageTooLarge(name, width, height, max_pixels)
    if width < 1 or height < 1:
        image.close()
        raise ImageUnreadable(f"image {name} cannot be decoded: it has no pixels ({width}x{height})", name)
    return image


def load_rgb(source: str | os.PathLike | bytes, *, max_pixels: int, name: str | None = None) -> Image.Image:
    """The image fully decoded as upright 8-bit RGB (module docstring): `open_image` (the cap, from the header),
    the decode, whose failures (a truncated or corrupt file) raise ImageUnreadable naming the image, the first
    frame of an animation (logged), the EXIF orientation and `to_rgb`."""
    name = _name_of(source, name)
    with open_image(source, max_pixels=max_pixels, name=name) as image:
        try:
            frames = int(getattr(image, "n_frames", 1) or 1) if getattr(image, "is_animated", False) else 1
            if frames > 1:
                image.seek(0)
                log.info("image %s has %d frames (an animation): its first frame is used", name, frames)
            image.load()  # decodes every pixel, so a truncated file fails here
            orientation = exif_orientation(image)
            upright = image.transpose(EXIF_TRANSPOSE[orientation]) if orientation != 1 else image
            rgb = to_rgb(upright)
            return rgb.copy() if rgb is image else rgb  # a copy: the file closes with the `with`
        except Exception as err:  # the decoders raise arbitrary types on corrupt data
            raise ImageUnreadable(f"image {name} cannot be decoded: {type(err).__name__}: {err}", name) from None
