"""A Conceptual Captions split through the real stage: partition_cc_tsv, then download_cc_shard
against a loopback HTTP server that misbehaves in every way the issue lists.

Every bad input must end as one accounting row with its own status, no case may crash the shard,
and rows in == ok + failed must hold per shard and for the split.
"""

from __future__ import annotations

import gzip
import hashlib
import http.server
import io
import json
import random
import socket
import struct
import tarfile
import threading
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import webdataset
from PIL import Image

from vlbert_core.data import status as st
from vlbert_core.data.cc import download_cc_shard
from vlbert_core.data.partition import partition_cc_tsv, read_shard_rows

RESIZE = {"max_side": 48, "mode": "keep_ratio"}
MAX_IMAGE_PIXELS = 4_000_000  # the config's top-level max_image_pixels, lowered for /bomb.png
DOWNLOAD = {"timeout_s": 0.5, "deadline_s": 1.0, "retries": 1, "threads": 4, "max_bytes": 2_000_000, "backoff_s": 0.01}
# 8 MB of zeros in about 8 kB of gzip: under max_bytes on the wire, four times over it decoded.
GZIP_BOMB = gzip.compress(bytes(8_000_000), compresslevel=9)


def encode(image: Image.Image, fmt: str, **save_kwargs) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt, **save_kwargs)
    return buffer.getvalue()


def exif_rotated_jpeg() -> bytes:
    """Stored 80x40 with orientation 6: a viewer shows it 40 wide and 80 tall."""
    image = Image.new("RGB", (80, 40), (0, 0, 0))
    image.paste((255, 255, 255), (0, 0, 40, 40))
    exif = Image.Exif()
    exif[0x0112] = 6
    return encode(image, "JPEG", exif=exif, quality=95)


