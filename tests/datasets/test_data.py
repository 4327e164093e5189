"""vlbert_core.data: TSV reader, downloader (file:// and a loopback HTTP server), resizer, shard
writer, per-row accounting, and the text corpora (BooksCorpus lines, a MediaWiki bz2 dump)."""

from __future__ import annotations

import bz2
import http.server
import io
import json
import tarfile
import threading
import time

import pyarrow.parquet as pq
import pytest
import webdataset
from PIL import Image

from vlbert_core.data import status as st
from vlbert_core.data.downloader import USER_AGENT, Downloader
from vlbert_core.data.pool import imap_ordered
from vlbert_core.data.reader import count_rows, num_shards_of, read_cc_tsv, shard_bounds
from vlbert_core.data.resizer import ImageRejected, resize_image
from vlbert_core.data.text import shard_text_corpus, split_sentences
from vlbert_core.data.writer import TarShardWriter

RESIZE = {"max_side": 64, "mode": "keep_ratio"}
FAST_DOWNLOAD = {"timeout_s": 2, "retries": 1, "threads": 2, "max_bytes": 1_000_000, "backoff_s": 0.01}


def image_bytes(size=(80, 40), color=(200, 30, 30), mode="RGB", fmt="PNG", **save_kwargs) -> bytes:
    buffer = io.BytesIO()
    Image.new(mode, size, color).save(buffer, format=fmt, **save_kwargs)
    return buffer.getvalue()


def decode(jpeg: bytes) -> Image.Image:
    image = Image.open(io.BytesIO(jpeg))
    assert image.format == "JPEG"
    return image.convert("RGB")


# -- reader -------------------------------------------------------------------------------------


def test_reader_keeps_malformed_rows_with_their_error(tmp_path):
    tsv = tmp_path / "cc.tsv"
    tsv.write_bytes(
        b"a red cat\tfile:///x/1.jpg\r\n"  # CRLF line ending
        b"no tab here\n"
        b"too\tmany\tfields\n"
        b"\tfile:///x/2.jpg\n"
        b"empty url\t  \n"
        b"bad \xff\xfe bytes\tfile:///x/3.jpg\n"
        b"\n"
        b'a "quoted" caption\tfile:///x/4.jpg'  # last line without newline
    )
    rows = read_cc_tsv(tsv)
    assert [row.row for row in rows] == list(range(8)) and count_rows(tsv) == 8
    assert rows[0].ok and rows[0].caption == "a red cat" and rows[0].url == "file:///x/1.jpg"
    assert rows[7].ok and rows[7].caption == 'a "quoted" caption'
    expected = {1: "wrong field count", 2: "wrong field count", 3: "empty caption", 4: "empty url",
                5: "bad encoding", 6: "wrong field count"}
    for index, fragment in expected.items():
        assert not rows[index].ok and fragment in rows[index].error, rows[index]
        assert f"cc.tsv line {index + 1}" in rows[index].error
    assert read_cc_tsv(tsv, 2, 4) == rows[2:4]


def test_shard_bounds_are_fixed_blocks():
    assert [shard_bounds(10, k, 4) for k in range(3)] == [(0, 4), (4, 8), (8, 10)]
    assert num_shards_of(10, 4) == 3 and num_shards_of(8, 4) == 2 and num_shards_of(0, 4) == 0
    with pytest.raises(ValueError, match="shard 3 does not exist: 10 rows make 3 shards of 4 rows"):
        shard_bounds(10, 3, 4)


# -- resizer ------------------------------------------------------------------------------------


def test_resize_modes_and_never_upscale():
    out = resize_image(image_bytes((200, 100)), 64, "keep_ratio")
    assert (out.width, out.height, out.original_width, out.original_height) == (64, 32, 200, 100)
    assert decode(out.jpeg).size == (64, 32)
    crop = resize_image(image_bytes((200, 100)), 64, "center_crop")
    assert (crop.width, crop.height) == (64, 64) and decode(crop.jpeg).size == (64, 64)
    small = resize_image(image_bytes((30, 20)), 64, "keep_ratio")
    assert (small.width, small.height) == (30, 20)
    small_crop = resize_image(image_bytes((30, 20)), 64, "center_crop")
    assert (small_crop.width, small_crop.height) == (20, 20)
    with pytest.raises(ValueError, match="resize mode"):
        resize_image(image_bytes(), 64, "stretch")


