"""One HTTP/1.1 client connection that GETs images: the wire format, and nothing else.

The downloader decides what to fetch, when to retry and what a response means; this module only
opens a connection (plain, TLS, through a proxy or a CONNECT tunnel), sends a GET, reads the
response head and reads a body framed by Content-Length, chunked coding or the end of the
connection, within a per-read timeout and a deadline for the whole exchange.

Why not http.client: for a 130 KB image on a fast link its per-request work (header validation,
an email-package header parser, a file object per response) and our wrapping of it took about
as much CPU as the bytes' own trip through the kernel, 0.2-0.4 ms of the 7 ms an image costs in
all (benchmarks/download.py). A GET that needs no request body, no content coding and no
pipelining is small enough to speak directly.
"""

from __future__ import annotations

import re
import socket
import ssl
import time
from typing import NamedTuple

MAX_HEAD_BYTES = 64 * 1024  # status line and headers; real servers send a few hundred bytes
MAX_HEADERS = 100
MAX_CHUNK_LINE_BYTES = 4096
# A read for a head takes this much at most, so that little of a body goes through the buffer:
# a body of known length is received straight into its own bytes, one copy out of the kernel.
_HEAD_RECV_BYTES = 16 * 1024
_RECV_BYTES = 256 * 1024  # other reads: one recv returns what has arrived; this only caps it
_HEAD_END = re.compile(rb"\r?\n\r?\n")
_STATUS_LINE = re.compile(r"HTTP/1\.(\d) (\d{3})(?: (.*))?")
_NO_BODY_CODES = frozenset({204, 304})
# Request-line and Host characters that would let a URL smuggle extra header lines or requests.
_UNSAFE_IN_REQUEST = re.compile(r"[\x00-\x20\x7f]")


class ProtocolError(Exception):
    """The server's bytes are not an HTTP/1.x response (or break its framing)."""


class IncompleteBody(Exception):
    """The connection ended before the body did."""

    def __init__(self, received: int, expected: int | None):
        super().__init__(f"connection closed mid-body ({received} bytes read)")
        self.received = received
        self.expected = expected


class BodyTooLarge(Exception):
    pass


class DeadlineExceeded(Exception):
    pass


class TunnelRefused(OSError):
    """The proxy answered CONNECT with something other than 200."""


class ClosedBeforeResponse(ConnectionResetError):
    """The server closed the connection without answering: typical of a keep-alive connection
    that the server dropped while it was idle in our pool."""


class Response(NamedTuple):
    code: int
    reason: str
    headers: dict[str, str]  # lower-case names; a repeated header's values joined by ", "
    will_close: bool  # the server ends the connection after this response
    length: int | None  # Content-Length; None when the body is chunked or runs to the close
    chunked: bool

    def header(self, name: str, default: str = "") -> str:
        return self.headers.get(name.lower(), default)


def check_request_text(what: str, text: str) -> None:
    """Refuse a request-target or Host with spaces or control characters (ValueError)."""
    if _UNSAFE_IN_REQUEST.search(text) or not text.isascii():
        raise ValueError(f"{what} has spaces, control or non-ASCII characters: {text[:200]!r}")


