"""The downloader's own HTTP/1.1: framing (Content-Length, chunked, to the close), interim
responses, HTTP/1.0, malformed responses, and https direct and through a CONNECT proxy.

The servers here write canned bytes on raw sockets, so each case is exactly the response it
names; every one of them listens on 127.0.0.1 only and ends with its test.
"""

from __future__ import annotations

import shutil
import socket
import ssl
import subprocess
import threading
import urllib.parse

import pytest

from vlbert_core.data import http1
from vlbert_core.data import status as st
from vlbert_core.data.downloader import Downloader

BODY = bytes(range(256)) * 40  # 10 KiB with every byte value


def _chunked(body: bytes, size: int) -> bytes:
    parts = [b"%x;note=x\r\n%s\r\n" % (len(body[i : i + size]), body[i : i + size]) for i in range(0, len(body), size)]
    return b"".join(parts) + b"0\r\nX-Trailer: yes\r\n\r\n"


RESPONSES = {
    "/plain": b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(BODY), BODY),
    "/chunked": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + _chunked(BODY, 3000),
    "/early-hints": b"HTTP/1.1 103 Early Hints\r\nLink: </x>\r\n\r\n"
    + b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(BODY), BODY),
    "/http10": b"HTTP/1.0 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(BODY), BODY),
    "/to-close": b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n" + BODY,
    "/not-http": b"SSH-2.0-OpenSSH_9.6\r\n\r\n",
    "/bad-length": b"HTTP/1.1 200 OK\r\nContent-Length: 12, 13\r\n\r\n0123456789ab",
    "/huge-head": b"HTTP/1.1 200 OK\r\n" + b"X-Filler: " + b"y" * (70 * 1024) + b"\r\n\r\n",
    "/short-chunk": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n1000\r\nonly a little",
    "/redirect-chunked": b"HTTP/1.1 302 Found\r\nLocation: /plain\r\nTransfer-Encoding: chunked\r\n\r\n"
    + _chunked(b"moved", 5),
}
_CLOSES_AFTER = {"/http10", "/to-close", "/not-http", "/bad-length", "/huge-head", "/short-chunk"}


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
    """Answers GET <path> with RESPONSES[path], keeping the connection open unless the response
    ends it; optionally over TLS. Counts connections and records request lines."""

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
                conn.sendall(RESPONSES.get(path, b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n"))
                if path in _CLOSES_AFTER:
                    break
        except (OSError, ssl.SSLError):
            pass
        finally:
            conn.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self.listener.close()


class _ConnectProxy:
    """A CONNECT-only proxy: answers 200 and relays bytes both ways; records what was asked."""

    def __init__(self):
        self.requests: list[tuple[str, str | None]] = []  # (CONNECT target, Proxy-Authorization)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(5)
        self.port = self.listener.getsockname()[1]
        threading.Thread(target=self._serve_one, daemon=True).start()

    def _serve_one(self) -> None:
        try:
            client, _ = self.listener.accept()
        except OSError:
            return
        client.settimeout(5)
        buffer = bytearray()
        while b"\r\n\r\n" not in buffer:
            buffer += client.recv(65536)
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


@pytest.fixture()
def canned(no_proxy):
    server = _CannedServer()
    yield server
    server.close()


def _downloader(**options) -> Downloader:
    return Downloader(**{"timeout_s": 2, "retries": 0, "max_bytes": 1_000_000, "threads": 1, **options})


def test_bodies_framed_by_length_chunks_and_close(canned):
    base = f"http://127.0.0.1:{canned.port}"
    with _downloader() as downloader:
        for path in ("/plain", "/chunked", "/early-hints", "/plain"):
            result = downloader.fetch(base + path)
            assert (result.status, result.data) == (st.OK, BODY), path
        assert canned.connections == 1  # chunked and interim responses keep the connection usable
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
        ("/not-http", st.CONNECTION_ERROR, "not an HTTP/1.x status line"),
        ("/bad-length", st.CONNECTION_ERROR, "bad Content-Length"),
        ("/huge-head", st.CONNECTION_ERROR, "response head longer than"),
        ("/short-chunk", st.CONNECTION_ERROR, "mid-body"),
    ],
)
def test_malformed_responses_end_with_a_status(canned, path, status, words):
    with _downloader() as downloader:
        result = downloader.fetch(f"http://127.0.0.1:{canned.port}{path}")
    assert result.status == status and words in result.error and result.data is None


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


def test_parse_head_folds_repeats_and_frames():
    response = http1._parse_head(
        b"HTTP/1.1 200 OK\r\nX-Folded: one\r\n  two\r\nVary: a\r\nvary: b\r\nno colon here\r\nContent-Length: 5"
    )
    assert response.header("x-folded") == "one two" and response.header("Vary") == "a, b"
    assert (response.length, response.chunked, response.will_close) == (5, False, False)
    no_content = http1._parse_head(b"HTTP/1.1 204 No Content\r\nContent-Length: 99")
    assert no_content.length == 0  # 204 has no body, whatever it says
    unframed = http1._parse_head(b"HTTP/1.1 200 OK")
    assert unframed.length is None and unframed.will_close  # the body runs to the close
    keep = http1._parse_head(b"HTTP/1.0 200 OK\r\nConnection: Keep-Alive\r\nContent-Length: 0")
    assert not keep.will_close


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


@pytest.fixture()
def tls_server(certificate, no_proxy):
    cert, key = certificate
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    server = _CannedServer(tls=context)
    yield server
    server.close()


def _trusting(downloader: Downloader, cert) -> Downloader:
    downloader._ssl_context = ssl.create_default_context(cafile=str(cert))  # replaces the cached system CA store
    return downloader


def test_https_verifies_the_certificate_and_reuses_the_connection(tls_server, certificate):
    url = f"https://127.0.0.1:{tls_server.port}/chunked"
    with _downloader() as untrusting:
        refused = untrusting.fetch(url)
    assert refused.status == st.CONNECTION_ERROR and "TLS error" in refused.error and "verify" in refused.error
    with _trusting(_downloader(), certificate[0]) as downloader:
        for _ in range(3):
            assert downloader.fetch(url).data == BODY
    assert tls_server.connections == 2  # the refused one, then one for all three


def test_https_through_a_connect_proxy(tls_server, certificate, monkeypatch):
    proxy = _ConnectProxy()
    try:
        monkeypatch.setenv("https_proxy", f"http://user:secret@127.0.0.1:{proxy.port}")
        with _trusting(_downloader(), certificate[0]) as downloader:
            result = downloader.fetch(f"https://127.0.0.1:{tls_server.port}/plain")
        assert (result.status, result.data) == (st.OK, BODY)
        assert proxy.requests == [(f"127.0.0.1:{tls_server.port}", "Basic dXNlcjpzZWNyZXQ=")]
    finally:
        proxy.close()
