"""Fetch image bytes from http(s):// and file:// URLs with timeouts, retries and a size cap.

Uses only the standard library (urllib), so the pipeline has no HTTP-client dependency. Every
outcome is one of the fixed status strings in `status.py`; nothing here raises for a bad URL or
a bad server. Retries (with exponential back-off) happen only for failures that may go away: 5xx,
408/429, timeouts and dropped connections. A 404 or a DNS failure is final at once.
"""

from __future__ import annotations

import http.client
import os
import socket
import ssl
import stat
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import NamedTuple

from vlbert_core.data import status as st
from vlbert_core.utils import get_logger

log = get_logger(__name__)

USER_AGENT = "vlbert-pipeline/0.1 (+research reproduction)"
_CHUNK_BYTES = 64 * 1024
# Characters left as they are when a URL is re-quoted: URL syntax, and '%' so existing escapes survive.
_URL_SAFE = ":/?#[]@!$&'()*+,;=%~"


class FetchResult(NamedTuple):
    """What one fetch produced: the bytes (None on failure), a status from status.py, and why."""

    data: bytes | None
    status: str
    error: str


class _Attempt(NamedTuple):
    result: FetchResult
    transient: bool  # worth retrying
    retry_after_s: float | None = None  # the server's Retry-After, when it sent a usable one


class _TooLarge(Exception):
    pass


class _DeadlineExceeded(Exception):
    pass


class _LimitedRedirectHandler(urllib.request.HTTPRedirectHandler):
    """urllib's redirect handling (http/https targets only) with our own cap on redirect hops."""

    def __init__(self, max_redirects: int):
        super().__init__()
        self.max_redirections = max_redirects
        self.max_repeats = min(self.max_repeats, max_redirects)


def _fail(status: str, error: str, transient: bool = False, retry_after_s: float | None = None) -> _Attempt:
    return _Attempt(FetchResult(None, status, error), transient, retry_after_s)


def _retry_after_seconds(headers) -> float | None:
    value = headers.get("Retry-After") if headers is not None else None
    if value and value.strip().isdigit():
        return float(value.strip())
    return None


def normalize_http_url(url: str) -> str:
    """Percent-encode spaces and non-ASCII in the path/query and IDNA-encode the host.

    Captions' URLs in the wild contain raw spaces and UTF-8; http.client refuses both.
    """
    parts = urllib.parse.urlsplit(url)
    netloc = parts.netloc
    if not netloc.isascii():
        userinfo, _, hostport = netloc.rpartition("@")
        host, sep, port = hostport.partition(":")
        hostport = host.encode("idna").decode("ascii") + sep + port
        netloc = f"{userinfo}@{hostport}" if userinfo else hostport
    return urllib.parse.urlunsplit(
        (
            parts.scheme,
            netloc,
            urllib.parse.quote(parts.path, safe=_URL_SAFE),
            urllib.parse.quote(parts.query, safe=_URL_SAFE),
            "",  # the fragment is never sent to the server
        )
    )


