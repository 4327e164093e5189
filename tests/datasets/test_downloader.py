"""The downloader over urllib3 against loopback servers, and the resizer's JPEG draft decode.

The behaviour every CC row relies on (statuses for 404, retries, timeouts, caps, file URLs) is
tested in test_data.py and, through the whole shard stage, in test_cc_shard.py. This file tests
how the downloader gets there: keep-alive connections reused and dropped after errors, redirects
followed by hand, proxies from the environment, HTTP/1.x framing, and hostile servers (bad chunk
sizes, decompression bombs, dripping heads and bodies, an https:// proxy spoken to in clear).
The canned servers write exact bytes on raw sockets; every one listens on 127.0.0.1 only and
ends with its test.
"""

from __future__ import annotations

import gzip
import http.server
import io
import math
import shutil
import socket
import ssl
import subprocess
import threading
import time
import urllib.parse
import zlib

import numpy as np
import pytest
from PIL import Image, JpegImagePlugin

from vlbert_core.data import status as st
from vlbert_core.data.downloader import Downloader
from vlbert_core.data.resizer import RESAMPLING, ImageRejected, resize_image

PAYLOAD = b"\xff\xd8 not really a jpeg, but bytes the client must return intact \xff\xd9" * 50
BODY = bytes(range(256)) * 40  # 10 KiB with every byte value


class _KeepAliveHandler(http.server.BaseHTTPRequestHandler):
    """HTTP/1.1 with keep-alive. Routes: /img/<n>, /missing (404), /rel (relative redirect),
    /chain/<k> (redirects to /chain/<k+1>), /a <-> /b (a loop), /ftp and /file (redirects to
    ftp:// and file://), /truncated (closes mid-body), /unsized (no Content-Length, 5000 bytes,
    then close)."""

    protocol_version = "HTTP/1.1"
    connections = 0
    requests: list[tuple[str, str | None]] = []  # (request-target, Proxy-Authorization)
    lock = threading.Lock()

    def setup(self):
        super().setup()
        with self.lock:
            type(self).connections += 1

    def log_message(self, *args):
        pass

    def _send(self, code, body=b"", headers=()):
        self.send_response(code)
        for name, value in headers:
            self.send_header(name, value)
        if not any(name == "Content-Length" for name, _ in headers):
            self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        with self.lock:
            self.requests.append((self.path, self.headers.get("Proxy-Authorization")))
        path = urllib.parse.urlsplit(self.path).path  # a proxy is sent the absolute URL
        if path.startswith("/img/"):
            self._send(200, PAYLOAD, [("Content-Type", "image/jpeg")])
        elif path == "/missing":
            self._send(404, b"not here")
        elif path == "/rel":
            self._send(302, headers=[("Location", "img/7")])
        elif path.startswith("/chain/"):
            self._send(302, headers=[("Location", f"/chain/{int(path.rsplit('/', 1)[1]) + 1}")])
        elif path in ("/a", "/b"):
            self._send(302, headers=[("Location", "/b" if path == "/a" else "/a")])
        elif path == "/ftp":
            self._send(301, headers=[("Location", "ftp://example.org/x.jpg")])
        elif path == "/file":
            self._send(302, headers=[("Location", "file:///etc/passwd")])
        elif path == "/truncated":
            self._send(200, PAYLOAD[:10], [("Content-Length", "1000")])
            self.close_connection = True
        elif path == "/unsized":
            self._send(200, b"x" * 5000, [("Content-Length", None), ("Connection", "close")])
            self.close_connection = True
        else:
            self._send(404, b"no such route")

    def send_header(self, keyword, value):
        if value is not None:  # Content-Length None: send none
            super().send_header(keyword, value)


class _ShortIdleHandler(_KeepAliveHandler):
    timeout = 0.2  # the server drops a keep-alive connection idle this long, as real servers do


