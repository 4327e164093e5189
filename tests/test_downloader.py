"""The downloader's keep-alive connections, redirects and proxies, and the resizer's JPEG draft decode.

The behaviour every CC row relies on (statuses for 404, retries, timeouts, caps, file URLs) is
tested in test_data.py; this file tests how the downloader gets there (connections reused, closed
after errors, redirects followed by hand, proxies from the environment) and that decoding a JPEG
at reduced scale keeps the output the same.
"""

from __future__ import annotations

import http.server
import io
import math
import threading
import time
import urllib.parse

import numpy as np
import pytest
from PIL import Image, JpegImagePlugin

from vlbert_core.data import status as st
from vlbert_core.data.downloader import Downloader, _IdleConnections
from vlbert_core.data.resizer import RESAMPLING, ImageRejected, resize_image

PAYLOAD = b"\xff\xd8 not really a jpeg, but bytes the client must return intact \xff\xd9" * 50


class _KeepAliveHandler(http.server.BaseHTTPRequestHandler):
    """HTTP/1.1 with keep-alive. Routes: /img/<n>, /missing (404), /rel (relative redirect),
    /chain/<k> (redirects to /chain/<k+1>), /a <-> /b (a loop), /ftp (redirect to ftp://),
    /truncated (closes mid-body), /unsized (no Content-Length, 5000 bytes, then close)."""

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
    for name in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY", "all_proxy", "ALL_PROXY", "no_proxy", "NO_PROXY"):
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

    ftp = downloader.fetch(f"{server}/ftp")
    assert ftp.status == st.HTTP_ERROR and "not http(s)" in ftp.error
    assert _downloader(max_redirects=0).fetch(f"{server}/rel").status == st.HTTP_ERROR
    downloader.close()


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


def test_idle_connection_pool_is_bounded():
    class FakeConnection:
        closed = False

        def close(self):
            self.closed = True

    pool = _IdleConnections(limit=2)
    first, second, third = FakeConnection(), FakeConnection(), FakeConnection()
    pool.put(("a",), first)
    pool.put(("b",), second)
    pool.put(("a",), third)  # over the limit: the least recently returned host ("b") loses its connection
    assert second.closed and not first.closed and not third.closed
    assert pool.take(("b",)) is None
    assert pool.take(("a",)) is third and pool.take(("a",)) is first and pool.take(("a",)) is None
    pool.put(("c",), second)
    pool.close()
    assert pool.take(("c",)) is None


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