def test_center_crop_takes_the_middle():
    image = Image.new("RGB", (90, 30), (0, 0, 255))
    image.paste((255, 0, 0), (30, 0, 60, 30))  # red middle third
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    pixels = decode(resize_image(buffer.getvalue(), 64, "center_crop").jpeg)
    assert pixels.size == (30, 30)
    r, g, b = pixels.getpixel((15, 15))
    assert r > 200 and b < 60


@pytest.mark.parametrize(
    "mode, color, fmt, expected",
    [
        ("CMYK", (0, 255, 255, 0), "JPEG", (255, 0, 0)),  # full magenta+yellow = red
        ("L", 128, "PNG", (128, 128, 128)),
        ("LA", (0, 0), "PNG", (255, 255, 255)),  # fully transparent black -> white background
        ("RGBA", (0, 0, 255, 0), "PNG", (255, 255, 255)),
        ("RGBA", (0, 0, 255, 255), "PNG", (0, 0, 255)),
        ("P", 3, "GIF", None),
    ],
)
def test_modes_become_rgb(mode, color, fmt, expected):
    data = image_bytes((16, 16), color, mode=mode, fmt=fmt)
    out = resize_image(data, 64, "keep_ratio")
    pixel = decode(out.jpeg).getpixel((8, 8))
    if expected is not None:
        assert all(abs(a - b) <= 6 for a, b in zip(pixel, expected)), (mode, pixel)


def test_palette_transparency_goes_onto_white():
    image = Image.new("P", (16, 16), 0)
    image.putpalette([0, 0, 0] + [10, 200, 10] * 255)
    buffer = io.BytesIO()
    image.save(buffer, format="PNG", transparency=0)
    pixel = decode(resize_image(buffer.getvalue(), 64, "keep_ratio").jpeg).getpixel((8, 8))
    assert min(pixel) > 240


def test_exif_orientation_is_applied():
    image = Image.new("RGB", (40, 20), (0, 0, 0))
    image.paste((255, 255, 255), (0, 0, 20, 20))  # white left half
    exif = Image.Exif()
    exif[0x0112] = 6  # stored rotated: display needs a 90° clockwise turn
    buffer = io.BytesIO()
    image.save(buffer, format="JPEG", exif=exif, quality=95)
    out = resize_image(buffer.getvalue(), 64, "keep_ratio")
    assert (out.width, out.height, out.original_width, out.original_height) == (20, 40, 20, 40)
    upright = decode(out.jpeg)
    # After a clockwise turn, the stored left half is on top.
    assert min(upright.getpixel((10, 5))) > 200 and max(upright.getpixel((10, 35))) < 60