def _start(handler) -> tuple[http.server.ThreadingHTTPServer, str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


@pytest.fixture()
def server(monkeypatch):
    for name in ("no_proxy", "NO_PROXY"):
        monkeypatch.delenv(name, raising=False)
    _KeepAliveHandler.connections = 0
    _KeepAliveHandler.requests = []
    _ShortIdleHandler.connections = 0
    running, base = _start(_KeepAliveHandler)
    yield base
    running.shutdown()
    running.server_close()


def _downloader(**options) -> Downloader:
    return Downloader(**{"timeout_s": 2, "retries": 0, "max_bytes": 1_000_000, "threads": 2, **options})


def test_one_connection_serves_many_requests(server):
    with _downloader() as downloader:
        for index in range(5):
            result = downloader.fetch(f"{server}/img/{index}")
            assert result.status == st.OK and result.data == PAYLOAD
        assert downloader.fetch(f"{server}/missing").status == st.NOT_FOUND  # a short error body is read ...
        assert downloader.fetch(f"{server}/img/9").status == st.OK  # ... so the connection goes on
    assert _KeepAliveHandler.connections == 1


def test_connection_is_replaced_after_an_error(server):
    with _downloader() as downloader:
        truncated = downloader.fetch(f"{server}/truncated")
        assert truncated.status == st.CONNECTION_ERROR and "mid-body" in truncated.error
        assert downloader.fetch(f"{server}/img/1").data == PAYLOAD
    assert _KeepAliveHandler.connections == 2


def test_a_connection_the_server_closed_meanwhile_is_replaced_without_failing(server):
    idle_server, base = _start(_ShortIdleHandler)
    try:
        with _downloader() as downloader:  # retries=0: the second fetch must not need a retry
            assert downloader.fetch(f"{base}/img/1").status == st.OK
            time.sleep(0.6)  # the server has closed the idle connection by now
            second = downloader.fetch(f"{base}/img/2")
            assert second.status == st.OK and second.data == PAYLOAD
        assert _ShortIdleHandler.connections == 2
    finally:
        idle_server.shutdown()
        idle_server.server_close()


def test_redirects_are_followed_by_hand(server):
    downloader = _downloader(max_redirects=3)
    relative = downloader.fetch(f"{server}/rel")
    assert relative.status == st.OK and relative.data == PAYLOAD
    assert _KeepAliveHandler.requests[-1][0] == "/img/7"  # "img/7" resolved against /rel

    too_many = downloader.fetch(f"{server}/chain/10")
    assert too_many.status == st.HTTP_ERROR and "too many redirects" in too_many.error
    assert [path for path, _ in _KeepAliveHandler.requests].count("/chain/13") == 1
    assert "/chain/14" not in [path for path, _ in _KeepAliveHandler.requests]  # 1 request + 3 hops

    loop = downloader.fetch(f"{server}/a")
    assert loop.status == st.HTTP_ERROR and "redirect loop" in loop.error
    assert [path for path, _ in _KeepAliveHandler.requests][-2:] == ["/a", "/b"]  # stopped when /a came round
    assert _downloader(max_redirects=0).fetch(f"{server}/rel").status == st.HTTP_ERROR
    downloader.close()


@pytest.mark.parametrize("allow_file_urls", [False, True])
def test_redirects_and_urls_to_other_schemes_are_refused(server, tmp_path, allow_file_urls):
    picture = tmp_path / "secret.jpg"
    picture.write_bytes(PAYLOAD)
    with _downloader(allow_file_urls=allow_file_urls) as downloader:
        ftp = downloader.fetch(f"{server}/ftp")
        assert ftp.status == st.REFUSED_SCHEME and "redirect to a ftp URL refused" in ftp.error
        to_file = downloader.fetch(f"{server}/file")  # refused even where file:// rows are read
        assert to_file.status == st.REFUSED_SCHEME and "redirect to a file URL refused" in to_file.error
        direct = downloader.fetch(picture.as_uri())
        if allow_file_urls:
            assert direct.status == st.OK and direct.data == PAYLOAD
        else:
            assert direct.status == st.REFUSED_SCHEME and "allow_file_urls is false" in direct.error
        for url, scheme in [("ftp://example.org/x.jpg", "'ftp'"), ("gopher://h/x", "'gopher'"), ("data:,x", "'data'")]:
            refused = downloader.fetch(url)
            assert refused.status == st.REFUSED_SCHEME and scheme in refused.error, url
        assert downloader.fetch("//example.org/x.jpg").status == st.UNSUPPORTED_URL  # no scheme at all


def test_size_cap_holds_for_a_body_without_content_length(server):
    with _downloader(max_bytes=1000) as downloader:
        assert downloader.fetch(f"{server}/unsized").status == st.TOO_LARGE
    with _downloader(max_bytes=10_000) as downloader:
        assert downloader.fetch(f"{server}/unsized").data == b"x" * 5000


def test_proxy_from_the_environment_and_no_proxy(server, monkeypatch):
    proxy_port = urllib.parse.urlsplit(server).port
    monkeypatch.setenv("http_proxy", f"http://user:secret@127.0.0.1:{proxy_port}")
    with _downloader() as downloader:
        result = downloader.fetch("http://images.example.invalid/img/3")  # never resolved: the proxy is asked
    assert result.status == st.OK and result.data == PAYLOAD
    target, authorization = _KeepAliveHandler.requests[-1]
    assert target == "http://images.example.invalid/img/3"
    assert authorization == "Basic dXNlcjpzZWNyZXQ="  # base64("user:secret")

    monkeypatch.setenv("http_proxy", "http://127.0.0.1:9")  # nothing listens there
    monkeypatch.setenv("no_proxy", "127.0.0.1")
    with _downloader() as downloader:
        assert downloader.fetch(f"{server}/img/4").status == st.OK  # bypassed: straight to the server
    assert _KeepAliveHandler.requests[-1][0] == "/img/4"

    monkeypatch.setenv("http_proxy", "socks5://user:secret@127.0.0.1:1080")
    with pytest.raises(ValueError, match="http_proxy from the environment: proxy scheme 'socks5'") as err:
        _downloader()
    assert "secret" not in str(err.value)


# -- HTTP/1.x framing and hostile servers, on raw sockets -------------------------------------------


def _chunked(body: bytes, size: int) -> bytes:
    parts = [b"%x;note=x\r\n%s\r\n" % (len(body[i : i + size]), body[i : i + size]) for i in range(0, len(body), size)]
    return b"".join(parts) + b"0\r\nX-Trailer: yes\r\n\r\n"


def _head(*lines: str) -> bytes:
    return ("\r\n".join(("HTTP/1.1 200 OK",) + lines) + "\r\n\r\n").encode("latin-1")


GZIP_BODY = gzip.compress(BODY)
# 64 MB of zeros in about 64 kB: far past any cap once decoded.
GZIP_BOMB = gzip.compress(bytes(64 << 20), compresslevel=9)
DEFLATE_BOMB = zlib.compress(bytes(64 << 20), 9)


def _alternating_chunks() -> bytes:
    """A negative chunk, then a positive one, nine times: int(x, 16) took it as 13,500 bytes 'ok'."""
    return b"".join(b"-5dc\r\n" + b"x" * 1500 + b"\r\n" + b"5dc\r\n" + b"y" * 1500 + b"\r\n" for _ in range(9)) + b"0\r\n\r\n"


RESPONSES = {
    "/plain": _head(f"Content-Length: {len(BODY)}") + BODY,
    "/chunked": _head("Transfer-Encoding: chunked") + _chunked(BODY, 3000),
    "/early-hints": b"HTTP/1.1 103 Early Hints\r\nLink: </x>\r\n\r\n" + _head(f"Content-Length: {len(BODY)}") + BODY,
    "/http10": b"HTTP/1.0 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(BODY), BODY),
    "/to-close": _head("Connection: close") + BODY,
    "/gzip": _head("Content-Encoding: gzip", f"Content-Length: {len(GZIP_BODY)}") + GZIP_BODY,
    "/redirect-chunked": b"HTTP/1.1 302 Found\r\nLocation: /plain\r\nTransfer-Encoding: chunked\r\n\r\n"
    + _chunked(b"moved", 5),
    # hostile or broken
    "/not-http": b"SSH-2.0-OpenSSH_9.6\r\n\r\n",
    "/bad-length": _head("Content-Length: 12, 13") + b"0123456789ab",
    "/huge-head": _head("X-Filler: " + "y" * (70 * 1024)),
    "/short-chunk": _head("Transfer-Encoding: chunked") + b"1000\r\nonly a little",
    "/negative-chunks": _head("Transfer-Encoding: chunked") + _alternating_chunks(),
    "/plus-chunk": _head("Transfer-Encoding: chunked") + b"+5dc\r\n" + b"x" * 1500 + b"\r\n0\r\n\r\n",
    "/hex-prefixed-chunk": _head("Transfer-Encoding: chunked") + b"0x5dc\r\n" + b"x" * 1500 + b"\r\n0\r\n\r\n",
    "/overlong-chunk": _head("Transfer-Encoding: chunked") + b"1" * 17 + b"\r\n" + b"x" * 1500,
    "/gzip-bomb": _head("Content-Encoding: gzip", f"Content-Length: {len(GZIP_BOMB)}") + GZIP_BOMB,
    "/deflate-bomb-chunked": _head("Content-Encoding: deflate", "Transfer-Encoding: chunked")
    + _chunked(DEFLATE_BOMB, 8192),
    "/oversize": _head(f"Content-Length: {2 * len(BODY)}") + BODY + BODY,
}
_CLOSES_AFTER = {"/http10", "/to-close", "/not-http", "/bad-length", "/huge-head", "/short-chunk", "/overlong-chunk"}
# Dripped a byte at a time, 20 ms apart: each read is quick, the whole is not.
DRIPPED = {
    "/drip-head": _head("Content-Length: 5", "X-Slow: " + "z" * 400) + b"hello",
    "/drip-body": _head("Content-Length: 400") + b"b" * 400,
}


def _read_request_head(conn: socket.socket, buffer: bytearray) -> str | None:
    """The request line of the next request on `conn` (None when the client is gone)."""
    while b"\r\n\r\n" not in buffer:
        data = conn.recv(65536)
        if not data:
            return None
        buffer += data
    head, _, rest = bytes(buffer).partition(b"\r\n\r\n")
    buffer[:] = rest
    return head.split(b"\r\n")[0].decode("latin-1")


class _CannedServer:
    """Answers GET <path> with RESPONSES[path] (or drips DRIPPED[path]), keeping the connection
    open unless the response ends it; optionally over TLS. Counts connections and records request
    lines; `received` holds the first bytes of each connection, as they came."""

    def __init__(self, tls: ssl.SSLContext | None = None):
        self.tls = tls
        self.connections = 0
        self.request_lines: list[str] = []
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(0.2)
        self.port = self.listener.getsockname()[1]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        conn.settimeout(5)
        try:
            if self.tls is not None:
                conn = self.tls.wrap_socket(conn, server_side=True)
            buffer = bytearray()
            while (line := _read_request_head(conn, buffer)) is not None:
                self.request_lines.append(line)
                path = urllib.parse.urlsplit(line.split(" ")[1]).path
                if path in DRIPPED:
                    for index in range(len(DRIPPED[path])):
                        conn.sendall(DRIPPED[path][index : index + 1])
                        time.sleep(0.02)
                    continue
                conn.sendall(RESPONSES.get(path, b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n"))
                if path in _CLOSES_AFTER:
                    break
        except (OSError, ssl.SSLError):
            pass  # the client hung up: what the hostile cases expect
        finally:
            conn.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self.listener.close()


@pytest.fixture()
def canned():
    server = _CannedServer()
    yield server
    server.close()


def test_bodies_framed_by_length_chunks_and_close(canned):
    base = f"http://127.0.0.1:{canned.port}"
    with _downloader(threads=1) as downloader:
        for path in ("/plain", "/chunked", "/early-hints", "/gzip", "/plain"):
            result = downloader.fetch(base + path)
            assert (result.status, result.data) == (st.OK, BODY), path
        assert canned.connections == 1  # chunked, encoded and interim responses keep the connection usable
        for path in ("/http10", "/to-close", "/plain"):
            result = downloader.fetch(base + path)
            assert (result.status, result.data) == (st.OK, BODY), path
        assert canned.connections == 3  # HTTP/1.0 without keep-alive, and Connection: close, end theirs


def test_redirect_with_a_chunked_body(canned):
    with _downloader() as downloader:
        result = downloader.fetch(f"http://127.0.0.1:{canned.port}/redirect-chunked")
    assert (result.status, result.data) == (st.OK, BODY)
    assert canned.request_lines[-1] == "GET /plain HTTP/1.1"


@pytest.mark.parametrize(
    "path, status, words",
    [
        ("/not-http", st.CONNECTION_ERROR, "bad HTTP response"),
        ("/bad-length", st.CONNECTION_ERROR, "Content-Length"),
        ("/huge-head", st.CONNECTION_ERROR, "bad HTTP response"),
        ("/short-chunk", st.CONNECTION_ERROR, "mid-body"),
        ("/negative-chunks", st.CONNECTION_ERROR, "bad chunk size b'-5dc'"),
        ("/plus-chunk", st.CONNECTION_ERROR, "bad chunk size b'+5dc'"),
        ("/hex-prefixed-chunk", st.CONNECTION_ERROR, "bad chunk size b'0x5dc'"),
        ("/overlong-chunk", st.CONNECTION_ERROR, "bad chunk size b'11111111111111111'"),
        ("/gzip-bomb", st.TOO_LARGE, "body exceeds max_bytes 1500 after gzip decoding"),
        ("/deflate-bomb-chunked", st.TOO_LARGE, "body exceeds max_bytes 1500 after deflate decoding"),
        ("/oversize", st.TOO_LARGE, "Content-Length 20480 > max_bytes 1500"),
        ("/drip-head", st.TIMEOUT, "longer than the deadline 0.3s"),
        ("/drip-body", st.TIMEOUT, "longer than the deadline 0.3s"),
    ],
)
def test_hostile_and_malformed_responses_end_with_a_status(canned, path, status, words):
    started = time.monotonic()
    with _downloader(max_bytes=1500, timeout_s=1, deadline_s=0.3) as downloader:
        result = downloader.fetch(f"http://127.0.0.1:{canned.port}{path}")
    assert result.status == status and words in result.error and result.data is None, result
    assert time.monotonic() - started < 1.5  # the drips last 0.1 s a line: the deadline, not the server, ended them


@pytest.mark.parametrize("path", ["/chunked", "/to-close"])
def test_size_cap_holds_for_unsized_bodies(canned, path):
    # /to-close arrives in one send: the whole body is already buffered with the head.
    with _downloader(max_bytes=len(BODY) - 1) as downloader:
        assert downloader.fetch(f"http://127.0.0.1:{canned.port}{path}").status == st.TOO_LARGE


def test_request_line_and_headers_sent(canned):
    with _downloader() as downloader:
        downloader.fetch(f"http://127.0.0.1:{canned.port}/plain?size=big&x=a b")
    assert canned.request_lines[-1] == "GET /plain?size=big&x=a%20b HTTP/1.1"
    with pytest.raises(ValueError):
        Downloader(timeout_s=1, retries=0, max_bytes=10, threads=1, user_agent="x\r\nInjected: yes")


# -- TLS ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def certificate(tmp_path_factory):
    if shutil.which("openssl") is None:
        pytest.skip("openssl is needed to make a test certificate")
    folder = tmp_path_factory.mktemp("tls")
    cert, key = folder / "cert.pem", folder / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
         "-days", "2", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
        check=True, capture_output=True, timeout=60,
    )
    return cert, key


def _server_context(certificate) -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(*certificate)
    return context


@pytest.fixture()
def tls_server(certificate):
    server = _CannedServer(tls=_server_context(certificate))
    yield server
    server.close()


class _ConnectProxy:
    """A CONNECT-only proxy, optionally itself behind TLS: answers 200 and relays bytes both ways.
    Records what was asked, and the first bytes each client sent, as they came over the wire."""

    def __init__(self, tls: ssl.SSLContext | None = None):
        self.tls = tls
        self.requests: list[tuple[str, str | None]] = []  # (CONNECT target, Proxy-Authorization)
        self.wire: list[bytes] = []
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(5)
        self.port = self.listener.getsockname()[1]
        threading.Thread(target=self._serve_one, daemon=True).start()

    def _serve_one(self) -> None:
        try:
            client, _ = self.listener.accept()
            client.settimeout(5)
            first = client.recv(65536, socket.MSG_PEEK)
            self.wire.append(first)
            if self.tls is not None:
                client = self.tls.wrap_socket(client, server_side=True)
            buffer = bytearray()
            while b"\r\n\r\n" not in buffer:
                data = client.recv(65536)
                if not data:
                    return
                buffer += data
        except (OSError, ssl.SSLError):
            return
        lines = bytes(buffer).split(b"\r\n\r\n")[0].decode("latin-1").split("\r\n")
        auth = next((line.split(":", 1)[1].strip() for line in lines if line.lower().startswith("proxy-authorization:")), None)
        target = lines[0].split(" ")[1]
        self.requests.append((target, auth))
        host, port = target.rsplit(":", 1)
        upstream = socket.create_connection((host, int(port)), timeout=5)
        client.sendall(b"HTTP/1.1 200 Connection established\r\n\r\n")

        def pipe(source, sink):
            try:
                while data := source.recv(65536):
                    sink.sendall(data)
            except OSError:
                pass
            finally:
                sink.close()

        threading.Thread(target=pipe, args=(upstream, client), daemon=True).start()
        pipe(client, upstream)

    def close(self) -> None:
        self.listener.close()


def test_https_verifies_the_certificate_and_reuses_the_connection(tls_server, certificate, monkeypatch):
    url = f"https://127.0.0.1:{tls_server.port}/chunked"
    with _downloader() as untrusting:
        refused = untrusting.fetch(url)
    assert refused.status == st.CONNECTION_ERROR and "TLS error" in refused.error and "verify" in refused.error
    monkeypatch.setenv("SSL_CERT_FILE", str(certificate[0]))  # read when the downloader is made, as urllib does
    with _downloader() as downloader:
        for _ in range(3):
            assert downloader.fetch(url).data == BODY
    assert tls_server.connections == 2  # the refused one, then one for all three


@pytest.mark.parametrize("proxy_tls", [False, True])
def test_https_through_a_connect_proxy(tls_server, certificate, monkeypatch, proxy_tls):
    proxy = _ConnectProxy(tls=_server_context(certificate) if proxy_tls else None)
    try:
        monkeypatch.setenv("SSL_CERT_FILE", str(certificate[0]))
        monkeypatch.setenv("https_proxy", f"{'https' if proxy_tls else 'http'}://user:secret@127.0.0.1:{proxy.port}")
        with _downloader() as downloader:
            result = downloader.fetch(f"https://127.0.0.1:{tls_server.port}/plain")
        assert (result.status, result.data) == (st.OK, BODY)
        assert proxy.requests == [(f"127.0.0.1:{tls_server.port}", "Basic dXNlcjpzZWNyZXQ=")]
        # An https:// proxy is greeted with a TLS handshake (record type 22), never a CONNECT in clear.
        assert proxy.wire[0].startswith(b"\x16" if proxy_tls else b"CONNECT")
    finally:
        proxy.close()


def test_an_https_proxy_never_sees_credentials_in_clear(canned, monkeypatch):
    """A plain-text listener posing as an https:// proxy: the client's first bytes are a TLS
    handshake, so the handshake fails and the row fails; the password never crossed the wire."""
    proxy = _ConnectProxy()  # speaks no TLS: the client's handshake fails against it
    try:
        monkeypatch.setenv("https_proxy", f"https://user:secret@127.0.0.1:{proxy.port}")
        monkeypatch.setenv("http_proxy", f"https://user:secret@127.0.0.1:{proxy.port}")
        with _downloader() as downloader:
            result = downloader.fetch(f"http://127.0.0.1:{canned.port}/plain")
        assert result.status == st.CONNECTION_ERROR and result.data is None
        assert proxy.wire and proxy.wire[0].startswith(b"\x16")
        assert all(b"secret" not in data and b"dXNlcjpzZWNyZXQ=" not in data for data in proxy.wire)
    finally:
        proxy.close()


# -- resizer: JPEG draft decode ------------------------------------------------------------------


def photo_jpeg(width: int, height: int, seed: int = 0, **save) -> bytes:
    """Smooth colour field plus noise: enough detail that a wrong resampling shows."""
    rng = np.random.default_rng(seed)
    base = Image.fromarray(rng.integers(0, 256, (3, 4, 3), dtype=np.uint8), "RGB").resize(
        (width, height), Image.Resampling.BICUBIC
    )
    pixels = np.asarray(base, np.float32) + 6 * rng.standard_normal((height, width, 3), dtype=np.float32)
    buffer = io.BytesIO()
    Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8), "RGB").save(buffer, format="JPEG", quality=92, **save)
    return buffer.getvalue()


