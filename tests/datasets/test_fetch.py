"""vlbert_core.data.fetch against a loopback server: resume with Range, size and checksum checks."""

from __future__ import annotations

import hashlib
import http.server
import random
import threading

import pytest

from vlbert_core.data.fetch import FetchError, FetchSpec, fetch_file

PAYLOAD = random.Random(1).randbytes(300_000)


class RangeHandler(http.server.BaseHTTPRequestHandler):
    """/cut: the first response stops after 100 kB (a dropped connection); later ones honour Range.
    /norange: ignores Range and always sends the whole file. /short: announces more than it has
    in total. /missing: 404. /moved: redirects to /whole; /to-file: to a file:// URL.
    /negative-chunk: a chunked body whose first chunk size is -5dc."""

    requests: list[tuple[str, str | None]] = []
    served_cut = False

    def log_message(self, *args):
        pass

    def do_GET(self):
        range_header = self.headers.get("Range")
        type(self).requests.append((self.path, range_header))
        if self.path == "/missing":
            self.send_error(404)
            return
        if self.path in ("/moved", "/to-file"):
            self.send_response(302)
            self.send_header("Location", "/whole" if self.path == "/moved" else "file:///etc/passwd")
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        if self.path == "/negative-chunk":
            self.send_response(200)
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            self.wfile.write(b"-5dc\r\n" + PAYLOAD[:1500] + b"\r\n0\r\n\r\n")
            return
        start = 0
        if range_header and self.path != "/norange":
            start = int(range_header.removeprefix("bytes=").rstrip("-"))
        body = PAYLOAD[start:]
        total = len(PAYLOAD) + (10 if self.path == "/short" else 0)
        self.send_response(206 if start else 200)
        if start:
            self.send_header("Content-Range", f"bytes {start}-{len(PAYLOAD) - 1}/{total}")
        self.send_header("Content-Length", str(len(body) + total - len(PAYLOAD)))
        self.end_headers()
        if self.path == "/cut" and not type(self).served_cut:
            type(self).served_cut = True
            self.wfile.write(body[:100_000])
            self.wfile.flush()
            self.connection.shutdown(2)  # the client sees the body end early
            return
        self.wfile.write(body)


@pytest.fixture()
def server():
    RangeHandler.requests = []
    RangeHandler.served_cut = False
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), RangeHandler)
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def test_a_dropped_transfer_resumes_with_a_range_request(tmp_path, server):
    digest = "sha256:" + hashlib.sha256(PAYLOAD).hexdigest()
    spec = FetchSpec(f"{server}/cut", str(tmp_path / "cc" / "train.tsv"), len(PAYLOAD), digest)
    path = fetch_file(spec, timeout_s=5, attempts=3, backoff_s=0.01)
    assert path.read_bytes() == PAYLOAD
    assert RangeHandler.requests == [("/cut", None), ("/cut", "bytes=100000-")]
    assert not (tmp_path / "cc" / "train.tsv.part").exists()


def test_a_part_file_from_an_earlier_run_is_continued(tmp_path, server):
    target = tmp_path / "dump.xml.bz2"
    (tmp_path / "dump.xml.bz2.part").write_bytes(PAYLOAD[:12_345])
    fetch_file(FetchSpec(f"{server}/whole", str(target)), timeout_s=5, attempts=1)
    assert target.read_bytes() == PAYLOAD and RangeHandler.requests == [("/whole", "bytes=12345-")]


def test_a_server_without_range_support_restarts_from_zero(tmp_path, server):
    target = tmp_path / "books.tar.bz2"
    (tmp_path / "books.tar.bz2.part").write_bytes(b"stale bytes from another file")
    fetch_file(FetchSpec(f"{server}/norange", str(target)), timeout_s=5, attempts=1)
    assert target.read_bytes() == PAYLOAD


def test_wrong_checksum_size_or_status_fails_and_keeps_no_target(tmp_path, server):
    wrong = FetchSpec(f"{server}/whole", str(tmp_path / "a"), checksum="md5:" + "0" * 32)
    with pytest.raises(FetchError, match=r"md5 is [0-9a-f]{32}, the config expects 0{32}"):
        fetch_file(wrong, timeout_s=5, attempts=1)
    assert not (tmp_path / "a").exists() and not (tmp_path / "a.part").exists()
    with pytest.raises(FetchError, match="got 300000 bytes, the config expects 5;"):
        fetch_file(FetchSpec(f"{server}/whole", str(tmp_path / "b"), bytes=5), timeout_s=5, attempts=1)
    with pytest.raises(FetchError, match=r"gave up after 2 attempts \(connection closed at byte 300000 of 300010"):
        fetch_file(FetchSpec(f"{server}/short", str(tmp_path / "s")), timeout_s=5, attempts=2, backoff_s=0.01)
    assert (tmp_path / "s.part").stat().st_size == len(PAYLOAD), "bytes of a broken transfer are kept for the next run"
    with pytest.raises(FetchError, match="HTTP 404"):
        fetch_file(FetchSpec(f"{server}/missing", str(tmp_path / "c")), timeout_s=5, attempts=3)
    assert [r for r in RangeHandler.requests if r[0] == "/missing"] == [("/missing", None)], "a 404 is final"
    with pytest.raises(FetchError, match="unsupported URL scheme"):
        fetch_file(FetchSpec("ftp://example.org/x", str(tmp_path / "d")))


def test_redirects_are_followed_to_http_only_and_bad_framing_fails(tmp_path, server):
    assert fetch_file(FetchSpec(f"{server}/moved", str(tmp_path / "m")), timeout_s=5, attempts=1).read_bytes() == PAYLOAD
    with pytest.raises(FetchError, match=r"redirect to 'file:///etc/passwd' refused \(http or https only\)"):
        fetch_file(FetchSpec(f"{server}/to-file", str(tmp_path / "f")), timeout_s=5, attempts=3, backoff_s=0.01)
    assert [r for r in RangeHandler.requests if r[0] == "/to-file"] == [("/to-file", None)], "a refusal is final"
    with pytest.raises(FetchError, match=r"bad chunk size b'-5dc'"):
        fetch_file(FetchSpec(f"{server}/negative-chunk", str(tmp_path / "n")), timeout_s=5, attempts=1)
    assert not (tmp_path / "n").exists()


def test_file_urls_and_config_validation(tmp_path):
    source = tmp_path / "Train_GCC-training.tsv"
    source.write_bytes(PAYLOAD)
    spec = FetchSpec.from_config("cc_train", {"url": source.as_uri(), "path": str(tmp_path / "copy.tsv"),
                                              "bytes": len(PAYLOAD)})
    assert fetch_file(spec).read_bytes() == PAYLOAD
    with pytest.raises(ValueError, match="fetch.cc_train.checksum"):
        FetchSpec.from_config("cc_train", {"url": "http://x/y", "path": "p", "checksum": "crc32:00"})
    with pytest.raises(ValueError, match="needs url and path"):
        FetchSpec.from_config("cc_train", {"url": "http://x/y", "dest": "p"})
