"""Fetch image bytes from http(s):// and file:// URLs with timeouts, retries and a size cap.

HTTP is urllib3's. One PoolManager (and one ProxyManager per proxy named in the environment)
is shared by the worker threads and keeps keep-alive connections per host, so the images of one
host cost one TCP (and TLS) handshake rather than one per image. Around urllib3 this module adds:
- a deadline per attempt (_DeadlineWatch): a socket timeout bounds each read, not their sum, so
  without it a server that drips its head or body a byte at a time holds a worker for ever;
- strict chunk sizes (_Http11Response): http.client, which urllib3 reads HTTP/1.1 with,
  parses a chunk size with int(x, 16), so "-5dc", "+5dc" and "0x5dc" pass, and a negative size
  then reads on to the end of the connection, past any size cap (interim 1xx responses, such as
  103 Early Hints, are skipped there too);
- redirects followed by hand: at most `max_redirects` hops, http/https targets only, relative
  Locations resolved against the URL that sent them, a loop stopped as soon as a URL comes round;
- the size cap counted on decoded bytes: a body with Content-Encoding (gzip, deflate) is decoded
  as it is read, so a decompression bomb stops at max_bytes.
Proxies come from the environment (http_proxy, https_proxy, no_proxy), read the way urllib reads
them; an https:// proxy is spoken to over TLS, so its credentials never cross the wire in clear.

URL schemes: http and https, and file only when `allow_file_urls` is set (the synthetic world's
TSVs point at local files; a real TSV must not make the downloader read them). Any other scheme,
and a redirect to anything but http(s), is the status refused_scheme.

Every outcome is one of the fixed status strings in `status.py`; nothing here raises for a bad URL or
a bad server. Retries (with exponential back-off) happen only for failures that may go away: 5xx,
408/429, timeouts and dropped connections. A 404 or a DNS failure is final at once.
"""

from __future__ import annotations

import heapq
import http.client
import itertools
import os
import re
import socket
import ssl
import stat
import threading
import time
import urllib.parse
import urllib.request
from typing import Any, NamedTuple

import urllib3
import urllib3.exceptions

from vlbert_core.data import status as st
from vlbert_core.utils import get_logger

log = get_logger(__name__)

USER_AGENT = "vlbert-pipeline/0.1 (+research reproduction)"
HTTP_SCHEMES = ("http", "https")
# Characters left as they are when a URL is re-quoted: URL syntax, and '%' so existing escapes survive.
_URL_SAFE = ":/?#[]@!$&'()*+,;=%~"
REDIRECT_CODES = frozenset({301, 302, 303, 307, 308})
_DEFAULT_PORTS = {"http": 80, "https": 443}
# An error or redirect response's body up to this size is read and dropped so that its connection
# can serve the next request; a longer (or unsized, or encoded) one costs a new connection instead.
_MAX_DISCARDED_BYTES = 64 * 1024
_READ_BYTES = 1 << 20  # per read of a body: one read takes a whole image of typical size
_MAX_CHUNK_LINE_BYTES = 4096
_CHUNK_SIZE = re.compile(rb"[0-9A-Fa-f]{1,16}")  # RFC 9112 1*HEXDIG, at most 2**64 - 1


class FetchResult(NamedTuple):
    """What one fetch produced: the bytes (None on failure), a status from status.py, and why."""

    data: bytes | None
    status: str
    error: str


class _Attempt(NamedTuple):
    result: FetchResult
    transient: bool  # worth retrying
    retry_after_s: float | None = None  # the server's Retry-After, when it sent a usable one


def _fail(status: str, error: str, transient: bool = False, retry_after_s: float | None = None) -> _Attempt:
    return _Attempt(FetchResult(None, status, error), transient, retry_after_s)


def _retry_after_seconds(headers: Any) -> float | None:
    value = headers.get("Retry-After", "").strip()
    return float(value) if value.isdigit() else None


