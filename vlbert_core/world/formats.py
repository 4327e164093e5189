"""Writers for the official file formats the world imitates. Every write is atomic and byte-stable.

Byte stability: JSON keys are sorted, no field carries the wall-clock time, the JPEG encoder runs
with fixed settings, and bz2 output depends only on its input.
"""

from __future__ import annotations

import bz2
import hashlib
import json
import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable
from xml.sax.saxutils import escape, quoteattr

from PIL import Image

from ..utils import atomic_path
from .scene import Scene, SceneObject, object_polygon, polygon_area
from .vocabulary import CATEGORY_BY_NAME, VCR_OBJECT_NAME, coco_attributes, coco_categories

MEDIAWIKI_XMLNS = "http://www.mediawiki.org/xml/export-0.10/"
# Namespaces of an English Wikipedia dump that the synthetic dump uses.
WIKI_NAMESPACES = {0: "", 4: "Wikipedia", 6: "File", 10: "Template", 14: "Category"}
# Revisions carry a fixed date: a dump needs one, and the generation time would break determinism.
WIKI_REVISION_TIME = "2020-01-01T00:00:00Z"


def save_jpeg(image: Image.Image, path: Path, quality: int) -> None:
    with atomic_path(path) as tmp:
        image.save(tmp, format="JPEG", quality=quality, optimize=False, progressive=False, subsampling=2)


def write_lines(path: Path, lines: Iterable[str]) -> int:
    """One line per item; refuses items that would break the one-record-per-line format."""
    count = 0
    with atomic_path(path) as tmp, open(tmp, "w", encoding="utf-8", newline="\n") as f:
        for line in lines:
            if "\n" in line or "\r" in line:
                raise ValueError(f"{path}: line {count + 1} contains a line break: {line!r}")
            f.write(line + "\n")
            count += 1
    return count


# The published BooksCorpus archive (bookcorpus.tar.bz2) holds the corpus as two plain-text members.
BOOKS_ARCHIVE_MEMBERS = ("books_large_p1.txt", "books_large_p2.txt")


def write_books(path: Path, lines: list[str]) -> int:
    """BooksCorpus, one sentence a line: a plain-text file, or for a path ending in .tar.bz2 the
    published archive's layout, the lines split in order over its two members."""
    if not path.name.endswith(".tar.bz2"):
        return write_lines(path, lines)
    import io
    import tarfile

    half = (len(lines) + 1) // 2
    with atomic_path(path) as tmp:
        with tarfile.open(tmp, "w:bz2", format=tarfile.PAX_FORMAT) as tar:
            for name, part in zip(BOOKS_ARCHIVE_MEMBERS, (lines[:half], lines[half:])):
                for line in part:
                    if "\n" in line or "\r" in line:
                        raise ValueError(f"{path}: a BooksCorpus line contains a line break: {line!r}")
                data = "".join(line + "\n" for line in part).encode("utf-8")
                info = tarfile.TarInfo(name)
                info.size, info.mtime, info.mode = len(data), 0, 0o644  # no wall-clock time: byte-stable
                tar.addfile(info, io.BytesIO(data))
    return len(lines)


def write_cc_tsv(path: Path, rows: Iterable[tuple[str, str]]) -> int:
    """Conceptual Captions layout: `caption<TAB>url`, no header."""
    lines = []
    for n, (caption, url) in enumerate(rows, start=1):
        if "\t" in caption or "\t" in url:
            raise ValueError(f"{path}: row {n} has a TAB inside a field: {caption!r} / {url!r}")
        lines.append(f"{caption}\t{url}")
    return write_lines(path, lines)


def dumps_json(obj, indent: int | None = None) -> str:
    separators = (",", ": ") if indent else (",", ":")
    return json.dumps(obj, sort_keys=True, indent=indent, separators=separators, ensure_ascii=True)


def write_json(path: Path, obj, indent: int | None = None) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(dumps_json(obj, indent) + ("\n" if indent else ""), encoding="utf-8")


def write_jsonl(path: Path, rows: Iterable[dict]) -> int:
    return write_lines(path, (dumps_json(row) for row in rows))


def write_pickle(path: Path, obj, protocol: int = 2) -> None:
    """Protocol 2, as the published refs(unc).p (written by Python 2)."""
    with atomic_path(path) as tmp:
        tmp.write_bytes(pickle.dumps(obj, protocol=protocol))


# ---------------------------------------------------------------- MediaWiki

@dataclass(frozen=True)
class WikiPage:
    page_id: int
    title: str
    ns: int
    text: str
    redirect: str | None = None


def _wiki_sha1(text: str) -> str:
    """MediaWiki's revision sha1: the SHA-1 of the text written in base 36, padded to 31 digits."""
    n = int(hashlib.sha1(text.encode("utf-8")).hexdigest(), 16)
    digits = "0123456789abcdefghijklmnopqrstuvwxyz"
    out = ""
    while n:
        n, r = divmod(n, 36)
        out = digits[r] + out
    return out.rjust(31, "0")