def test_non_images_truncated_images_and_bombs_are_rejected():
    with pytest.raises(ImageRejected) as err:
        resize_image(b"<html><body>moved</body></html>", 64)
    assert err.value.status == st.NOT_AN_IMAGE
    with pytest.raises(ImageRejected) as err:
        resize_image(b"", 64)
    assert err.value.status == st.NOT_AN_IMAGE
    jpeg = image_bytes((64, 64), fmt="JPEG")
    with pytest.raises(ImageRejected) as err:
        resize_image(jpeg[: len(jpeg) // 2], 64)
    assert err.value.status == st.DECODE_ERROR
    with pytest.raises(ImageRejected, match="is 100x100 = 10,000 pixels, over the cap of 5,000") as err:
        resize_image(image_bytes((100, 100)), 64, max_pixels=5_000)
    assert err.value.status == st.TOO_LARGE


# -- downloader ---------------------------------------------------------------------------------


class _Handler(http.server.BaseHTTPRequestHandler):
    """Routes: /image.png, /missing (404), /flaky/<id> (500 once, then the image), /always500,
    /page.html, /loop (redirects to itself), /big (declares a huge body), /slow, /drip."""

    hits: dict[str, int] = {}
    agents: list[str] = []
    lock = threading.Lock()
    payload = b""

    def log_message(self, *args):  # keep pytest output clean
        pass

    def _send(self, code: int, body: bytes, content_type: str = "application/octet-stream", length=None):
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body) if length is None else length))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        with self.lock:
            self.hits[self.path] = self.hits.get(self.path, 0) + 1
            hits = self.hits[self.path]
            self.agents.append(self.headers.get("User-Agent", ""))
        if self.path == "/image.png":
            self._send(200, self.payload, "image/png")
        elif self.path.startswith("/flaky/"):
            if hits == 1:
                self._send(500, b"try again", "text/plain")
            else:
                self._send(200, self.payload, "image/png")
        elif self.path == "/always500":
            self._send(503, b"down", "text/plain")
        elif self.path == "/page.html":
            self._send(200, b"<!doctype html><html><body>not an image</body></html>", "text/html")
        elif self.path == "/loop":
            self.send_response(302)
            self.send_header("Location", "/loop")
            self.send_header("Content-Length", "0")
            self.end_headers()
        elif self.path == "/big":
            self._send(200, b"", length=50_000_000)
        elif self.path == "/slow":
            time.sleep(1.0)
            self._send(200, self.payload)
        elif self.path == "/drip":
            self.send_response(200)
            self.send_header("Content-Length", "1000")
            self.end_headers()
            for _ in range(40):  # 1 byte per 50 ms: each recv is quick, the whole is not
                self.wfile.write(b"x")
                self.wfile.flush()
                time.sleep(0.05)
        else:
            self._send(404, b"no such thing", "text/plain")


@pytest.fixture(scope="module")
def http_base():
    _Handler.payload = image_bytes((120, 60), (10, 120, 240))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_http_image_404_and_html(http_base):
    downloader = Downloader(timeout_s=2, retries=2, max_bytes=1_000_000, threads=1, backoff_s=0.01)
    data, status, error = downloader.fetch(f"{http_base}/image.png")
    assert status == st.OK and error == "" and data == _Handler.payload
    assert _Handler.agents[-1] == USER_AGENT
    result = downloader.fetch(f"{http_base}/missing")
    assert result.status == st.NOT_FOUND and result.data is None and "404" in result.error
    assert _Handler.hits["/missing"] == 1, "a 404 must not be retried"
    html = downloader.fetch(f"{http_base}/page.html")
    assert html.status == st.OK  # the bytes arrive; the resizer is what rejects them
    with pytest.raises(ImageRejected) as err:
        resize_image(html.data, 64)
    assert err.value.status == st.NOT_AN_IMAGE


def test_http_retries_transient_errors_only_as_often_as_allowed(http_base):
    downloader = Downloader(timeout_s=2, retries=2, max_bytes=1_000_000, threads=1, backoff_s=0.01)
    result = downloader.fetch(f"{http_base}/flaky/a")
    assert result.status == st.OK and result.data == _Handler.payload
    assert _Handler.hits["/flaky/a"] == 2
    no_retry = Downloader(timeout_s=2, retries=0, max_bytes=1_000_000, threads=1)
    assert no_retry.fetch(f"{http_base}/flaky/b").status == st.HTTP_ERROR
    failed = downloader.fetch(f"{http_base}/always500")
    assert failed.status == st.HTTP_ERROR and "503" in failed.error and "after 3 attempts" in failed.error
    assert _Handler.hits["/always500"] == 3


def test_http_size_cap_redirect_loop_and_timeouts(http_base):
    downloader = Downloader(timeout_s=0.3, retries=0, max_bytes=100_000, threads=1, max_redirects=3)
    assert downloader.fetch(f"{http_base}/big").status == st.TOO_LARGE
    tiny_cap = Downloader(timeout_s=2, retries=0, max_bytes=100, threads=1)
    assert tiny_cap.fetch(f"{http_base}/image.png").status == st.TOO_LARGE
    loop = downloader.fetch(f"{http_base}/loop")
    assert loop.status == st.HTTP_ERROR and "redirect" in loop.error
    assert _Handler.hits["/loop"] <= 4
    started = time.monotonic()
    assert downloader.fetch(f"{http_base}/slow").status == st.TIMEOUT
    drip = Downloader(timeout_s=0.5, retries=0, max_bytes=100_000, threads=1, deadline_s=0.4)
    assert drip.fetch(f"{http_base}/drip").status == st.TIMEOUT
    assert time.monotonic() - started < 3.0