class Downloader:
    """Fetches URLs; thread-safe, so one instance serves a whole thread pool.

    timeout_s bounds each socket operation (connect, each read); `deadline_s` (default 4 x
    timeout_s) bounds one whole attempt, so a server dripping bytes cannot hold a worker forever.
    `retries` extra attempts follow a transient failure, after backoff_s * 2**attempt seconds
    (or the server's Retry-After), capped at max_backoff_s. `threads` is the pool size that
    callers (download_cc_shard) use with this downloader.
    """

    def __init__(
        self,
        timeout_s: float = 10.0,
        retries: int = 2,
        max_bytes: int = 20_000_000,
        threads: int = 8,
        *,
        backoff_s: float = 1.0,
        max_backoff_s: float = 30.0,
        max_redirects: int = 5,
        deadline_s: float | None = None,
        user_agent: str = USER_AGENT,
    ):
        if timeout_s <= 0:
            raise ValueError(f"download timeout_s must be > 0, got {timeout_s}")
        if retries < 0:
            raise ValueError(f"download retries must be >= 0, got {retries}")
        if max_bytes <= 0:
            raise ValueError(f"download max_bytes must be > 0, got {max_bytes}")
        if threads < 1:
            raise ValueError(f"download threads must be >= 1, got {threads}")
        if backoff_s < 0 or max_backoff_s < 0:
            raise ValueError(f"download backoff must be >= 0, got {backoff_s} (cap {max_backoff_s})")
        if max_redirects < 0:
            raise ValueError(f"download max_redirects must be >= 0, got {max_redirects}")
        self.timeout_s = float(timeout_s)
        self.retries = int(retries)
        self.max_bytes = int(max_bytes)
        self.threads = int(threads)
        self.backoff_s = float(backoff_s)
        self.max_backoff_s = float(max_backoff_s)
        self.deadline_s = float(deadline_s) if deadline_s is not None else 4.0 * self.timeout_s
        self.user_agent = user_agent
        self._opener = urllib.request.build_opener(_LimitedRedirectHandler(max_redirects))

    def fetch(self, url: str) -> FetchResult:
        """Fetch one URL; never raises for network, server or file-system trouble."""
        scheme = urllib.parse.urlsplit(url).scheme.lower()
        if scheme == "file":
            return self._fetch_file(url)
        if scheme in ("http", "https"):
            return self._fetch_http(url)
        return FetchResult(None, st.UNSUPPORTED_URL, f"unsupported URL scheme {scheme!r}: {url[:200]}")

    # -- file:// -------------------------------------------------------------------------------

    def _fetch_file(self, url: str) -> FetchResult:
        parts = urllib.parse.urlsplit(url)
        if parts.netloc not in ("", "localhost"):
            return FetchResult(None, st.UNSUPPORTED_URL, f"file URL names a remote host {parts.netloc!r}: {url[:200]}")
        path = urllib.request.url2pathname(parts.path)
        if not os.path.isabs(path):
            return FetchResult(None, st.UNSUPPORTED_URL, f"file URL is not absolute: {url[:200]}")
        try:
            info = os.stat(path)
            if not stat.S_ISREG(info.st_mode):
                return FetchResult(None, st.IO_ERROR, f"not a regular file: {path}")
            if info.st_size > self.max_bytes:
                return FetchResult(None, st.TOO_LARGE, f"{info.st_size} bytes > max_bytes {self.max_bytes}: {path}")
            with open(path, "rb") as handle:
                data = handle.read(self.max_bytes + 1)
        except (FileNotFoundError, NotADirectoryError):
            return FetchResult(None, st.NOT_FOUND, f"no such file: {path}")
        except OSError as err:
            return FetchResult(None, st.IO_ERROR, f"cannot read {path}: {err.strerror or err}")
        if len(data) > self.max_bytes:  # the file grew between stat and read
            return FetchResult(None, st.TOO_LARGE, f"more than max_bytes {self.max_bytes}: {path}")
        return FetchResult(data, st.OK, "")

    # -- http(s):// ----------------------------------------------------------------------------

    def _fetch_http(self, url: str) -> FetchResult:
        try:
            request_url = normalize_http_url(url)
        except (ValueError, UnicodeError) as err:
            return FetchResult(None, st.UNSUPPORTED_URL, f"invalid URL ({err}): {url[:200]}")
        attempts = self.retries + 1
        for attempt in range(attempts):
            outcome = self._attempt_http(request_url)
            if outcome.result.status == st.OK or not outcome.transient or attempt == attempts - 1:
                break
            delay = self.backoff_s * 2**attempt
            if outcome.retry_after_s is not None:
                delay = max(delay, outcome.retry_after_s)
            delay = min(delay, self.max_backoff_s)
            log.debug("retrying %s in %.2fs after %s", url, delay, outcome.result.error)
            time.sleep(delay)
        result = outcome.result
        if result.status != st.OK and attempt > 0:
            result = result._replace(error=f"{result.error} (after {attempt + 1} attempts)")
        return result

    def _attempt_http(self, url: str) -> _Attempt:
        request = urllib.request.Request(url, headers={"User-Agent": self.user_agent, "Accept": "image/*,*/*;q=0.8"})
        started = time.monotonic()
        try:
            with self._opener.open(request, timeout=self.timeout_s) as response:
                declared = response.headers.get("Content-Length", "")
                if declared.strip().isdigit() and int(declared) > self.max_bytes:
                    return _fail(st.TOO_LARGE, f"Content-Length {declared} > max_bytes {self.max_bytes}")
                data = self._read_capped(response, started)
            return _Attempt(FetchResult(data, st.OK, ""), False)
        except urllib.error.HTTPError as err:
            err.close()
            return self._classify_http_error(err)
        except urllib.error.URLError as err:
            return self._classify_os_error(err.reason if isinstance(err.reason, BaseException) else err)
        except _TooLarge:
            return _fail(st.TOO_LARGE, f"body exceeds max_bytes {self.max_bytes}")
        except _DeadlineExceeded:
            return _fail(st.TIMEOUT, f"transfer took longer than {self.deadline_s:g}s", transient=True)
        except http.client.IncompleteRead as err:
            return _fail(st.CONNECTION_ERROR, f"connection closed mid-body ({len(err.partial)} bytes read)", True)
        except http.client.InvalidURL as err:
            return _fail(st.UNSUPPORTED_URL, f"invalid URL: {err}")
        except http.client.HTTPException as err:
            return _fail(st.CONNECTION_ERROR, f"bad HTTP response: {type(err).__name__}: {err}")
        except (ValueError, UnicodeError) as err:
            return _fail(st.UNSUPPORTED_URL, f"invalid URL: {err}")
        except OSError as err:
            return self._classify_os_error(err)

    def _read_capped(self, response, started: float) -> bytes:
        chunks: list[bytes] = []
        total = 0
        while True:
            if time.monotonic() - started > self.deadline_s:
                raise _DeadlineExceeded
            # read1 returns whatever one recv gives, so the deadline is checked while bytes trickle in.
            chunk = response.read1(_CHUNK_BYTES)
            if not chunk:
                missing = getattr(response, "length", None)
                if missing:  # the server closed before sending its declared Content-Length
                    raise http.client.IncompleteRead(b"".join(chunks), missing)
                return b"".join(chunks)
            total += len(chunk)
            if total > self.max_bytes:
                raise _TooLarge
            chunks.append(chunk)

    @staticmethod
    def _classify_http_error(err: urllib.error.HTTPError) -> _Attempt:
        code = err.code
        if code in (404, 410):
            return _fail(st.NOT_FOUND, f"HTTP {code} {err.reason}")
        if 300 <= code < 400:
            # urllib raises these for redirect loops, too many hops, or a redirect to a non-http scheme.
            return _fail(st.HTTP_ERROR, f"redirect failed: HTTP {code}: {err.reason}")
        transient = code >= 500 or code in (408, 429)
        return _fail(st.HTTP_ERROR, f"HTTP {code} {err.reason}", transient, _retry_after_seconds(err.headers))

    @staticmethod
    def _classify_os_error(err: BaseException) -> _Attempt:
        if isinstance(err, TimeoutError):  # socket.timeout is TimeoutError since Python 3.10
            return _fail(st.TIMEOUT, f"timed out: {err}", transient=True)
        if isinstance(err, (ConnectionResetError, ConnectionAbortedError, BrokenPipeError)):
            return _fail(st.CONNECTION_ERROR, f"{type(err).__name__}: {err}", transient=True)
        if isinstance(err, socket.gaierror):
            return _fail(st.CONNECTION_ERROR, f"DNS lookup failed: {err}")
        if isinstance(err, ssl.SSLError):
            return _fail(st.CONNECTION_ERROR, f"TLS error: {err}")
        return _fail(st.CONNECTION_ERROR, f"{type(err).__name__}: {err}")