def _parse_head(head: bytes) -> Response:
    lines = head.decode("latin-1").split("\n")
    status = _STATUS_LINE.fullmatch(lines[0].rstrip("\r"))
    if status is None:
        raise ProtocolError(f"not an HTTP/1.x status line: {lines[0][:100]!r}")
    minor, code, reason = int(status[1]), int(status[2]), (status[3] or "").strip()
    headers: dict[str, str] = {}
    name = None
    for line in lines[1:]:
        line = line.rstrip("\r")
        if not line:
            continue
        if line[0] in " \t" and name is not None:  # obsolete line folding: a continuation of the last header
            headers[name] += " " + line.strip()
            continue
        name, colon, value = line.partition(":")
        if not colon:
            name = None
            continue  # not a header; lenient like browsers and http.client
        name, value = name.strip().lower(), value.strip()
        headers[name] = f"{headers[name]}, {value}" if name in headers else value
        if len(headers) > MAX_HEADERS:
            raise ProtocolError(f"more than {MAX_HEADERS} headers")
    connection = {token.strip().lower() for token in headers.get("connection", "").split(",")}
    will_close = "close" in connection or (minor == 0 and "keep-alive" not in connection)
    chunked = False
    length = None
    if "transfer-encoding" in headers:
        codings = [token.strip().lower() for token in headers["transfer-encoding"].split(",")]
        chunked = codings[-1] == "chunked"
        will_close = will_close or not chunked  # any other coding: the body runs to the close
    elif "content-length" in headers:
        values = {value.strip() for value in headers["content-length"].split(",")}
        if len(values) != 1 or not next(iter(values)).isdigit():
            raise ProtocolError(f"bad Content-Length {headers['content-length'][:100]!r}")
        length = int(values.pop())
    elif code not in _NO_BODY_CODES:
        will_close = True  # no framing: the body is whatever comes before the close
    if code in _NO_BODY_CODES:
        length, chunked = 0, False
    return Response(code, reason, headers, will_close, length, chunked)


