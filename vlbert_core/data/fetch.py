"""Download one large source file (a CC TSV, the BooksCorpus archive, a Wikipedia dump) with resume.

The bytes go to `<path>.part` next to the target. When a transfer breaks, the next attempt, or the
next run of the job, asks the server for the rest with an HTTP Range request and appends to the
part file; a server that ignores the range (200 instead of 206) makes it start over. Only a
complete file, whose size matches what the server announced (and the config's `bytes`) and whose
checksum matches the config's `checksum`, is renamed to the target. A mismatch deletes the part
file, so the next run downloads afresh, and fails with both values in the message.
"""

from __future__ import annotations

import hashlib
import http.client
import os
import re
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from tqdm import tqdm

from vlbert_core.data.downloader import USER_AGENT
from vlbert_core.utils import get_logger

log = get_logger(__name__)

CHECKSUM_ALGORITHMS = ("md5", "sha1", "sha256")
_CHUNK_BYTES = 1 << 20
_CONTENT_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+|\*)")


class FetchError(RuntimeError):
    """The file could not be fetched completely and correctly; the message says why."""


@dataclass(frozen=True)
class FetchSpec:
    """One entry of the config's `fetch:` block."""

    url: str
    path: str
    bytes: int | None = None
    checksum: str | None = None  # "md5:<hex>", "sha1:<hex>" or "sha256:<hex>"

    @classmethod
    def from_config(cls, name: str, entry: Mapping[str, Any]) -> FetchSpec:
        unknown = set(entry) - {"url", "path", "bytes", "checksum"}
        if unknown or "url" not in entry or "path" not in entry:
            raise ValueError(f"config fetch.{name}: needs url and path (optionally bytes, checksum); got {sorted(entry)}")
        spec = cls(entry["url"], entry["path"], entry.get("bytes"), entry.get("checksum"))
        if spec.checksum is not None:
            algorithm, _, digest = spec.checksum.partition(":")
            if algorithm not in CHECKSUM_ALGORITHMS or not re.fullmatch(r"[0-9a-fA-F]+", digest):
                raise ValueError(
                    f"config fetch.{name}.checksum {spec.checksum!r}: expected '<algorithm>:<hex>' "
                    f"with algorithm one of {CHECKSUM_ALGORITHMS}"
                )
        return spec


def _file_digest(path: Path, algorithm: str) -> str:
    digest = hashlib.new(algorithm)
    with open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def _status(response) -> int:
    return getattr(response, "status", None) or 200  # file:// responses carry no status


def _total_size(response, offset: int) -> int | None:
    """The full file size the server announced, from Content-Range (206) or Content-Length (200)."""
    if _status(response) == 206:
        match = _CONTENT_RANGE.fullmatch(response.headers.get("Content-Range", "").strip())
        if not match or int(match.group(1)) != offset:
            raise FetchError(f"server answered a range request from byte {offset} with "
                             f"Content-Range {response.headers.get('Content-Range')!r}")
        return None if match.group(3) == "*" else int(match.group(3))
    length = response.headers.get("Content-Length", "").strip()
    return int(length) if length.isdigit() else None


def _attempt(spec: FetchSpec, part: Path, timeout_s: float) -> int | None:
    """Continue the part file from where it ends; return the total size the server announced."""
    offset = part.stat().st_size if part.exists() else 0
    headers = {"User-Agent": USER_AGENT}
    if offset:
        headers["Range"] = f"bytes={offset}-"
    request = urllib.request.Request(spec.url, headers=headers)
    try:
        response = urllib.request.urlopen(request, timeout=timeout_s)
    except urllib.error.HTTPError as err:
        if err.code == 416 and offset:  # nothing left to send: the part file may be complete already
            err.close()
            return offset
        raise
    with response:
        if offset and _status(response) == 200:
            log.warning("%s ignores range requests; starting again from byte 0", spec.url)
            offset = 0
        total = _total_size(response, offset)
        mode = "ab" if offset else "wb"
        with open(part, mode) as handle, tqdm(
            total=total, initial=offset, unit="B", unit_scale=True, desc=Path(spec.path).name, mininterval=5.0
        ) as progress:
            while chunk := response.read(_CHUNK_BYTES):
                handle.write(chunk)
                progress.update(len(chunk))
    size = part.stat().st_size
    if total is not None and size < total:  # http.client ends a short body quietly: resume it
        raise ConnectionError(f"connection closed at byte {size} of {total}")
    return total


def fetch_file(spec: FetchSpec, *, timeout_s: float = 60.0, attempts: int = 5, backoff_s: float = 5.0) -> Path:
    """Download spec.url to spec.path, resuming a previous part file; return the path."""
    target = Path(spec.path)
    part = target.with_name(target.name + ".part")
    target.parent.mkdir(parents=True, exist_ok=True)
    parsed = urllib.parse.urlsplit(spec.url)
    if parsed.scheme not in ("http", "https", "file"):
        raise FetchError(f"{spec.url}: unsupported URL scheme {parsed.scheme!r} (http, https or file)")

    total = None
    for attempt in range(1, attempts + 1):
        try:
            total = _attempt(spec, part, timeout_s)
            break
        except urllib.error.HTTPError as err:
            if err.code < 500 and err.code not in (408, 429):
                raise FetchError(f"{spec.url}: HTTP {err.code} {err.reason}") from err
            problem = f"HTTP {err.code} {err.reason}"
        except (urllib.error.URLError, OSError, http.client.HTTPException) as err:
            problem = f"{type(err).__name__}: {getattr(err, 'reason', err)}"
        have = part.stat().st_size if part.exists() else 0
        if attempt == attempts:
            raise FetchError(
                f"{spec.url}: gave up after {attempts} attempts ({problem}); {have} bytes are kept in {part} "
                "and the next run resumes from there"
            )
        delay = backoff_s * 2 ** (attempt - 1)
        log.warning("%s: attempt %d failed (%s) with %d bytes so far; resuming in %.1fs", spec.url, attempt, problem, have, delay)
        time.sleep(delay)

    size = part.stat().st_size if part.exists() else 0
    problems = []
    if total is not None and size != total:
        problems.append(f"got {size} bytes, the server announced {total}")
    if spec.bytes is not None and size != spec.bytes:
        problems.append(f"got {size} bytes, the config expects {spec.bytes}")
    if spec.checksum is not None and not problems:
        algorithm, _, expected = spec.checksum.partition(":")
        actual = _file_digest(part, algorithm)
        if actual.lower() != expected.lower():
            problems.append(f"{algorithm} is {actual}, the config expects {expected}")
    if problems:
        part.unlink(missing_ok=True)  # a wrong file must not be resumed: the next run starts over
        raise FetchError(f"{spec.url} -> {target}: " + "; ".join(problems) + f"; deleted {part}")
    os.replace(part, target)
    log.info("%s -> %s: %d bytes%s", spec.url, target, size, f", {spec.checksum} verified" if spec.checksum else "")
    return target