def served_files() -> dict[str, bytes]:
    rgb = encode(Image.new("RGB", (96, 64), (200, 40, 40)), "JPEG", quality=90)
    return {
        "/rgb.jpg": rgb,
        "/cmyk.jpg": encode(Image.new("CMYK", (64, 64), (0, 255, 255, 0)), "JPEG"),
        "/alpha.png": encode(Image.new("RGBA", (64, 32), (0, 0, 255, 0)), "PNG"),
        "/anim.gif": encode(Image.new("P", (40, 40), 5), "GIF"),
        "/grey.png": encode(Image.new("L", (50, 100), 128), "PNG"),
        "/rotated.jpg": exif_rotated_jpeg(),
        "/truncated.jpg": rgb[: len(rgb) // 2],
        "/random.bin": random.Random(0).randbytes(5000),
        # 3000x3000 pixels in a few kB: over MAX_IMAGE_PIXELS before a single pixel is decoded.
        "/bomb.png": encode(Image.new("L", (3000, 3000), 0), "PNG"),
        "/page.html": b"<!doctype html><html><body>This photo has moved</body></html>",
        "/empty.jpg": b"",
    }


class MisbehavingHandler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as real image hosts do
    files: dict[str, bytes] = {}
    hits: dict[str, int] = {}
    lock = threading.Lock()

    def log_message(self, *args):
        pass

    def send_body(self, code: int, body: bytes, content_type: str = "image/jpeg") -> None:
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        with self.lock:
            self.hits[self.path] = self.hits.get(self.path, 0) + 1
            hits = self.hits[self.path]
        if self.path in self.files:
            content_type = "text/html" if self.path.endswith(".html") else "application/octet-stream"
            self.send_body(200, self.files[self.path], content_type)
        elif self.path == "/flaky.jpg":  # a 500, then the image: the retry must fetch it
            if hits == 1:
                self.send_body(500, b"busy", "text/plain")
            else:
                self.send_body(200, self.files["/rgb.jpg"])
        elif self.path == "/slow.jpg":  # answers after the client's timeout
            time.sleep(1.5)
            self.send_body(200, self.files["/rgb.jpg"])
        elif self.path == "/reset.jpg":  # RST instead of an answer
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.connection.close()
            self.close_connection = True
        elif self.path == "/to-file.jpg":  # a redirect that would read a local file
            self.send_response(302)
            self.send_header("Location", "file:///etc/passwd")
            self.send_header("Content-Length", "0")
            self.end_headers()
        elif self.path == "/gzip-bomb.jpg":
            self.send_response(200)
            self.send_header("Content-Encoding", "gzip")
            self.send_header("Content-Length", str(len(GZIP_BOMB)))
            self.end_headers()
            self.wfile.write(GZIP_BOMB)
        elif self.path == "/oversize.jpg":  # announced over max_bytes: refused before any body byte
            self.send_response(200)
            self.send_header("Content-Length", "3000000")
            self.end_headers()
            self.close_connection = True
        elif self.path == "/negative-chunk.jpg":  # "-5dc": int(x, 16) would take it
            self.send_response(200)
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            self.wfile.write(b"-5dc\r\n" + b"x" * 1500 + b"\r\n5dc\r\n" + b"y" * 1500 + b"\r\n0\r\n\r\n")
        elif self.path == "/drip.jpg":  # slow loris: a byte every 50 ms, each read well within timeout_s
            self.send_response(200)
            self.send_header("Content-Length", "1000")
            self.end_headers()
            for _ in range(60):
                self.wfile.write(b"x")
                self.wfile.flush()
                time.sleep(0.05)
            self.close_connection = True
        elif self.path.startswith("/loop"):  # two URLs redirecting to each other
            self.send_response(302)
            self.send_header("Location", "/loop-b" if self.path == "/loop-a" else "/loop-a")
            self.send_header("Content-Length", "0")
            self.end_headers()
        else:
            self.send_body(404, b"not here", "text/plain")


class QuietServer(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address):  # the reset route breaks its own socket on purpose
        pass


@pytest.fixture(scope="module")
def server():
    MisbehavingHandler.files = served_files()
    httpd = QuietServer(("127.0.0.1", 0), MisbehavingHandler)
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


# (raw TSV line, expected status, a fragment of the recorded error or None)
def cases(base: str) -> list[tuple[bytes, str, str | None]]:
    def row(caption: str, path: str) -> bytes:
        return f"{caption}\t{base}{path}".encode()

    return [
        (row("a red block", "/rgb.jpg"), st.OK, None),
        (row("a dead link", "/gone.jpg"), st.NOT_FOUND, "404"),
        (row("a server that recovers", "/flaky.jpg"), st.OK, None),
        (row("a server too slow", "/slow.jpg"), st.TIMEOUT, None),
        (row("a connection reset", "/reset.jpg"), st.CONNECTION_ERROR, None),
        (row("a redirect loop", "/loop-a"), st.HTTP_ERROR, "redirect"),
        (row("a redirect to a local file", "/to-file.jpg"), st.REFUSED_SCHEME, "redirect to a file URL refused"),
        ("a local file\tfile:///etc/hostname".encode(), st.REFUSED_SCHEME, "allow_file_urls is false"),
        ("an ftp url\tftp://example.org/x.jpg".encode(), st.REFUSED_SCHEME, "scheme 'ftp' is refused"),
        (row("a gzip bomb", "/gzip-bomb.jpg"), st.TOO_LARGE, "after gzip decoding"),
        (row("a body over max_bytes", "/oversize.jpg"), st.TOO_LARGE, "Content-Length 3000000 > max_bytes"),
        (row("a negative chunk size", "/negative-chunk.jpg"), st.CONNECTION_ERROR, "bad chunk size b'-5dc'"),
        (row("a slow loris", "/drip.jpg"), st.TIMEOUT, "longer than the deadline 1s (after 2 attempts)"),
        (row("a web page", "/page.html"), st.NOT_AN_IMAGE, "<!doctype html>"),
        (row("half a jpeg", "/truncated.jpg"), st.DECODE_ERROR, None),
        (row("random bytes", "/random.bin"), st.NOT_AN_IMAGE, None),
        (row("a decompression bomb", "/bomb.png"), st.TOO_LARGE,
         "is 3000x3000 = 9,000,000 pixels, over the cap of 4,000,000"),
        (row("a cmyk photo", "/cmyk.jpg"), st.OK, None),
        (row("a transparent png", "/alpha.png"), st.OK, None),
        (row("a gif", "/anim.gif"), st.OK, None),
        (row("a greyscale png", "/grey.png"), st.OK, None),
        (row("a photo taken sideways", "/rotated.jpg"), st.OK, None),
        (row("an empty body", "/empty.jpg"), st.NOT_AN_IMAGE, "empty"),
        (b"a line without any tab", st.MALFORMED_ROW, "wrong field count"),
        (b"an empty url\t", st.MALFORMED_ROW, "empty url"),
        (f"\t{base}/rgb.jpg".encode(), st.MALFORMED_ROW, "empty caption"),
        (b"caf\xe9 latin-1 caption\t" + f"{base}/grey.png".encode(), st.MALFORMED_ROW, "not UTF-8"),
        (row("the red block again", "/rgb.jpg"), st.DUPLICATE_URL, "same URL as row 0 (train-000000000)"),
    ]


def run_split(tmp_path: Path, tsv: Path, shard_rows: int, run: str) -> list[Path]:
    rows_parquet = tmp_path / run / "rows" / "train.parquet"
    rows_parquet.parent.mkdir(parents=True)
    summary = partition_cc_tsv(tsv, "train", shard_rows, rows_parquet)
    outs = []
    for shard in range(summary["num_shards"]):
        out = tmp_path / run / f"train-{shard:05d}"
        stats = download_cc_shard(
            rows_parquet, "train", shard, RESIZE, DOWNLOAD, f"{out}.tar", f"{out}.parquet", f"{out}.stats.json",
            max_image_pixels=MAX_IMAGE_PIXELS,
        )
        assert stats["rows_in"] == stats["ok"] + stats["failed"]
        assert sum(stats["counts"].values()) == stats["rows_in"]
        outs.append(out)
    return outs


@pytest.mark.slow
def test_every_bad_input_is_one_accounted_row(tmp_path, server):
    table = cases(server)
    tsv = tmp_path / "Train_GCC-training.tsv"
    tsv.write_bytes(b"\n".join(line for line, _, _ in table) + b"\n")

    first = run_split(tmp_path, tsv, 10, "a")
    assert len(first) == 3
    accounting = [r for out in first for r in pq.read_table(f"{out}.parquet").to_pylist()]
    assert [r["row"] for r in accounting] == list(range(len(table))), "every TSV row exactly once, in order"
    for record, (line, status, fragment) in zip(accounting, table):
        assert record["status"] == status, (line, record)
        if status == st.OK:
            assert record["error"] == ""
        else:
            assert record["error"], record
        if fragment is not None:
            assert fragment in record["error"], (fragment, record)
    stats = [json.loads(Path(f"{out}.stats.json").read_text()) for out in first]
    ok = sum(s["ok"] for s in stats)
    failed = sum(s["failed"] for s in stats)
    assert sum(s["rows_in"] for s in stats) == len(table) == ok + failed
    assert ok == sum(status == st.OK for _, status, _ in table)
    assert MisbehavingHandler.hits["/flaky.jpg"] == 2, "one 500, then one successful retry"
    assert MisbehavingHandler.hits["/gone.jpg"] == 1, "a 404 is final"
    assert MisbehavingHandler.hits["/rgb.jpg"] == 1, "the duplicate row must not fetch its URL again"

    # Plain webdataset reads the tars; every stored image is RGB and its metadata is right.
    samples = [s for out in first for s in webdataset.WebDataset(str(out) + ".tar", shardshuffle=False).decode("pil")]
    by_key = {r["key"]: r for r in accounting}
    assert sorted(s["__key__"] for s in samples) == sorted(k for k, r in by_key.items() if r["status"] == st.OK)
    for sample in samples:
        meta = sample["json"]
        record = by_key[sample["__key__"]]
        assert sample["jpg"].mode == "RGB" and sample["jpg"].size == (meta["width"], meta["height"])
        assert sample["txt"] == record["caption"] and meta["url"] == record["url"] and meta["row"] == record["row"]
        assert set(meta) == {"url", "row", "width", "height", "original_width", "original_height", "sha256"}
    rotated = next(s["json"] for s in samples if s["json"]["url"].endswith("/rotated.jpg"))
    assert (rotated["original_width"], rotated["original_height"]) == (40, 80)
    assert (rotated["width"], rotated["height"]) == (24, 48)
    with tarfile.open(f"{first[0]}.tar") as archive:
        for member in archive.getmembers():
            if member.name.endswith(".jpg"):
                stored = archive.extractfile(member).read()
                key = member.name.split(".")[0]
                meta = json.loads(archive.extractfile(f"{key}.json").read())
                assert hashlib.sha256(stored).hexdigest() == meta["sha256"]

    # The same TSV gives byte-identical tars, accounting and stats.
    second = run_split(tmp_path, tsv, 10, "b")
    for a, b in zip(first, second):
        for suffix in (".tar", ".parquet", ".stats.json"):
            assert Path(f"{a}{suffix}").read_bytes() == Path(f"{b}{suffix}").read_bytes(), suffix
    leftovers = [p for p in tmp_path.rglob("*") if p.name.startswith(".tmp")]
    assert not leftovers, leftovers


def test_partition_finds_duplicates_across_shards_and_keeps_every_line(tmp_path):
    lines = [
        b"first\tfile:///x/a.jpg",
        b"no tab",
        b"second\tfile:///x/b.jpg",
        b"a repeat from another shard\tfile:///x/a.jpg",
        b"again\tfile:///x/a.jpg",
        b"same caption, other url\tfile:///x/c.jpg",
        b"\xff\tfile:///x/b.jpg",  # malformed rows never count as the first owner of a URL
    ]
    tsv = tmp_path / "t.tsv"
    tsv.write_bytes(b"\n".join(lines))  # no final newline: the last line still counts
    out = tmp_path / "rows.parquet"
    summary = partition_cc_tsv(tsv, "val", 3, out)
    assert summary["rows"] == 7 and summary["malformed"] == 2 and summary["duplicates"] == 2
    assert summary["num_shards"] == 3
    shards = [read_shard_rows(out, shard) for shard in range(3)]
    assert [(s.row_start, s.row_stop) for s in shards] == [(0, 3), (3, 6), (6, 7)]
    assert [r.row for s in shards for r in s.rows] == list(range(7))
    assert shards[1].duplicate_of == {3: 0, 4: 0} and shards[2].duplicate_of == {}
    assert not shards[0].rows[1].ok and "wrong field count" in shards[0].rows[1].error
    assert shards[0].split == "val" and shards[0].tsv == str(tsv)
    with pytest.raises(ValueError, match=r"shard 3 does not exist: 7 rows make 3 shards of 3 rows; lower cc.num_shards.val"):
        read_shard_rows(out, 3)


def test_a_shard_keeps_its_rows_however_many_shards_are_used(tmp_path):
    """Fixed-size blocks: the rows file does not depend on cc.num_shards, so adding a shard to the
    config re-runs no other shard's download."""
    tsv = tmp_path / "t.tsv"
    tsv.write_text("".join(f"caption {i}\tfile:///x/{i}.jpg\n" for i in range(10)), encoding="utf-8")
    partition_cc_tsv(tsv, "train", 4, tmp_path / "rows.parquet")
    blocks = [[r.row for r in read_shard_rows(tmp_path / "rows.parquet", k).rows] for k in range(3)]
    assert blocks == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]


