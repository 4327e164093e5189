"""Fetch image bytes from http(s):// and file:// URLs with timeouts, retries and a size cap.

HTTP/1.1 is spoken by http1.Connection over keep-alive connections. A connection that served
a complete response goes back to a small pool shared by the worker threads, keyed by scheme,
host, port and proxy, so the images of one host cost one TCP (and TLS) handshake rather than one
per image. A connection that saw any error is closed, never reused. Redirects are
followed here: at most `max_redirects` hops, http/https targets only, relative Locations resolved
against the URL that sent them, and a loop is stopped as soon as a URL comes round again.
Proxies come from the environment (http_proxy, https_proxy, no_proxy), read the way urllib
reads them.

Every outcome is one of the fixed status strings in `status.py`; nothing here raises for a bad URL or
a bad server. Retries (with exponential back-off) happen only for failures that may go away: 5xx,
408/429, timeouts and dropped connections. A 404 or a DNS failure is final at once.
"""

from __future__ import annotations

import base64
import functools
import os
import socket
import ssl
import stat
import threading
import time
import urllib.parse
import urllib.request
from typing import NamedTuple

from vlbert_core.data import http1
from vlbert_core.data import status as st
from vlbert_core.utils import get_logger

log = get_logger(__name__)

USER_AGENT = "vlbert-pipeline/0.1 (+research reproduction)"
# Characters left as they are when a URL is re-quoted: URL syntax, and '%' so existing escapes survive.
_URL_SAFE = ":/?#[]@!$&'()*+,;=%~"
_REDIRECT_CODES = frozenset({301, 302, 303, 307, 308})
_DEFAULT_PORTS = {"http": 80, "https": 443}
# An error or redirect response's body up to this size is read and dropped so that its connection
# can serve the next request; a longer (or unsized) one costs a new connection instead.
_MAX_DISCARDED_BYTES = 64 * 1024
# A reused connection that the server has meanwhile closed fails like this before any response
# byte arrives; the request is then sent once more on a fresh connection.
_STALE_CONNECTION_ERRORS = (ConnectionResetError, ConnectionAbortedError, BrokenPipeError)


class FetchResult(NamedTuple):
    """What one fetch produced: the bytes (None on failure), a status from status.py, and why."""

    data: bytes | None
    status: str
    error: str


class _Attempt(NamedTuple):
    result: FetchResult
    transient: bool  # worth retrying
    retry_after_s: float | None = None  # the server's Retry-After, when it sent a usable one


class _Proxy(NamedTuple):
    host: str
    port: int
    authorization: str | None  # a Proxy-Authorization header value, from user:password in the proxy URL


class _Route(NamedTuple):
    """Where a request's connection goes; requests with equal routes can share a connection."""

    scheme: str  # of the URL: http or https
    host: str
    port: int
    proxy: _Proxy | None


def _fail(status: str, error: str, transient: bool = False, retry_after_s: float | None = None) -> _Attempt:
    return _Attempt(FetchResult(None, status, error), transient, retry_after_s)


def _retry_after_seconds(response: http1.Response) -> float | None:
    value = response.header("Retry-After").strip()
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


def _parse_proxy(setting: str) -> _Proxy:
    """host, port and credentials of a proxy setting such as http://user:pw@proxy:3128 or proxy:3128."""
    parts = urllib.parse.urlsplit(setting if "://" in setting else f"http://{setting}")
    try:
        port = parts.port or _DEFAULT_PORTS.get(parts.scheme.lower(), 80)
    except ValueError as err:
        raise ValueError(f"proxy setting {setting!r} from the environment: {err}") from None
    if not parts.hostname:
        raise ValueError(f"proxy setting {setting!r} from the environment names no host")
    authorization = None
    if parts.username is not None:
        credentials = f"{urllib.parse.unquote(parts.username)}:{urllib.parse.unquote(parts.password or '')}"
        authorization = "Basic " + base64.b64encode(credentials.encode("utf-8")).decode("ascii")
    return _Proxy(parts.hostname, port, authorization)