def wiki_dump_xml(pages: list[WikiPage], sitename: str = "Wikipedia", dbname: str = "enwiki") -> str:
    """A pages-articles export (schema 0.10): siteinfo, then one <page> per page with one revision."""
    out = [
        f'<mediawiki xmlns="{MEDIAWIKI_XMLNS}" xmlns:xsi="http://www.w3.org/2001/XMLSchema-instance" '
        f'xsi:schemaLocation="{MEDIAWIKI_XMLNS} http://www.mediawiki.org/xml/export-0.10.xsd" '
        'version="0.10" xml:lang="en">',
        "  <siteinfo>",
        f"    <sitename>{escape(sitename)}</sitename>",
        f"    <dbname>{escape(dbname)}</dbname>",
        "    <base>https://en.wikipedia.org/wiki/Main_Page</base>",
        "    <generator>MediaWiki 1.35.0-wmf.1</generator>",
        "    <case>first-letter</case>",
        "    <namespaces>",
    ]
    for key, name in WIKI_NAMESPACES.items():
        out.append(f'      <namespace key="{key}" case="first-letter" />' if not name else
                   f'      <namespace key="{key}" case="first-letter">{escape(name)}</namespace>')
    out += ["    </namespaces>", "  </siteinfo>"]
    for page in pages:
        if page.ns not in WIKI_NAMESPACES:
            raise ValueError(f"wiki page {page.title!r}: namespace {page.ns} is not declared in the siteinfo")
        data = page.text.encode("utf-8")
        out += ["  <page>", f"    <title>{escape(page.title)}</title>", f"    <ns>{page.ns}</ns>",
                f"    <id>{page.page_id}</id>"]
        if page.redirect is not None:
            out.append(f"    <redirect title={quoteattr(page.redirect)} />")
        out += [
            "    <revision>",
            f"      <id>{1_000_000 + page.page_id}</id>",
            f"      <timestamp>{WIKI_REVISION_TIME}</timestamp>",
            "      <contributor>",
            "        <username>WorldBuilder</username>",
            "        <id>1</id>",
            "      </contributor>",
            "      <model>wikitext</model>",
            "      <format>text/x-wiki</format>",
            f'      <text bytes="{len(data)}" xml:space="preserve">{escape(page.text)}</text>',
            f"      <sha1>{_wiki_sha1(page.text)}</sha1>",
            "    </revision>",
            "  </page>",
        ]
    out.append("</mediawiki>")
    return "\n".join(out) + "\n"


def write_wiki_dump(path: Path, pages: list[WikiPage]) -> None:
    ids = [p.page_id for p in pages]
    if len(set(ids)) != len(ids):
        raise ValueError(f"{path}: duplicate wiki page ids")
    data = bz2.compress(wiki_dump_xml(pages).encode("utf-8"), compresslevel=9)
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)


# ---------------------------------------------------------------- COCO / VCR records

def coco_annotation(ann_id: int, image_id: int, obj: SceneObject, with_attributes: bool = False) -> dict:
    """One COCO instance: bbox is [x, y, w, h] in pixels, segmentation a flattened polygon. With
    attributes (the detector's files), also `attributes`: the object's attribute names, as Visual
    Genome lists them per object (colour, then size class)."""
    polygon = object_polygon(obj)
    x1, y1, x2, y2 = obj.box
    extra = {"attributes": [obj.colour, obj.size]} if with_attributes else {}
    return {**extra,
        "id": ann_id,
        "image_id": image_id,
        "category_id": CATEGORY_BY_NAME[obj.category].id,
        "bbox": [float(x1), float(y1), float(x2 - x1), float(y2 - y1)],
        "area": round(polygon_area(polygon), 2),
        "iscrowd": 0,
        "segmentation": [[c for point in polygon for c in point]],
    }


def coco_image(image_id: int, file_name: str, scene: Scene) -> dict:
    return {"id": image_id, "file_name": file_name, "width": scene.width, "height": scene.height, "license": 0}


def coco_instances(images: list[dict], annotations: list[dict], description: str,
                   with_attributes: bool = False) -> dict:
    """A COCO instances file; with attributes, also the `attributes` vocabulary ([{"id", "name"}], like
    `categories`) that the annotations' attribute names come from."""
    extra = {"attributes": coco_attributes()} if with_attributes else {}
    return {**extra,
        "info": {"description": description, "version": "1.0", "year": 2020, "contributor": "vlbert_core.world"},
        "licenses": [{"id": 0, "name": "synthetic, no restrictions", "url": ""}],
        "images": images,
        "annotations": annotations,
        "categories": coco_categories(),
    }


def vcr_metadata(scene: Scene) -> dict:
    """VCR per-image metadata: boxes [x1, y1, x2, y2, score] and per-object lists of polygons."""
    return {
        "boxes": [[float(v) for v in o.box] + [1.0] for o in scene.objects],
        "names": [VCR_OBJECT_NAME] * len(scene.objects),
        "segms": [[[list(point) for point in object_polygon(o)]] for o in scene.objects],
        "width": scene.width,
        "height": scene.height,
    }
