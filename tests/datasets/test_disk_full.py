"""A shard or RoI job that runs out of disk fails with the output named and leaves nothing that a later
run (or Snakemake) could take as complete; the next run, with space, redoes it from scratch.

The disk is a real 64 KiB tmpfs where the machine lets us mount one (root, as in CI); the write is also
made to fail from inside the writer, which needs no privileges."""

from __future__ import annotations

import errno
import subprocess
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from PIL import Image

from test_cc_shard import DOWNLOAD as HTTP_DOWNLOAD, RESIZE
from vlbert_core.data.cc import download_cc_shard
from vlbert_core.data.partition import partition_cc_tsv
from vlbert_core.rois import RoIParquetWriter, read_rois

DOWNLOAD = {**HTTP_DOWNLOAD, "allow_file_urls": True}  # the images are local files


@pytest.fixture
def small_disk(tmp_path):
    mount = tmp_path / "small-disk"
    mount.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount)], capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({proc.stderr.strip()}); the patched-write tests cover the writers")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=True)


def _cc_rows(tmp_path: Path, count: int = 30) -> Path:
    """A TSV of `count` noise images (noise does not compress: ~3 KB each after resizing)."""
    rng = np.random.default_rng(0)
    lines = []
    for i in range(count):
        path = tmp_path / "images" / f"{i}.png"
        path.parent.mkdir(exist_ok=True)
        Image.fromarray(rng.integers(0, 256, size=(64, 64, 3), dtype=np.uint8)).save(path)
        lines.append(f"noise picture number {i}\t{path.as_uri()}")
    tsv = tmp_path / "train.tsv"
    tsv.write_text("\n".join(lines) + "\n")
    partition_cc_tsv(tsv, "train", count, tmp_path / "rows.parquet")
    return tmp_path / "rows.parquet"


def _shard_outputs(directory: Path) -> list[Path]:
    return [directory / "train-00000.tar", directory / "train-00000.parquet", directory / "train-00000.stats.json"]


def _assert_nothing_left(directory: Path) -> None:
    assert sorted(p.name for p in directory.iterdir() if p.name != "lost+found") == []


def test_cc_shard_on_a_full_disk(tmp_path, small_disk):
    rows = _cc_rows(tmp_path)
    with pytest.raises(OSError) as err:
        download_cc_shard(rows, "train", 0, RESIZE, DOWNLOAD, *map(str, _shard_outputs(small_disk)))
    assert err.value.errno == errno.ENOSPC
    assert "train-00000" in str(err.value) and "nothing was kept" in str(err.value)
    _assert_nothing_left(small_disk)
    # the same job with room to spare
    roomy = tmp_path / "roomy"
    roomy.mkdir()
    stats = download_cc_shard(rows, "train", 0, RESIZE, DOWNLOAD, *map(str, _shard_outputs(roomy)))
    assert stats["ok"] == 30 and all(p.is_file() for p in _shard_outputs(roomy))


def _write_rois(path: Path, rows: int = 4, classes: int = 201) -> None:
    rng = np.random.default_rng(0)
    with RoIParquetWriter(path, classes, {"source": "test"}) as writer:
        for i in range(rows):
            n = 100
            writer.add(f"img{i}", image_w=640, image_h=480, boxes=rng.random((n, 4), dtype=np.float32) * 100,
                       scores=rng.random(n, dtype=np.float32), class_ids=rng.integers(1, classes, n, dtype=np.int32),
                       class_scores=rng.random((n, classes), dtype=np.float32))


def test_roi_parquet_on_a_full_disk(tmp_path, small_disk):
    with pytest.raises(OSError) as err:
        _write_rois(small_disk / "train-00000.parquet")
    assert err.value.errno == errno.ENOSPC and "train-00000.parquet" in str(err.value)
    _assert_nothing_left(small_disk)
    _write_rois(tmp_path / "train-00000.parquet")
    assert len(read_rois(tmp_path / "train-00000.parquet")) == 4


def _enospc(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


def test_shard_writer_failing_mid_shard_leaves_nothing(tmp_path, monkeypatch):
    import webdataset

    rows = _cc_rows(tmp_path, count=6)
    out = tmp_path / "out"
    out.mkdir()
    real_write, calls = webdataset.TarWriter.write, []

    def write_then_fail(self, sample):
        calls.append(sample["__key__"])
        if len(calls) == 4:
            _enospc()
        return real_write(self, sample)

    monkeypatch.setattr(webdataset.TarWriter, "write", write_then_fail)
    with pytest.raises(OSError, match=r"train-00000\.tar: No space left on device while writing it"):
        download_cc_shard(rows, "train", 0, RESIZE, DOWNLOAD, *map(str, _shard_outputs(out)))
    _assert_nothing_left(out)


def test_roi_writer_failing_mid_file_leaves_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(pq.ParquetWriter, "write_table", _enospc)
    with pytest.raises(OSError, match=r"rois\.parquet: No space left on device while writing it"):
        _write_rois(tmp_path / "rois.parquet")
    _assert_nothing_left(tmp_path)


def test_parquet_writer_failing_at_close_leaves_nothing(tmp_path, monkeypatch):
    import pyarrow as pa

    from vlbert_core.parquet import AtomicParquetWriter

    schema = pa.schema([("row", pa.int64()), ("text", pa.string())])
    monkeypatch.setattr(pq.ParquetWriter, "close", _enospc)
    with pytest.raises(OSError, match=r"rows\.parquet: No space left on device while writing it"):
        with AtomicParquetWriter(tmp_path / "rows.parquet", schema, rows_per_group=2) as writer:
            for i in range(5):
                writer.add_row((i, f"row {i}"))
    _assert_nothing_left(tmp_path)
    monkeypatch.undo()
    with AtomicParquetWriter(tmp_path / "rows.parquet", schema, rows_per_group=2) as writer:
        for i in range(5):
            writer.add_row((i, f"row {i}"))
    written = pq.ParquetFile(tmp_path / "rows.parquet")
    assert written.metadata.num_row_groups == 3 and written.read().column("row").to_pylist() == list(range(5))