class _IdleConnections:
    """Keep-alive connections not in use, shared by the worker threads.

    One connection serves one request at a time: `take` hands it to one thread, and that thread
    `put`s it back only after reading its response to the end. Beyond `limit` idle connections
    the least recently returned host loses its oldest one, so a shard over millions of hosts
    holds a bounded number of sockets.
    """

    def __init__(self, limit: int):
        self.limit = limit
        self._lock = threading.Lock()
        self._idle: dict[_Route, list[http1.Connection]] = {}  # least recently returned first
        self._count = 0

    def take(self, route: _Route) -> http1.Connection | None:
        with self._lock:
            connections = self._idle.get(route)
            if not connections:
                return None
            connection = connections.pop()
            if not connections:
                del self._idle[route]
            self._count -= 1
            return connection

    def put(self, route: _Route, connection: http1.Connection) -> None:
        evicted = None
        with self._lock:
            connections = self._idle.pop(route, [])
            connections.append(connection)
            self._idle[route] = connections  # re-inserted last: most recently returned
            self._count += 1
            if self._count > self.limit:
                oldest_route = next(iter(self._idle))
                oldest = self._idle[oldest_route]
                evicted = oldest.pop(0)
                if not oldest:
                    del self._idle[oldest_route]
                self._count -= 1
        if evicted is not None:
            evicted.close()

    def close(self) -> None:
        with self._lock:
            idle, self._idle, self._count = self._idle, {}, 0
        for connections in idle.values():
            for connection in connections:
                connection.close()