@pytest.fixture()
def draft_scales(monkeypatch):
    """The DCT scale (1, 2, 4, 8) of each JPEG decoded through resize_image."""
    scales: list[int] = []
    original = JpegImagePlugin.JpegImageFile.draft

    def spy(self, mode, size):
        width = self.size[0]
        result = original(self, mode, size)
        scales.append(round(width / result[1][2]) if result else 1)
        return result

    monkeypatch.setattr(JpegImagePlugin.JpegImageFile, "draft", spy)
    return scales


def full_decode_resize(data: bytes, size: tuple[int, int], box=None) -> np.ndarray:
    with Image.open(io.BytesIO(data)) as image:
        return np.asarray(image.convert("RGB").resize(size, RESAMPLING, box=box), np.float32)


def test_draft_decode_matches_a_full_decode(draft_scales):
    data = photo_jpeg(1600, 1000)
    out = resize_image(data, 384, "keep_ratio")
    assert draft_scales == [4]  # 1600 -> 400 >= 384: libjpeg decodes at 1/4
    assert (out.width, out.height, out.original_width, out.original_height) == (384, 240, 1600, 1000)
    ours = np.asarray(Image.open(io.BytesIO(out.jpeg)), np.float32)
    assert np.abs(ours - full_decode_resize(data, (384, 240))).mean() < 2.5  # grey levels, JPEG re-encode included

    crop = resize_image(data, 200, "center_crop")
    assert draft_scales[-1] == 4  # shorter side 1000 -> 250 >= 200
    assert (crop.width, crop.height, crop.original_width, crop.original_height) == (200, 200, 1600, 1000)
    ours = np.asarray(Image.open(io.BytesIO(crop.jpeg)), np.float32)
    assert np.abs(ours - full_decode_resize(data, (200, 200), box=(300, 0, 1300, 1000))).mean() < 2.5