def normalize_http_url(url: str) -> str:
    """Percent-encode spaces and non-ASCII in the path/query and IDNA-encode the host.

    Captions' URLs in the wild contain raw spaces and UTF-8, which cannot go into a request line.
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


# -- urllib3 pieces ------------------------------------------------------------------------------


class BadChunkSize(http.client.HTTPException):
    """A chunk-size line that is not 1 to 16 hex digits (a sign, a 0x prefix, spaces, too long)."""


class _Http11Response(http.client.HTTPResponse):
    """http.client's response, with chunk sizes read as RFC 9112 writes them, and every interim
    1xx response skipped (http.client skips only 100 Continue, and returns 103 Early Hints)."""

    def _read_status(self) -> tuple[str, int, str]:
        while True:
            version, status, reason = super()._read_status()
            if status in (100, 101) or not 100 <= status < 200:
                return version, status, reason  # http.client's begin() skips 100 itself
            http.client.parse_headers(self.fp)  # the interim response's headers, dropped

    def _read_next_chunk_size(self) -> int:
        line = self.fp.readline(_MAX_CHUNK_LINE_BYTES + 1)
        if not line:
            raise ValueError("connection closed before a chunk size")  # http.client: IncompleteRead
        if len(line) > _MAX_CHUNK_LINE_BYTES:
            self._close_conn()
            raise BadChunkSize(f"chunk-size line longer than {_MAX_CHUNK_LINE_BYTES} bytes")
        size = line.split(b";", 1)[0].strip()
        if _CHUNK_SIZE.fullmatch(size) is None:
            self._close_conn()
            raise BadChunkSize(f"bad chunk size {size[:40]!r}")
        return int(size, 16)


class _AttemptClock:
    """One attempt's deadline, and the socket that the deadline watch shuts down when it passes."""

    __slots__ = ("deadline", "sock", "expired", "done")

    def __init__(self, deadline: float):
        self.deadline = deadline
        self.sock: Any = None
        self.expired = False
        self.done = False


def _shut_down(sock: Any) -> None:
    # urllib3 wraps TLS-in-TLS (https through an https proxy) around an SSLSocket: find the socket.
    while sock is not None and not isinstance(sock, socket.socket):
        sock = getattr(sock, "socket", None)
    if sock is None:
        return
    try:
        socket.socket.shutdown(sock, socket.SHUT_RDWR)
    except OSError:
        pass  # closed meanwhile: nothing is blocked on it any more


class _DeadlineWatch:
    """Ends HTTP attempts that outlive their deadline.

    The thread running an attempt `begin`s it; the connection carrying it `bind`s its socket
    (`_StrictConnection.request`, once connected); a watcher thread shuts that socket down when
    the deadline passes, so whatever read is blocked returns at once, and `end` tells the attempt
    whether that happened. The watcher runs while attempts are pending and stops after the last.
    """

    def __init__(self) -> None:
        self._condition = threading.Condition()
        self._pending: list[tuple[float, int, _AttemptClock]] = []  # a heap by deadline
        self._order = itertools.count()
        self._current = threading.local()  # .clock: the attempt this thread runs
        self._watching = False

    def begin(self, deadline: float) -> _AttemptClock:
        clock = _AttemptClock(deadline)
        self._current.clock = clock
        with self._condition:
            heapq.heappush(self._pending, (deadline, next(self._order), clock))
            if not self._watching:
                self._watching = True
                threading.Thread(target=self._watch, name="download-deadlines", daemon=True).start()
            elif self._pending[0][2] is clock:
                self._condition.notify()
        return clock

    def bind(self, sock: Any) -> None:
        clock = getattr(self._current, "clock", None)
        if clock is None or sock is None:
            return
        with self._condition:
            if clock.done:
                return
            clock.sock = sock
            if clock.expired:
                _shut_down(sock)

    def end(self, clock: _AttemptClock) -> bool:
        """Stop watching `clock`; True when its deadline passed (its socket was shut down)."""
        with self._condition:
            clock.done = True
            clock.sock = None
        self._current.clock = None
        return clock.expired

    def _watch(self) -> None:
        with self._condition:
            while self._pending:
                deadline, _, clock = self._pending[0]
                wait = deadline - time.monotonic()
                if wait > 0:
                    self._condition.wait(wait)
                    continue
                heapq.heappop(self._pending)
                if not clock.done:
                    clock.expired = True
                    if clock.sock is not None:
                        _shut_down(clock.sock)
            self._watching = False