class Downloader:
    """Fetches URLs; thread-safe, so one instance serves a whole thread pool.

    timeout_s bounds each socket operation (connect, each read); `deadline_s` (default 4 x
    timeout_s) bounds one whole attempt, redirects included, so a server dripping bytes cannot
    hold a worker forever. `retries` extra attempts follow a transient failure, after
    backoff_s * 2**attempt seconds (or the server's Retry-After), capped at max_backoff_s.
    `threads` is the pool size that callers (download_cc_shard) use with this downloader; it also
    sizes the pool of idle keep-alive connections. `close()` (or a `with` block) closes those.
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
        if deadline_s is not None and deadline_s <= 0:
            raise ValueError(f"download deadline_s must be > 0, got {deadline_s}")
        self.timeout_s = float(timeout_s)
        self.retries = int(retries)
        self.max_bytes = int(max_bytes)
        self.threads = int(threads)
        self.backoff_s = float(backoff_s)
        self.max_backoff_s = float(max_backoff_s)
        self.max_redirects = int(max_redirects)
        self.deadline_s = float(deadline_s) if deadline_s is not None else 4.0 * self.timeout_s
        if not user_agent.isprintable() or not user_agent.isascii():
            raise ValueError(f"download user_agent must be printable ASCII, got {user_agent!r}")
        self.user_agent = user_agent
        # identity: a compressed body would need decoding, and images do not compress anyway.
        self._headers = {"User-Agent": user_agent, "Accept": "image/*,*/*;q=0.8", "Accept-Encoding": "identity"}
        # Read once, like urllib's ProxyHandler does when its opener is built.
        self._proxies = {
            scheme: _parse_proxy(setting)
            for scheme, setting in urllib.request.getproxies().items()
            if scheme in ("http", "https") and setting
        }
        self._idle = _IdleConnections(limit=2 * self.threads)

    @functools.cached_property
    def _ssl_context(self) -> ssl.SSLContext:
        # Built on the first https URL: loading the CA store costs tens of ms, wasted on an http-only shard.
        return ssl.create_default_context()

    def close(self) -> None:
        """Close the idle keep-alive connections (call it when no fetch is running)."""
        self._idle.close()

    def __enter__(self) -> Downloader:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

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
        """One attempt: the request, and the redirects it leads to, within one deadline."""
        started = time.monotonic()
        visited = {url}
        for _hop in range(self.max_redirects + 1):
            outcome = self._request(url, started)
            if isinstance(outcome, _Attempt):
                return outcome
            location = outcome
            try:
                target = normalize_http_url(urllib.parse.urljoin(url, location))
            except (ValueError, UnicodeError) as err:
                return _fail(st.HTTP_ERROR, f"redirect to an invalid URL {location[:200]!r}: {err}")
            if urllib.parse.urlsplit(target).scheme.lower() not in ("http", "https"):
                return _fail(st.HTTP_ERROR, f"redirect to a URL that is not http(s): {target[:200]}")
            if target in visited:
                return _fail(st.HTTP_ERROR, f"redirect loop: {url[:200]} -> {target[:200]}")
            visited.add(target)
            url = target
        return _fail(st.HTTP_ERROR, f"too many redirects (more than max_redirects {self.max_redirects})")

    def _route(self, url: str) -> tuple[_Route, str, str]:
        """The connection route of `url`, the request-target and the Host header (ValueError for a bad URL)."""
        parts = urllib.parse.urlsplit(url)
        scheme = parts.scheme.lower()
        host = parts.hostname
        if not host:
            raise ValueError("no host")
        port = parts.port or _DEFAULT_PORTS[scheme]  # .port raises ValueError for a bad port
        hostport = parts.netloc.rpartition("@")[2]
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        proxy = self._proxies.get(scheme)
        if proxy is not None and urllib.request.proxy_bypass(hostport):
            proxy = None
        if proxy is not None and scheme == "http":
            # A plain-HTTP proxy takes the absolute URL; https goes through a CONNECT tunnel instead.
            target = f"http://{hostport}{target}"
        http1.check_request_text("URL host", hostport)
        http1.check_request_text("URL path", target)
        return _Route(scheme, host, port, proxy), target, hostport

    def _new_connection(self, route: _Route, deadline: float) -> http1.Connection:
        direct = route.proxy is None
        host, port = (route.host, route.port) if direct else (route.proxy.host, route.proxy.port)
        if route.scheme != "https":
            return http1.Connection.open(host, port, self.timeout_s, deadline)
        tunnel = None
        if not direct:  # the proxy itself is spoken to in plain HTTP, and asked for a tunnel
            authority = f"[{route.host}]:{route.port}" if ":" in route.host else f"{route.host}:{route.port}"
            tunnel_headers = {"Proxy-Authorization": route.proxy.authorization} if route.proxy.authorization else {}
            tunnel = (authority, tunnel_headers)
        return http1.Connection.open(
            host, port, self.timeout_s, deadline, tls=self._ssl_context, tls_host=route.host, tunnel=tunnel
        )

    def _request(self, url: str, started: float) -> _Attempt | str:
        """GET `url` once; an _Attempt, or the Location of a redirect to follow."""
        try:
            route, target, host = self._route(url)
        except (ValueError, KeyError) as err:
            return _fail(st.UNSUPPORTED_URL, f"invalid URL ({err}): {url[:200]}")
        headers = self._headers
        if route.proxy is not None and route.scheme == "http" and route.proxy.authorization:
            headers = {**headers, "Proxy-Authorization": route.proxy.authorization}
        deadline = started + self.deadline_s
        connection = self._idle.take(route)
        keep_alive = False
        try:
            if connection is not None:
                connection.deadline = deadline
                try:
                    connection.send_request("GET", target, host, headers)
                    response = connection.read_head()
                except _STALE_CONNECTION_ERRORS:
                    connection.close()
                    connection = None
            if connection is None:
                connection = self._new_connection(route, deadline)
                connection.send_request("GET", target, host, headers)
                response = connection.read_head()
            outcome, keep_alive = self._read_response(connection, response)
            return outcome
        except http1.BodyTooLarge:
            return _fail(st.TOO_LARGE, f"body exceeds max_bytes {self.max_bytes}")
        except http1.DeadlineExceeded:
            return _fail(st.TIMEOUT, f"transfer took longer than {self.deadline_s:g}s", transient=True)
        except http1.IncompleteBody as err:
            return _fail(st.CONNECTION_ERROR, str(err), transient=True)
        except http1.ProtocolError as err:
            return _fail(st.CONNECTION_ERROR, f"bad HTTP response: {err}")
        except OSError as err:
            return self._classify_os_error(err)
        except (ValueError, UnicodeError) as err:
            return _fail(st.UNSUPPORTED_URL, f"invalid URL: {err}")
        finally:
            if connection is not None:
                if keep_alive:
                    self._idle.put(route, connection)
                else:
                    connection.close()

    def _read_response(self, connection: http1.Connection, response: http1.Response) -> tuple[_Attempt | str, bool]:
        """The outcome (or a redirect's Location) and whether the connection may serve another request."""
        code = response.code
        if 200 <= code < 300:
            if response.length is not None and response.length > self.max_bytes:
                return _fail(st.TOO_LARGE, f"Content-Length {response.length} > max_bytes {self.max_bytes}"), False
            data = connection.read_body(response, self.max_bytes)
            return _Attempt(FetchResult(data, st.OK, ""), False), connection.reusable(response)
        reusable = connection.discard_body(response, _MAX_DISCARDED_BYTES)
        if code in _REDIRECT_CODES:
            location = response.header("Location")
            if not location:
                return _fail(st.HTTP_ERROR, f"HTTP {code} redirect without a Location header"), reusable
            return location, reusable
        return self._classify_http_status(code, response.reason, response), reusable

    @staticmethod
    def _classify_http_status(code: int, reason: str, response: http1.Response) -> _Attempt:
        if code in (404, 410):
            return _fail(st.NOT_FOUND, f"HTTP {code} {reason}")
        if 300 <= code < 400:  # 300, 304, 305...: nothing this client can follow
            return _fail(st.HTTP_ERROR, f"redirect failed: HTTP {code} {reason}")
        transient = code >= 500 or code in (408, 429)
        return _fail(st.HTTP_ERROR, f"HTTP {code} {reason}", transient, _retry_after_seconds(response))

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