def test_file_urls_and_unsupported_schemes(tmp_path):
    downloader = Downloader(timeout_s=1, retries=0, max_bytes=1_000_000, threads=1, allow_file_urls=True)
    picture = tmp_path / "a picture.png"
    picture.write_bytes(image_bytes())
    assert downloader.fetch(picture.as_uri()).data == picture.read_bytes()
    missing = downloader.fetch((tmp_path / "gone.jpg").as_uri())
    assert missing.status == st.NOT_FOUND and "gone.jpg" in missing.error
    assert downloader.fetch(tmp_path.as_uri()).status == st.IO_ERROR
    assert downloader.fetch("ftp://example.org/x.jpg").status == st.REFUSED_SCHEME
    assert downloader.fetch("file://otherhost/x.jpg").status == st.UNSUPPORTED_URL
    assert downloader.fetch("not a url").status == st.UNSUPPORTED_URL
    capped = Downloader(timeout_s=1, retries=0, max_bytes=10, threads=1, allow_file_urls=True)
    assert capped.fetch(picture.as_uri()).status == st.TOO_LARGE


def test_imap_ordered_keeps_order_and_bounds_work():
    in_flight, peak = 0, 0
    lock = threading.Lock()

    def work(value):
        nonlocal in_flight, peak
        with lock:
            in_flight += 1
            peak = max(peak, in_flight)
        time.sleep(0.002 * (value % 3))
        with lock:
            in_flight -= 1
        return value * value

    assert list(imap_ordered(work, range(40), threads=3, max_in_flight=6)) == [v * v for v in range(40)]
    assert peak <= 3


# -- shard writer -------------------------------------------------------------------------------


def test_shard_writer_is_atomic(tmp_path):
    target = tmp_path / "s.tar"
    with pytest.raises(RuntimeError):
        with TarShardWriter(target) as writer:
            writer.write("k-1", {"txt": "hello"})
            raise RuntimeError("crash mid-shard")
    assert not target.exists() and not list(tmp_path.iterdir())
    with TarShardWriter(target) as writer:
        with pytest.raises(ValueError, match="no dots"):
            writer.write("a.b", {"txt": "x"})
        writer.write("k-1", {"txt": "x"})
        with pytest.raises(ValueError, match="duplicate"):
            writer.write("k-1", {"txt": "y"})
    assert target.exists()


# -- text corpora -------------------------------------------------------------------------------

WIKI_XML = """<mediawiki xmlns="http://www.mediawiki.org/xml/export-0.10/" version="0.10" xml:lang="en">
  <siteinfo><sitename>Wikipedia</sitename></siteinfo>
  <page>
    <title>Red cat</title><ns>0</ns><id>10</id>
    <revision><id>100</id><text xml:space="preserve">{{Infobox animal|name=Cat|colour={{red}}}}
The '''red cat''' is a [[Felidae|small animal]].&lt;ref&gt;{{cite book|title=Cats}} Smith 2001&lt;/ref&gt; It sleeps on a [[mat]] near Dr. Jones.
[[File:Cat.jpg|thumb|A cat sitting [[here]]]]
== Habitat ==
Red cats live in houses.&lt;ref name="a"/&gt; They like warm places!
{| class="wikitable"
|-
| tablecell one || tablecell two
|}
&lt;!-- hidden comment --&gt;
== References ==
* {{cite web|url=http://x}} Reference list entry here
[[Category:Cats]]
[[fr:Chat rouge]]
</text></revision>
  </page>
  <page>
    <title>Crimson cat</title><ns>0</ns><id>11</id><redirect title="Red cat" />
    <revision><id>101</id><text xml:space="preserve">#REDIRECT [[Red cat]]</text></revision>
  </page>
  <page>
    <title>Talk:Red cat</title><ns>1</ns><id>12</id>
    <revision><id>102</id><text xml:space="preserve">This talk page has plenty of sentences. Really.</text></revision>
  </page>
  <page>
    <title>Blue box</title><ns>0</ns><id>13</id>
    <revision><id>103</id><text xml:space="preserve">{{stub}}</text></revision>
  </page>
  <page>
    <title>Green box</title><ns>0</ns><id>14</id>
    <revision><id>104</id><text xml:space="preserve">A green box holds two balls. The balls are small.</text></revision>
  </page>
</mediawiki>
"""