class _StrictConnection:
    """Mixed into urllib3's connections: responses read by _Http11Response and, given a deadline
    watch, the socket put under it for each request."""

    deadline_watch: _DeadlineWatch | None = None  # set per downloader by _pool_classes
    response_class = _Http11Response

    def request(self, *args: Any, **kwargs: Any) -> None:
        super().request(*args, **kwargs)  # connects first when the connection is new
        if self.deadline_watch is not None:
            self.deadline_watch.bind(self.sock)


def _pool_classes(watch: _DeadlineWatch | None) -> dict[str, type]:
    """urllib3 pool classes whose connections are _StrictConnections reporting to `watch`."""
    pools = {}
    for scheme, pool_class in (("http", urllib3.HTTPConnectionPool), ("https", urllib3.HTTPSConnectionPool)):
        connection_class = type(
            f"Strict{pool_class.ConnectionCls.__name__}",
            (_StrictConnection, pool_class.ConnectionCls),
            {"deadline_watch": watch},
        )
        pools[scheme] = type(f"Strict{pool_class.__name__}", (pool_class,), {"ConnectionCls": connection_class})
    return pools


class HttpPools:
    """urllib3 managers shared by threads: one for direct requests and one per proxy that the
    environment names (http_proxy, https_proxy; no_proxy is honoured per URL). Read once, like
    urllib's ProxyHandler does when its opener is built. A proxy given without a scheme is http://.
    Their connections read chunk sizes strictly; given a `deadline_watch`, they report to it."""

    def __init__(self, *, num_pools: int, maxsize: int, deadline_watch: _DeadlineWatch | None = None):
        self.ssl_context = ssl.create_default_context()  # honours SSL_CERT_FILE, like urllib
        options: dict[str, Any] = {"num_pools": num_pools, "maxsize": maxsize, "ssl_context": self.ssl_context}
        self.direct = urllib3.PoolManager(**options)
        self.proxied: dict[str, urllib3.ProxyManager] = {}
        for scheme, setting in urllib.request.getproxies().items():
            if scheme in HTTP_SCHEMES and setting:
                self.proxied[scheme] = _proxy_manager(scheme, setting, options)
        pool_classes = _pool_classes(deadline_watch)
        for manager in (self.direct, *self.proxied.values()):
            manager.pool_classes_by_scheme = pool_classes

    def for_url(self, url: str) -> urllib3.PoolManager:
        parts = urllib.parse.urlsplit(url)
        proxy = self.proxied.get(parts.scheme.lower())
        if proxy is not None and not urllib.request.proxy_bypass(parts.netloc.rpartition("@")[2]):
            return proxy
        return self.direct

    def clear(self) -> None:
        for manager in (self.direct, *self.proxied.values()):
            manager.clear()


def _proxy_manager(for_scheme: str, setting: str, options: dict[str, Any]) -> urllib3.ProxyManager:
    """A ProxyManager for a setting such as http://user:pw@proxy:3128, https://proxy or proxy:3128."""
    parts = urllib.parse.urlsplit(setting if "://" in setting else f"http://{setting}")
    scheme = parts.scheme.lower()
    where = f"{for_scheme}_proxy from the environment"  # never the setting itself: it may hold a password
    if scheme not in HTTP_SCHEMES:
        raise ValueError(f"{where}: proxy scheme {scheme!r} is not supported (http or https)")
    try:
        port = parts.port or _DEFAULT_PORTS[scheme]
    except ValueError as err:
        raise ValueError(f"{where}: {err}") from None
    if not parts.hostname:
        raise ValueError(f"{where} names no host")
    headers = {}
    if parts.username is not None:
        credentials = f"{urllib.parse.unquote(parts.username)}:{urllib.parse.unquote(parts.password or '')}"
        headers = urllib3.make_headers(proxy_basic_auth=credentials)
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    return urllib3.ProxyManager(
        f"{scheme}://{host}:{port}", proxy_headers=headers, proxy_ssl_context=options["ssl_context"], **options
    )


