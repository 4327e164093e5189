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
"""

from __future__ import annotations

import io
import os
import threading
from pathlib import Path

from PIL import Image, UnidentifiedImageError

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
    """The image fully decoded as RGB: `open_image` (the cap, from the header), then the decode, whose
    failures (a truncated or corrupt file) raise ImageUnreadable naming the image."""
    name = _name_of(source, name)
    with open_image(source, max_pixels=max_pixels, name=name) as image:
        try:
            return image.convert("RGB")  # convert() decodes every pixel, so a truncated file fails here
        except Exception as err:  # the decoders raise arbitrary types on corrupt data
            raise ImageUnreadable(f"image {name} cannot be decoded: {type(err).__name__}: {err}", name) from None
