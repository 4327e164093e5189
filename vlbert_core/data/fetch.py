"""Download one large source file (a CC TSV, the BooksCorpus archive, a Wikipedia dump) with resume.

The bytes go to `<path>.part` next to the target. When a transfer breaks, the next attempt, or the
next run of the job, asks the server for the rest with an HTTP Range request (urllib3, with the
downloader's strict connections and proxies from the environment) and appends to the part file;
a server that ignores the range (200 instead of 206) makes it start over. Only a complete file, whose size matches what the server announced (and the config's `bytes`) and whose
checksum matches the config's `checksum`, is renamed to the target. A mismatch deletes the part
file, so the next run downloads afresh, and fails with both values in the message.
"""

from __future__ import annotations

import hashlib
import http.client
import os
import re
import shutil
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import urllib3
import urllib3.exceptions
from vlbert_core.progress import Progress

from vlbert_core.data.downloader import HTTP_SCHEMES, REDIRECT_CODES, USER_AGENT, HttpPools
from vlbert_core.utils import get_logger

log = get_logger(__name__)

CHECKSUM_ALGORITHMS = ("md5", "sha1", "sha256")
_CHUNK_BYTES = 1 << 20
_CONTENT_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+|\*)")
_MAX_REDIRECTS = 10


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


def _total_size(response: urllib3.BaseHTTPResponse, offset: int) -> int | None:
    """The full file size the server announced, from Content-Range (206) or Content-Length (200)."""
    if response.status == 206:
        match = _CONTENT_RANGE.fullmatch(response.headers.get("Content-Range", "").strip())
        if not match or int(match.group(1)) != offset:
            raise FetchError(f"server answered a range request from byte {offset} with "
                             f"Content-Range {response.headers.get('Content-Range')!r}")
        return None if match.group(3) == "*" else int(match.group(3))
    length = response.headers.get("Content-Length", "").strip()
    return int(length) if length.isdigit() else None


class _TransientError(Exception):
    """A failure worth another attempt (5xx, 408, 429, a broken connection); the message says which."""


def _get(pools: HttpPools, url: str, headers: dict[str, str], timeout_s: float) -> urllib3.BaseHTTPResponse:
    """GET `url`, following up to _MAX_REDIRECTS redirects to http(s) URLs; the body is left unread."""
    for _hop in range(_MAX_REDIRECTS + 1):
        response = pools.for_url(url).request(
            "GET", url, headers=headers, redirect=False, retries=False, preload_content=False,
            decode_content=False, timeout=urllib3.Timeout(connect=timeout_s, read=timeout_s),
        )
        location = response.headers.get("Location") if response.status in REDIRECT_CODES else None
        if not location:
            return response
        response.close()
        target = urllib.parse.urljoin(url, location)
        if urllib.parse.urlsplit(target).scheme.lower() not in HTTP_SCHEMES:
            raise FetchError(f"{url}: redirect to {target[:200]!r} refused (http or https only)")
        url = target
    raise FetchError(f"{url}: more than {_MAX_REDIRECTS} redirects")


def _copy_file(spec: FetchSpec, part: Path) -> int:
    """A file:// source (a configured local copy): copied whole, its size returned."""
    parts = urllib.parse.urlsplit(spec.url)
    source = urllib.request.url2pathname(parts.path)
    if parts.netloc not in ("", "localhost") or not os.path.isabs(source):
        raise FetchError(f"{spec.url}: a file URL must name an absolute local path")
    try:
        shutil.copyfile(source, part)
    except OSError as err:
        raise FetchError(f"{spec.url}: cannot copy {source}: {err.strerror or err}") from err
    return part.stat().st_size


def _attempt(spec: FetchSpec, part: Path, pools: HttpPools, timeout_s: float) -> int | None:
    """Continue the part file from where it ends; return the total size the server announced."""
    offset = part.stat().st_size if part.exists() else 0
    headers = {"User-Agent": USER_AGENT, "Accept-Encoding": "identity"}  # the bytes as the checksum knows them
    if offset:
        headers["Range"] = f"bytes={offset}-"
    response = _get(pools, spec.url, headers, timeout_s)
    try:
        if response.status == 416 and offset:  # nothing left to send: the part file may be complete already
            return offset
        if response.status not in (200, 206):
            problem = f"HTTP {response.status} {response.reason}"
            if response.status >= 500 or response.status in (408, 429):
                raise _TransientError(problem)
            raise FetchError(f"{spec.url}: {problem}")
        if offset and response.status == 200:
            log.warning("%s ignores range requests; starting again from byte 0", spec.url)
            offset = 0
        total = _total_size(response, offset)
        mode = "ab" if offset else "wb"
        with open(part, mode) as handle, Progress(
            total=total, initial=offset, unit="B", unit_scale=True, desc=Path(spec.path).name, mininterval=5.0
        ) as progress:
            try:
                while chunk := response.read(_CHUNK_BYTES):
                    handle.write(chunk)
                    progress.update(len(chunk))
            except urllib3.exceptions.ProtocolError as err:  # a short body, a reset: resume from here
                handle.flush()
                raise _TransientError(f"connection closed at byte {part.stat().st_size} of {total}: {err}") from err
    finally:
        response.close()
        response.release_conn()
    size = part.stat().st_size
    if total is not None and size < total:
        raise _TransientError(f"connection closed at byte {size} of {total}")
    return total


def _fetch_with_retries(
    spec: FetchSpec, part: Path, scheme: str, pools: HttpPools, timeout_s: float, attempts: int, backoff_s: float
) -> int | None:
    """The part file completed (as far as the server says); the total size it announced."""
    attempt = 0
    while True:
        attempt += 1
        try:
            return _copy_file(spec, part) if scheme == "file" else _attempt(spec, part, pools, timeout_s)
        except _TransientError as err:
            problem = str(err)
        except (urllib3.exceptions.HTTPError, http.client.HTTPException, OSError) as err:
            problem = f"{type(err).__name__}: {err}"
        have = part.stat().st_size if part.exists() else 0
        if attempt == attempts:
            raise FetchError(
                f"{spec.url}: gave up after {attempts} attempts ({problem}); {have} bytes are kept in {part} "
                "and the next run resumes from there"
            )
        delay = backoff_s * 2 ** (attempt - 1)
        log.warning("%s: attempt %d failed (%s) with %d bytes so far; resuming in %.1fs", spec.url, attempt, problem, have, delay)
        time.sleep(delay)


def fetch_file(spec: FetchSpec, *, timeout_s: float = 60.0, attempts: int = 5, backoff_s: float = 5.0) -> Path:
    """Download spec.url to spec.path, resuming a previous part file; return the path."""
    target = Path(spec.path)
    part = target.with_name(target.name + ".part")
    target.parent.mkdir(parents=True, exist_ok=True)
    scheme = urllib.parse.urlsplit(spec.url).scheme.lower()
    if scheme not in (*HTTP_SCHEMES, "file"):
        raise FetchError(f"{spec.url}: unsupported URL scheme {scheme!r} (http, https or file)")

    pools = HttpPools(num_pools=2, maxsize=1)
    try:
        total = _fetch_with_retries(spec, part, scheme, pools, timeout_s, attempts, backoff_s)
    finally:
        pools.clear()

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