# -- the downloader ------------------------------------------------------------------------------


class Downloader:
    """Fetches URLs; thread-safe, so one instance serves a whole thread pool.

    timeout_s bounds each socket operation (connect, each read); `deadline_s` (default 4 x
    timeout_s) bounds one whole attempt, redirects included, so a server dripping bytes cannot
    hold a worker for ever. `retries` extra attempts follow a transient failure, after
    backoff_s * 2**attempt seconds (or the server's Retry-After), capped at max_backoff_s.
    `threads` is the pool size that callers (download_cc_shard) use with this downloader; it also
    sizes urllib3's connection pools. `allow_file_urls` lets file:// URLs be read (local files).
    `close()` (or a `with` block) closes the idle connections.
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
        allow_file_urls: bool = False,
        config_key: str = "cc.download",
    ):
        # config_key: where the options come from (cc.download, tasks.custom.<name>.download), for errors
        self.config_key = config_key
        if timeout_s <= 0:
            raise ValueError(f"{config_key}.timeout_s must be > 0, got {timeout_s}")
        if retries < 0:
            raise ValueError(f"{config_key}.retries must be >= 0, got {retries}")
        if max_bytes <= 0:
            raise ValueError(f"{config_key}.max_bytes must be > 0, got {max_bytes}")
        if threads < 1:
            raise ValueError(f"{config_key}.threads must be >= 1, got {threads}")
        if backoff_s < 0 or max_backoff_s < 0:
            raise ValueError(f"{config_key}.backoff must be >= 0, got {backoff_s} (cap {max_backoff_s})")
        if max_redirects < 0:
            raise ValueError(f"{config_key}.max_redirects must be >= 0, got {max_redirects}")
        if deadline_s is not None and deadline_s <= 0:
            raise ValueError(f"{config_key}.deadline_s must be > 0, got {deadline_s}")
        if not isinstance(allow_file_urls, bool):
            raise ValueError(f"{config_key}.allow_file_urls must be true or false, got {allow_file_urls!r}")
        self.timeout_s = float(timeout_s)
        self.retries = int(retries)
        self.max_bytes = int(max_bytes)
        self.threads = int(threads)
        self.backoff_s = float(backoff_s)
        self.max_backoff_s = float(max_backoff_s)
        self.max_redirects = int(max_redirects)
        self.deadline_s = float(deadline_s) if deadline_s is not None else 4.0 * self.timeout_s
        self.allow_file_urls = allow_file_urls
        if not user_agent.isprintable() or not user_agent.isascii():
            raise ValueError(f"{config_key}.user_agent must be printable ASCII, got {user_agent!r}")
        self.user_agent = user_agent
        # identity: images do not compress; a server that encodes anyway is decoded (and capped).
        self._headers = {"User-Agent": user_agent, "Accept": "image/*,*/*;q=0.8", "Accept-Encoding": "identity"}
        self._watch = _DeadlineWatch()
        self._pools = HttpPools(num_pools=max(10, 2 * self.threads), maxsize=self.threads, deadline_watch=self._watch)

    def close(self) -> None:
        """Close the idle keep-alive connections (call it when no fetch is running)."""
        self._pools.clear()

    def __enter__(self) -> Downloader:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def fetch(self, url: str) -> FetchResult:
        """Fetch one URL; never raises for network, server or file-system trouble."""
        try:
            scheme = urllib.parse.urlsplit(url).scheme.lower()
        except ValueError as err:
            return FetchResult(None, st.UNSUPPORTED_URL, f"invalid URL ({err}): {url[:200]}")
        if scheme in HTTP_SCHEMES:
            return self._fetch_http(url)
        if scheme == "file" and self.allow_file_urls:
            return self._fetch_file(url)
        if scheme == "file":
            return FetchResult(
                None, st.REFUSED_SCHEME, f"file:// URLs are refused ({self.config_key}.allow_file_urls is false): {url[:200]}"
            )
        if not scheme:
            return FetchResult(None, st.UNSUPPORTED_URL, f"not an absolute URL: {url[:200]}")
        accepted = ", ".join(HTTP_SCHEMES + (("file",) if self.allow_file_urls else ()))
        return FetchResult(None, st.REFUSED_SCHEME, f"URL scheme {scheme!r} is refused (only {accepted}): {url[:200]}")

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
        """One attempt: the request, and the redirects it leads to, within one deadline."""
        deadline = time.monotonic() + self.deadline_s
        clock = self._watch.begin(deadline)
        try:
            outcome = self._follow_redirects(url, deadline)
        finally:
            expired = self._watch.end(clock)
        if expired:  # whatever was read: a body cut off by the watch can look complete
            return _fail(st.TIMEOUT, f"transfer took longer than the deadline {self.deadline_s:g}s", transient=True)
        return outcome

    def _follow_redirects(self, url: str, deadline: float) -> _Attempt:
        visited = {url}
        for _hop in range(self.max_redirects + 1):
            outcome = self._request(url, deadline)
            if isinstance(outcome, _Attempt):
                return outcome
            location = outcome
            try:
                target = normalize_http_url(urllib.parse.urljoin(url, location))
                scheme = urllib.parse.urlsplit(target).scheme.lower()
            except (ValueError, UnicodeError) as err:
                return _fail(st.HTTP_ERROR, f"redirect to an invalid URL {location[:200]!r}: {err}")
            if scheme not in HTTP_SCHEMES:
                return _fail(st.REFUSED_SCHEME, f"redirect to a {scheme or 'scheme-less'} URL refused: {target[:200]}")
            if target in visited:
                return _fail(st.HTTP_ERROR, f"redirect loop: {url[:200]} -> {target[:200]}")
            visited.add(target)
            url = target
        return _fail(st.HTTP_ERROR, f"too many redirects (more than max_redirects {self.max_redirects})")

    def _request(self, url: str, deadline: float) -> _Attempt | str:
        """GET `url` once; an _Attempt, or the Location of a redirect to follow."""
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return _fail(st.TIMEOUT, f"transfer took longer than the deadline {self.deadline_s:g}s", transient=True)
        response = None
        try:
            response = self._pools.for_url(url).request(
                "GET",
                url,
                headers=self._headers,
                redirect=False,
                retries=False,
                preload_content=False,
                decode_content=True,
                timeout=urllib3.Timeout(connect=min(self.timeout_s, remaining), read=self.timeout_s),
            )
            return self._read_response(response)
        except (urllib3.exceptions.HTTPError, http.client.HTTPException, OSError, ValueError) as err:
            return self._classify_error(err)
        finally:
            if response is not None:
                response.release_conn()  # back to the pool if read to the end, else already closed

    def _read_response(self, response: urllib3.BaseHTTPResponse) -> _Attempt | str:
        code = response.status
        if 200 <= code < 300:
            return self._read_body(response)
        self._discard_body(response)
        if code in REDIRECT_CODES:
            location = response.headers.get("Location", "")
            if not location:
                return _fail(st.HTTP_ERROR, f"HTTP {code} redirect without a Location header")
            return location
        return self._classify_http_status(code, response.reason or "", response.headers)

    def _read_body(self, response: urllib3.BaseHTTPResponse) -> _Attempt:
        encoding = response.headers.get("Content-Encoding", "identity").strip().lower()
        encoded = encoding not in ("", "identity")
        length = response.length_remaining  # Content-Length; None when chunked or unframed
        if not encoded and length is not None and length > self.max_bytes:
            response.close()
            return _fail(st.TOO_LARGE, f"Content-Length {length} > max_bytes {self.max_bytes}")
        parts, size = [], 0
        # Never ask for more than one byte past the cap: that byte is the proof of "too large".
        while chunk := response.read(min(_READ_BYTES, self.max_bytes + 1 - size)):
            size += len(chunk)
            if size > self.max_bytes:
                response.close()
                decoded = f" after {encoding} decoding" if encoded else ""
                return _fail(st.TOO_LARGE, f"body exceeds max_bytes {self.max_bytes}{decoded}")
            parts.append(chunk)
        return _Attempt(FetchResult(b"".join(parts), st.OK, ""), False)

    @staticmethod
    def _discard_body(response: urllib3.BaseHTTPResponse) -> None:
        length = response.length_remaining
        if length is not None and length <= _MAX_DISCARDED_BYTES and "Content-Encoding" not in response.headers:
            response.drain_conn()  # a short body: read it so that the connection serves the next request
        else:
            response.close()

    @staticmethod
    def _classify_http_status(code: int, reason: str, headers: Any) -> _Attempt:
        if code in (404, 410):
            return _fail(st.NOT_FOUND, f"HTTP {code} {reason}")
        if 300 <= code < 400:  # 300, 304, 305...: nothing this client can follow
            return _fail(st.HTTP_ERROR, f"redirect failed: HTTP {code} {reason}")
        transient = code >= 500 or code in (408, 429)
        return _fail(st.HTTP_ERROR, f"HTTP {code} {reason}", transient, _retry_after_seconds(headers))

    @staticmethod
    def _classify_error(err: BaseException) -> _Attempt:
        errors = urllib3.exceptions
        # Order matters: NameResolutionError is a NewConnectionError, which is a ConnectTimeoutError.
        if isinstance(err, errors.NameResolutionError):
            return _fail(st.CONNECTION_ERROR, f"DNS lookup failed: {err}")
        if isinstance(err, errors.NewConnectionError):
            return _fail(st.CONNECTION_ERROR, f"cannot connect: {err}")
        if isinstance(err, (errors.TimeoutError, TimeoutError)):  # connect or read timeout
            return _fail(st.TIMEOUT, f"timed out: {err}", transient=True)
        if isinstance(err, (errors.SSLError, ssl.SSLError)):
            return _fail(st.CONNECTION_ERROR, f"TLS error: {err}")
        if isinstance(err, errors.ProxyError):
            return _fail(st.CONNECTION_ERROR, f"proxy failed: {err}")
        if isinstance(err, ValueError):  # LocationParseError, InvalidURL: the URL, not the server
            return _fail(st.UNSUPPORTED_URL, f"invalid URL: {err}")
        if isinstance(err, errors.ProtocolError):
            cause = err.args[1] if len(err.args) > 1 else err.__cause__
            if isinstance(cause, http.client.IncompleteRead):
                return _fail(st.CONNECTION_ERROR, f"connection closed mid-body: {cause!r}", transient=True)
            if isinstance(cause, (ConnectionResetError, ConnectionAbortedError, BrokenPipeError)):
                return _fail(st.CONNECTION_ERROR, f"{type(cause).__name__}: {cause}", transient=True)
            if isinstance(cause, TimeoutError):
                return _fail(st.TIMEOUT, f"timed out: {cause}", transient=True)
            if isinstance(cause, http.client.InvalidURL):
                return _fail(st.UNSUPPORTED_URL, f"invalid URL: {cause}")
            return _fail(st.CONNECTION_ERROR, f"bad HTTP response: {cause if cause is not None else err}")
        if isinstance(err, ConnectionError):
            return _fail(st.CONNECTION_ERROR, f"{type(err).__name__}: {err}")
        return _fail(st.CONNECTION_ERROR, f"bad HTTP response: {type(err).__name__}: {err}")