@pytest.mark.parametrize("width, height", [(770, 500), (767, 500), (1024, 768), (801, 1203), (3000, 380)])
def test_draft_never_decodes_below_the_output_size(width, height, draft_scales):
    out = resize_image(photo_jpeg(width, height), 384, "keep_ratio")
    scale = 384 / max(width, height)
    assert (out.width, out.height) == (max(1, round(width * scale)), max(1, round(height * scale)))
    assert math.ceil(width / draft_scales[0]) >= out.width and math.ceil(height / draft_scales[0]) >= out.height
    assert (out.original_width, out.original_height) == (width, height)
    assert draft_scales[0] == {(770, 500): 2, (767, 500): 1, (1024, 768): 2, (801, 1203): 2, (3000, 380): 4}[
        (width, height)
    ]


def test_exif_rotated_jpeg_reports_its_full_upright_size(draft_scales):
    stored = Image.new("RGB", (1200, 800), (0, 0, 0))
    stored.paste((255, 255, 255), (0, 0, 600, 800))  # white left half, as stored
    exif = Image.Exif()
    exif[0x0112] = 6  # display needs a 90 degree clockwise turn
    buffer = io.BytesIO()
    stored.save(buffer, format="JPEG", exif=exif, quality=95)
    out = resize_image(buffer.getvalue(), 300, "keep_ratio")
    assert draft_scales == [4]  # decoded at 300x200, turned to 200x300: no resampling left to do
    assert (out.original_width, out.original_height) == (800, 1200)  # upright, full resolution
    assert (out.width, out.height) == (200, 300)
    upright = Image.open(io.BytesIO(out.jpeg)).convert("RGB")
    assert min(upright.getpixel((100, 30))) > 200 and max(upright.getpixel((100, 270))) < 60  # left half now on top


def test_pixel_cap_is_checked_before_a_draft_decode(draft_scales):
    with pytest.raises(ImageRejected) as err:
        resize_image(photo_jpeg(1000, 800), 64, max_pixels=500_000)
    assert err.value.status == st.TOO_LARGE and draft_scales == []
