"""The row checks of a `tasks.custom.<name>` entry (rule `custom_rows`): read its train and val
files, resolve and check each image (URLs through the project's downloader), check each label, and
write every row with its status (`tasks/custom.py` lists the statuses).

Kept out of `tasks/custom.py`, which every job imports through the task registry, so that the
downloader is part of the code fingerprint of the custom_rows jobs only.
"""

from __future__ import annotations

import csv
import hashlib
import json
import os
import urllib.parse
from pathlib import Path
from typing import Any, Mapping, Sequence

from vlbert_core.data import make_downloader
from vlbert_core.data import status as download_status
from vlbert_core.images import DEFAULT_MAX_PIXELS, ImageError, checked_max_pixels, load_rgb
from vlbert_core.utils import atomic_path, get_logger, read_jsonl

from .custom import (BAD_ROW, FIELDS, MISSING_IMAGE, OK, UNKNOWN_LABEL, UNREADABLE_IMAGE, URL_SCHEMES, CustomSpec,
                     status_counts)

log = get_logger(__name__)


# ---- reading the user's files --------------------------------------------------------------------

def read_data_file(path: str | os.PathLike) -> list[dict]:
    """The rows of a .jsonl or .csv file, each with its 1-based `line` (JSONL line or CSV record)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"custom task data file {path} does not exist")
    suffix = path.suffix.lower()
    rows: list[dict] = []
    if suffix == ".jsonl":
        rows = read_jsonl(path, line_field="line")
    elif suffix == ".csv":
        with path.open(encoding="utf-8", newline="") as f:
            reader = csv.DictReader(f)
            missing = [name for name in FIELDS if name not in (reader.fieldnames or [])]
            if missing:
                raise ValueError(f"{path}: the CSV header {reader.fieldnames} lacks the columns {missing}")
            for number, record in enumerate(reader, start=2):  # line 1 is the header
                rows.append({**record, "line": number})
    else:
        raise ValueError(f"custom task data file {path}: expected a .jsonl or .csv file")
    if not rows:
        raise ValueError(f"custom task data file {path} has no rows")
    return rows


def _is_url(image: str) -> bool:
    return urllib.parse.urlsplit(image).scheme.lower() in URL_SCHEMES


def _decodable(path: Path, max_pixels: int) -> str:
    """'' when the file decodes as an image of at most `max_pixels` pixels, else why not (an image over the cap
    is refused from its header, before it is decoded)."""
    try:
        load_rgb(path, max_pixels=max_pixels)
    except ImageError as err:  # the message names the file
        return str(err)
    except OSError as err:
        return f"cannot decode {path}: {err}"
    return ""


class _ImageResolver:
    """Local image paths of the rows: paths as they are, URLs fetched once into `download_dir`."""

    def __init__(self, download_dir: Path, download: Mapping[str, Any], download_key: str,
                 max_pixels: int = DEFAULT_MAX_PIXELS):
        self.download_dir = download_dir
        self.max_pixels = checked_max_pixels(max_pixels)
        self.download = dict(download)
        self.download_key = download_key  # the config key of `download`, named by its errors
        self._downloader = None
        self._fetched: dict[str, tuple[str | None, str, str]] = {}

    def resolve(self, image: str, base: Path) -> tuple[str | None, str, str]:
        """(local path or None, status, reason)."""
        if _is_url(image):
            if image not in self._fetched:
                self._fetched[image] = self._fetch(image)
            local, status, reason = self._fetched[image]
            if status != OK:
                return local, status, reason
            path = Path(local)
        else:
            path = Path(image) if Path(image).is_absolute() else base / image
            if not path.is_file():
                return None, MISSING_IMAGE, f"no such file: {path}"
        reason = _decodable(path, self.max_pixels)
        return (str(path), OK, "") if not reason else (str(path), UNREADABLE_IMAGE, reason)

    def _fetch(self, url: str) -> tuple[str | None, str, str]:
        if self._downloader is None:
            self._downloader = make_downloader(self.download, self.download_key)
        result = self._downloader.fetch(url)
        if result.data is None:
            kind = MISSING_IMAGE if result.status == download_status.NOT_FOUND else UNREADABLE_IMAGE
            return None, kind, f"download {result.status}: {result.error}"
        suffix = Path(urllib.parse.urlsplit(url).path).suffix.lower()
        name = hashlib.sha1(url.encode("utf-8")).hexdigest()[:20] + (suffix if suffix.isascii() and len(suffix) <= 5 else "")
        target = self.download_dir / name
        with atomic_path(target) as tmp:
            tmp.write_bytes(result.data)
        return str(target), OK, ""

    def close(self) -> None:
        if self._downloader is not None:
            self._downloader.close()


def _check_split(spec: CustomSpec, split: str, resolver: _ImageResolver, labels: Sequence[str] | None) -> list[dict]:
    """Every row of the split with its status; `labels` None: every label is known (the train split
    when the entry gives no label list, which then takes its labels from the ok train rows)."""
    data_file = Path(spec.data_file(split))
    checked = []
    for row in read_data_file(data_file):
        out = {"id": f"{split}-{row['line']:07d}", "line": row["line"], "image": row.get("image"),
               "text": row.get("text"), "label": row.get("label"), "path": None, "status": OK, "reason": ""}
        lacking = [name for name in FIELDS if row.get(name) in (None, "")]
        if lacking:
            out.update(status=BAD_ROW, reason=f"lacks {lacking}")
        elif not isinstance(row["text"], str) or not row["text"].strip():
            out.update(status=BAD_ROW, reason="text is not a non-empty string")
        else:
            out["label"] = str(row["label"])
            path, status, reason = resolver.resolve(str(row["image"]), data_file.parent)
            out.update(path=path, status=status, reason=reason)
            if status == OK and labels is not None and out["label"] not in labels:
                out.update(status=UNKNOWN_LABEL, reason=f"label {out['label']!r} is not one of {list(labels)}")
        checked.append(out)
    return checked


def check_rows(spec: CustomSpec, out_dir: str | os.PathLike | None = None, *,
               max_image_pixels: int = DEFAULT_MAX_PIXELS) -> dict[str, Any]:
    """Check both splits, write `<split>.rows.jsonl` and `labels.json` into `out_dir` (default
    results/custom/<name>) and return the summary (labels, status counts per split).

    Downloaded images go to `<out_dir>/images/`. Raises when a split has no usable row. An image over
    `max_image_pixels` (the config's top-level key) makes its row unreadable_image, with the reason.
    """
    out_dir = Path(out_dir or spec.results_dir)
    resolver = _ImageResolver(out_dir / "images", spec.download, spec.download_key, max_image_pixels)
    try:
        train = _check_split(spec, "train", resolver, spec.labels)
        labels = list(spec.labels) if spec.labels else list(dict.fromkeys(r["label"] for r in train if r["status"] == OK))
        val = _check_split(spec, "val", resolver, labels)
    finally:
        resolver.close()
    summary: dict[str, Any] = {"name": spec.name, "labels": labels, "counts": {}, "files": {}}
    for split, rows in (("train", train), ("val", val)):
        counts = status_counts(rows)
        summary["counts"][split] = counts
        summary["files"][split] = spec.data_file(split)
        skipped = {s: n for s, n in counts.items() if s != OK}
        log.info("custom task %s, %s (%s): %d rows, %d ok, skipped %s", spec.name, split, spec.data_file(split),
                 len(rows), counts.get(OK, 0), skipped or "none")
        for row in rows:
            if row["status"] != OK:
                log.warning("  %s line %d: %s (%s)", spec.data_file(split), row["line"], row["status"], row["reason"])
        if not counts.get(OK):
            raise ValueError(f"custom task {spec.name}: the {split} file {spec.data_file(split)} has no usable row "
                             f"after the checks ({counts}); see the reasons above")
    if len(labels) < 2:
        raise ValueError(f"custom task {spec.name}: the train split has {len(labels)} label(s) {labels}; a "
                         "classifier needs at least two (give `labels:` or more varied rows)")
    for split, rows in (("train", train), ("val", val)):
        with atomic_path(out_dir / f"{split}.rows.jsonl") as tmp:
            tmp.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    with atomic_path(out_dir / "labels.json") as tmp:
        tmp.write_text(json.dumps(summary, indent=1) + "\n", encoding="utf-8")
    return summary