def read_text_shard(path) -> list[dict]:
    return list(webdataset.WebDataset(str(path), shardshuffle=False, empty_check=False))


def test_wiki_dump_keeps_articles_and_strips_markup(tmp_path):
    source = tmp_path / "enwiki-test-pages-articles.xml.bz2"
    source.write_bytes(bz2.compress(WIKI_XML.encode("utf-8")))
    tars = [tmp_path / "wiki-00000.tar", tmp_path / "wiki-00001.tar"]
    counts = shard_text_corpus("wiki", source, tars, tmp_path / "wiki.parquet")
    assert counts == {"kept": 2, "redirect": 1, "non_article_namespace": 1, "empty_after_markup": 1, "empty_file": 0}
    accounting = pq.read_table(tmp_path / "wiki.parquet").to_pylist()
    assert [(r["id"], r["status"]) for r in accounting] == [
        ("10", "kept"), ("11", "redirect"), ("12", "non_article_namespace"), ("13", "empty_after_markup"), ("14", "kept")
    ]
    assert [r["shard"] for r in accounting] == [0, -1, -1, -1, 1]  # round robin over kept documents

    first, second = read_text_shard(tars[0]), read_text_shard(tars[1])
    assert len(first) == len(second) == 1
    meta = json.loads(first[0]["json"])
    assert meta == {"source": "wiki", "file": source.name, "title": "Red cat", "id": "10"}
    sentences = first[0]["txt"].decode().splitlines()
    assert sentences == [
        "The red cat is a small animal.",
        "It sleeps on a mat near Dr. Jones.",
        "Red cats live in houses.",
        "They like warm places!",
    ]
    text = first[0]["txt"].decode()
    for leftover in ("{{", "}}", "Smith 2001", "ref", "Infobox", "tablecell", "thumb", "Category", "Chat rouge",
                     "Habitat", "hidden comment", "Reference list"):
        assert leftover not in text
    assert second[0]["txt"].decode() == "A green box holds two balls.\nThe balls are small.\n"


def test_wiki_rejects_a_file_that_is_not_a_dump(tmp_path):
    source = tmp_path / "bad-pages-articles.xml.bz2"
    source.write_bytes(bz2.compress(b"<html><page>oops</html>"))
    with pytest.raises(ValueError, match="bad-pages-articles.xml.bz2"):
        shard_text_corpus("wiki", source, [tmp_path / "w.tar"], tmp_path / "w.parquet")
    assert not (tmp_path / "w.tar").exists()