class Connection:
    """A socket with a receive buffer. Every blocking step waits at most `timeout_s`, and none
    starts after `deadline` (a time.monotonic() value the caller sets per exchange)."""

    def __init__(self, sock: socket.socket, timeout_s: float):
        self.sock = sock
        self.timeout_s = timeout_s
        self.deadline = float("inf")
        self._buffer = bytearray()
        self._wait: float | None = None

    @classmethod
    def open(
        cls,
        host: str,
        port: int,
        timeout_s: float,
        deadline: float,
        *,
        tls: ssl.SSLContext | None = None,
        tls_host: str | None = None,
        tunnel: tuple[str, dict[str, str]] | None = None,
    ) -> "Connection":
        """Connect to host:port; `tunnel` (authority, headers) asks that host, a proxy, for a
        CONNECT tunnel first; `tls` then wraps the connection for `tls_host`."""
        wait = min(timeout_s, deadline - time.monotonic())
        if wait <= 0:
            raise DeadlineExceeded
        sock = socket.create_connection((host, port), timeout=wait)
        connection = cls(sock, timeout_s)
        connection.deadline = deadline
        try:
            if tunnel is not None:
                connection._connect_tunnel(*tunnel)
            if tls is not None:
                connection._arm()
                connection.sock = tls.wrap_socket(sock, server_hostname=tls_host)
        except BaseException:
            connection.close()
            raise
        return connection

    def _connect_tunnel(self, authority: str, headers: dict[str, str]) -> None:
        self.send_request("CONNECT", authority, authority, headers)
        response = self.read_head()
        if response.code != 200:
            raise TunnelRefused(f"proxy refused CONNECT {authority}: HTTP {response.code} {response.reason}")
        if self._buffer:
            raise ProtocolError("proxy sent bytes after its CONNECT answer")

    def close(self) -> None:
        self.sock.close()

    def _arm(self) -> None:
        remaining = self.deadline - time.monotonic()
        if remaining <= 0:
            raise DeadlineExceeded
        wait = min(self.timeout_s, remaining)
        if wait != self._wait:  # settimeout is a system call; most waits are the same timeout_s
            self.sock.settimeout(wait)
            self._wait = wait

    def send_request(self, method: str, target: str, host: str, headers: dict[str, str]) -> None:
        lines = [f"{method} {target} HTTP/1.1", f"Host: {host}"]
        lines += [f"{name}: {value}" for name, value in headers.items()]
        self._arm()
        self.sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1"))

    def _receive(self, limit: int = _RECV_BYTES) -> bool:
        """Append what arrives next to the buffer; False at the end of the connection."""
        self._arm()
        data = self.sock.recv(limit)
        self._buffer += data
        return bool(data)

    def read_head(self) -> Response:
        """The next final response's head (1xx interim responses are skipped)."""
        while True:
            scanned = 0
            while (end := _HEAD_END.search(self._buffer, max(0, scanned - 3))) is None:
                if len(self._buffer) > MAX_HEAD_BYTES:
                    break
                scanned = len(self._buffer)
                if not self._receive(_HEAD_RECV_BYTES):
                    if scanned == 0:
                        raise ClosedBeforeResponse("the server closed the connection without a response")
                    raise ProtocolError("connection closed in the middle of the response head")
            if end is None or end.start() > MAX_HEAD_BYTES:
                raise ProtocolError(f"response head longer than {MAX_HEAD_BYTES} bytes")
            head = bytes(self._buffer[: end.start()])
            del self._buffer[: end.end()]
            response = _parse_head(head)
            if not 100 <= response.code < 200:
                return response

    def read_body(self, response: Response, max_bytes: int) -> bytes:
        """The whole body (BodyTooLarge past max_bytes, IncompleteBody if the connection ends early)."""
        if response.chunked:
            return self._read_chunked(max_bytes)
        if response.length is None:
            return self._read_to_close(max_bytes)
        if response.length > max_bytes:
            raise BodyTooLarge
        return self._read_exact(response.length)

    def reusable(self, response: Response) -> bool:
        """After read_body: whether the connection can carry the next request."""
        return not response.will_close and not self._buffer

    def _read_exact(self, size: int) -> bytes:
        got = min(size, len(self._buffer))
        if got == size:
            body = bytes(self._buffer[:size])
            del self._buffer[:size]
            return body
        body = bytearray(size)
        with memoryview(body) as view:
            view[:got] = self._buffer[:got]
            self._buffer.clear()  # it held only the body's start
            while got < size:
                self._arm()
                received = self.sock.recv_into(view[got:])
                if not received:
                    raise IncompleteBody(got, size)
                got += received
        return bytes(body)

    def _read_to_close(self, max_bytes: int) -> bytes:
        # The buffer may already hold the whole body, read along with the head.
        while len(self._buffer) <= max_bytes:
            if not self._receive():
                break
        if len(self._buffer) > max_bytes:
            raise BodyTooLarge
        body = bytes(self._buffer)
        self._buffer.clear()
        return body

    def _read_line(self) -> bytes:
        scanned = 0
        while (end := self._buffer.find(b"\n", scanned)) < 0:
            if len(self._buffer) > MAX_CHUNK_LINE_BYTES:
                raise ProtocolError(f"chunk-size line longer than {MAX_CHUNK_LINE_BYTES} bytes")
            scanned = len(self._buffer)
            if not self._receive():
                raise IncompleteBody(0, None)
        line = bytes(self._buffer[: end + 1])
        del self._buffer[: end + 1]
        return line.rstrip(b"\r\n")

    def _read_chunked(self, max_bytes: int) -> bytes:
        parts: list[bytes] = []
        total = 0
        while True:
            size_text = self._read_line().split(b";", 1)[0].strip()
            try:
                size = int(size_text, 16)
            except ValueError:
                raise ProtocolError(f"bad chunk size {size_text[:40]!r}") from None
            if size == 0:
                while self._read_line():  # trailer fields, up to the empty line
                    pass
                return b"".join(parts)
            total += size
            if total > max_bytes:
                raise BodyTooLarge
            try:
                parts.append(self._read_exact(size))
            except IncompleteBody as err:
                raise IncompleteBody(total - size + err.received, None) from None
            if self._read_line():
                raise ProtocolError("chunk data longer than its size")

    def discard_body(self, response: Response, max_bytes: int) -> bool:
        """Read and drop a short error/redirect body; True if the connection can be reused."""
        if response.will_close or response.chunked or response.length is None or response.length > max_bytes:
            return False
        try:
            self._read_exact(response.length)
        except (OSError, IncompleteBody, DeadlineExceeded):
            return False  # the status is known already; only the connection is lost
        return not self._buffer