def test_a_shard_with_no_image_fails_and_leaves_no_outputs(tmp_path):
    tsv = tmp_path / "dead.tsv"
    tsv.write_text(f"gone\t{(tmp_path / 'nothing.jpg').as_uri()}\n", encoding="utf-8")
    partition_cc_tsv(tsv, "val", 1, tmp_path / "rows.parquet")
    outputs = [tmp_path / "v.tar", tmp_path / "v.parquet", tmp_path / "v.stats.json"]
    with pytest.raises(RuntimeError, match=r"no image at all.*every row's status and error are in .*v\.failed\.parquet"):
        download_cc_shard(tmp_path / "rows.parquet", "val", 0, RESIZE, {**DOWNLOAD, "allow_file_urls": True}, *outputs)
    assert not any(path.exists() for path in outputs) and not list(tmp_path.glob(".tmp*"))
    # the accounting of the failed shard is kept under a name no rule makes: one row per TSV row, with why
    failed = pq.read_table(tmp_path / "v.failed.parquet").to_pylist()
    assert [(r["row"], r["status"]) for r in failed] == [(0, st.NOT_FOUND)] and "nothing.jpg" in failed[0]["error"]
    # a later run that succeeds removes it
    Image.new("RGB", (8, 8)).save(tmp_path / "nothing.jpg")
    download_cc_shard(tmp_path / "rows.parquet", "val", 0, RESIZE, {**DOWNLOAD, "allow_file_urls": True}, *outputs)
    assert all(path.exists() for path in outputs) and not (tmp_path / "v.failed.parquet").exists()
    with pytest.raises(ValueError, match="unknown keys"):
        download_cc_shard(tmp_path / "rows.parquet", "val", 0, RESIZE, {**DOWNLOAD, "thread": 3}, *outputs)
    with pytest.raises(ValueError, match="not 'train'"):
        download_cc_shard(tmp_path / "rows.parquet", "train", 0, RESIZE, DOWNLOAD, *outputs)