def test_wiki_truncated_dump_fails_clearly_and_leaves_no_outputs(tmp_path):
    compressed = bz2.compress((WIKI_XML * 40).encode("utf-8"))
    source = tmp_path / "enwiki-cut-pages-articles.xml.bz2"
    source.write_bytes(compressed[: len(compressed) // 2])
    with pytest.raises(ValueError, match=r"enwiki-cut-pages-articles.xml.bz2: the file ends in the middle .*truncated"):
        shard_text_corpus("wiki", source, [tmp_path / "w.tar"], tmp_path / "w.parquet")
    assert sorted(p.name for p in tmp_path.iterdir()) == [source.name]


@pytest.mark.slow
def test_wiki_worker_processes_give_the_same_bytes(tmp_path):
    source = tmp_path / "enwiki-test-pages-articles.xml.bz2"
    source.write_bytes(bz2.compress(WIKI_XML.encode("utf-8")))
    outputs = {}
    for processes in (1, 2):
        tar, accounting = tmp_path / f"w{processes}.tar", tmp_path / f"w{processes}.parquet"
        counts = shard_text_corpus("wiki", source, [tar], accounting, processes=processes)
        outputs[processes] = (counts, tar.read_bytes(), pq.read_table(accounting).to_pylist())
    assert outputs[1] == outputs[2]


def test_books_archive_is_read_without_unpacking(tmp_path):
    archive = tmp_path / "bookcorpus.tar.bz2"
    with tarfile.open(archive, "w:bz2") as tar:
        for name, text in [("books_large_p1.txt", "First line here.\nSecond line here.\nThird line here.\n"),
                           ("README", "not a book"), ("books_large_p2.txt", "Another book line.\n")]:
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    counts = shard_text_corpus("books", archive, [tmp_path / "b.tar"], tmp_path / "b.parquet", sentences_per_doc=2)
    assert counts["kept"] == 3
    docs = [d["txt"].decode() for d in read_text_shard(tmp_path / "b.tar")]
    assert docs == ["First line here.\nSecond line here.\n", "Third line here.\n", "Another book line.\n"]
    assert [r["file"] for r in pq.read_table(tmp_path / "b.parquet").to_pylist()] == [
        "books_large_p1.txt", "books_large_p1.txt", "books_large_p2.txt"
    ]
    cut = tmp_path / "cut.tar.bz2"
    cut.write_bytes(archive.read_bytes()[:-40])
    with pytest.raises(ValueError, match="cut.tar.bz2: cannot read the archive"):
        shard_text_corpus("books", cut, [tmp_path / "c.tar"], tmp_path / "c.parquet", sentences_per_doc=2)
    assert not (tmp_path / "c.tar").exists() and not (tmp_path / "c.parquet").exists()


def test_books_flat_file_becomes_documents_of_consecutive_lines(tmp_path):
    lines = [f"Sentence number {i} of the book." for i in range(45)]
    lines.insert(10, "")  # blank lines are skipped, not counted as sentences
    source = tmp_path / "books_large_p1.txt"
    source.write_text("\n".join(lines) + "\n", encoding="utf-8")
    counts = shard_text_corpus("books", source, [tmp_path / "books-00000.tar"], tmp_path / "books.parquet",
                               sentences_per_doc=20)
    assert counts["kept"] == 3
    docs = read_text_shard(tmp_path / "books-00000.tar")
    assert [len(d["txt"].decode().splitlines()) for d in docs] == [20, 20, 5]
    assert docs[0]["txt"].decode().splitlines()[0] == "Sentence number 0 of the book."
    assert docs[2]["txt"].decode().splitlines()[-1] == "Sentence number 44 of the book."
    accounting = pq.read_table(tmp_path / "books.parquet").to_pylist()
    assert [r["num_sentences"] for r in accounting] == [20, 20, 5]
    assert accounting[0]["title"] == "books_large_p1.txt lines 1-21" and "1 blank" in accounting[0]["reason"]


def test_books_folder_keeps_book_boundaries(tmp_path):
    folder = tmp_path / "books"
    folder.mkdir()
    (folder / "alpha.txt").write_text("One line of alpha here.\nTwo lines of alpha here.\nThree lines here.\n")
    (folder / "beta.txt").write_text("Only beta line here.\n")
    (folder / "empty.txt").write_text("\n\n")
    counts = shard_text_corpus("books", folder, [tmp_path / "b.tar"], tmp_path / "b.parquet", sentences_per_doc=2)
    assert counts["kept"] == 3 and counts["empty_file"] == 1
    docs = [d["txt"].decode() for d in read_text_shard(tmp_path / "b.tar")]
    assert docs == ["One line of alpha here.\nTwo lines of alpha here.\n", "Three lines here.\n", "Only beta line here.\n"]


def test_sentence_splitter_respects_abbreviations():
    text = 'Mr. Brown met J. R. Smith in 1990. He said "hello." Then it rained! Did it stop? No.'
    assert split_sentences(text) == [
        "Mr. Brown met J. R. Smith in 1990.",
        'He said "hello."',
        "Then it rained!",
        "Did it stop?",
        "No.",
    ]
