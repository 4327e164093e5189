"""Files a job of the workflow wrote and a later job finds damaged on disk: cut short, bytes changed, or not
the kind of file they should be.

Every reader of a shard tar or a RoI parquet raises `DamagedFile` for such a file: one message that names the
file, says what is wrong with it and what to do (delete it and run the workflow again), and names the rule
that writes it again. The command-line boundary (cli.py) prints it as one line.

Shard tars. When a job writes shard tars, it records each tar's size and sha256 beside it (`shard_record`): a
Conceptual Captions shard in its `<split>-<shard>.stats.json` under the key `tar`, the text shards of a corpus
in the key-value metadata `vlbert_shards` of the corpus's accounting parquet `<corpus>.parquet`.
`read_shard_samples` compares a tar with that record before it reads the tar. A tar without a record (written
before records were kept, or not by the workflow) is read unchecked, and a tar error while reading it still
becomes a DamagedFile; a cut that falls between two members of such a tar goes unnoticed (tarfile ends the
archive there), which only the recorded size catches.

How much to check (measured on the project's 2-core test machine, an Intel Xeon with SHA extensions: sha256
hashes 1.2-1.35 GB/s on one core, from memory or from the page cache). The size costs one stat and is checked
on every open. The sha256 of a 500 MB shard costs about 0.4 s of one core, more when the file comes over a
network file system, and one more read of the shard; a data stream spends far longer decoding that shard's
images. So a reader that goes through whole shards (pre-training's streams) verifies the sha256 the first
time its process opens a shard, and later epochs check the size only: one extra read of the data per job, not
per epoch. A reader that takes only the first samples of every shard (the held-out captions, the appearance
statistics) checks the size only: hashing would read the whole data set to use a sliver of it.

Parquets: the project's writer (vlbert_core/parquet.py) stores a CRC in every page, and `read_parquet_table`
(which rois.read_rois reads with) verifies them, so bytes changed inside a column chunk are caught rather than
read as other numbers; a file written without page checksums is read unverified. A parquet pyarrow cannot read
(no footer: cut short; a page or footer that does not decode) becomes a DamagedFile too.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tarfile
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import pyarrow as pa
import pyarrow.parquet as pq
import webdataset as wds

CC_STATS_KEY = "tar"  # the key of a CC shard's .stats.json that holds its tar's record
TEXT_SHARDS_METADATA_KEY = "vlbert_shards"  # the text accounting parquet's key-value metadata: {tar name: record}

_HASH_CHUNK = 1 << 20
# (resolved path, size, mtime) of the tars whose sha256 this process has verified: a shard read again in a
# later epoch is not hashed again, a rewritten one is
_verified: set[tuple[str, int, int]] = set()


def rule_that_writes(path: str | os.PathLike) -> str | None:
    """The workflow rule that writes `path`, from where it lies in the workflow's layout (results/shards/...,
    results/rois/...), with the alternative rule where the config chooses between two; None elsewhere."""
    folder = Path(path).parts[-3:-1]
    if folder == ("shards", "cc"):
        return "download_cc"
    if folder == ("shards", "text"):
        return "shard_text"
    if folder == ("rois", "cc"):
        return "extract_rois (import_rois when rois.source.cc is a bottom-up TSV)"
    if len(folder) == 2 and folder[0] == "rois":
        return f"extract_task_rois (import_task_rois when rois.source.{folder[1]} is a bottom-up TSV)"
    return None


class DamagedFile(Exception):
    """A file a job of the workflow wrote is damaged: `problem` says how. The message says what to do."""

    def __init__(self, path: str | os.PathLike, problem: str):
        self.path = Path(path)
        self.problem = problem
        self.rule = rule_that_writes(path)
        writer = f"rule {self.rule}" if self.rule else "the rule that wrote it"
        super().__init__(f"{path} is damaged: {problem}. Delete it and run the workflow again: {writer} "
                         "writes it again")


def file_sha256(path: str | os.PathLike) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def shard_record(tar: str | os.PathLike) -> dict[str, Any]:
    """What a writer records of a finished tar: {"bytes": its size, "sha256": its hex digest}."""
    return {"bytes": Path(tar).stat().st_size, "sha256": file_sha256(tar)}


def recorded_shard(tar: str | os.PathLike) -> dict[str, Any] | None:
    """The record its writer kept of `tar`, or None when there is none (a CC stats.json or a text accounting
    parquet written before records were kept, or a tar the workflow did not write)."""
    tar = Path(tar)
    cc_stats = tar.with_name(tar.name.removesuffix(".tar") + ".stats.json")
    if cc_stats.is_file():
        try:
            stats = json.loads(cc_stats.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise DamagedFile(cc_stats, f"not valid JSON ({err})") from err
        return stats.get(CC_STATS_KEY) if isinstance(stats, dict) else None
    corpus, dash, number = tar.name.removesuffix(".tar").rpartition("-")
    text_accounting = tar.with_name(f"{corpus}.parquet")
    if dash and number.isdigit() and text_accounting.is_file():
        metadata = read_parquet_footer(text_accounting).metadata or {}
        records = metadata.get(TEXT_SHARDS_METADATA_KEY.encode())
        return json.loads(records).get(tar.name) if records else None
    return None


def check_shard(tar: str | os.PathLike, *, verify_checksum: bool) -> None:
    """Raise DamagedFile unless `tar` has the size its writer recorded, and (verify_checksum) its sha256,
    verified once per process and file. A tar without a record passes."""
    tar = Path(tar)
    stat = tar.stat()  # a missing tar: FileNotFoundError, which names it
    record = recorded_shard(tar)
    if record is None:
        return
    if stat.st_size != record["bytes"]:
        how = "cut short" if stat.st_size < record["bytes"] else "grown"
        raise DamagedFile(tar, f"{stat.st_size:,} bytes on disk, {record['bytes']:,} when it was written ({how})")
    seen = (str(tar.resolve()), stat.st_size, stat.st_mtime_ns)
    if verify_checksum and seen not in _verified:
        digest = file_sha256(tar)
        if digest != record["sha256"]:
            raise DamagedFile(tar, f"its sha256 is {digest[:16]}..., not the {record['sha256'][:16]}... recorded "
                                   "when it was written (bytes changed on disk)")
        _verified.add(seen)


@contextlib.contextmanager
def _unreadable_parquet_is_damaged(path: str | os.PathLike) -> Iterator[None]:
    try:
        yield
    except (FileNotFoundError, PermissionError, IsADirectoryError):
        raise  # not damage: they name the file as they are
    except (pa.ArrowException, OSError) as err:  # OSError: a failed page checksum, a page that ends early
        raise DamagedFile(path, f"not a readable parquet file ({' '.join(str(err).split())})") from err


def read_parquet_schema(path: str | os.PathLike) -> pa.Schema:
    with _unreadable_parquet_is_damaged(path):
        return pq.read_schema(path)


def read_parquet_footer(path: str | os.PathLike) -> pq.FileMetaData:
    """The footer of a parquet (row groups, key-value metadata)."""
    with _unreadable_parquet_is_damaged(path):
        return pq.ParquetFile(path).metadata


def read_parquet_table(path: str | os.PathLike, columns: list[str] | None = None) -> pa.Table:
    """The columns of a parquet, each page checked against its CRC where the writer stored one. The columns
    must be in the file (check its schema first): pyarrow's error for a missing one would read as damage."""
    with _unreadable_parquet_is_damaged(path):
        # ParquetFile, not pq.read_table: read_table imports pyarrow.dataset (and pandas), ~0.3 s of every job
        return pq.ParquetFile(path, page_checksum_verification=True).read(columns=columns)


def _tar_reason(err: BaseException) -> str:
    # webdataset appends " @ <stream>" to the library's message and the stream and url to its args
    return str(err.args[0]).split(" @ ")[0] if err.args else type(err).__name__


def read_shard_samples(tars: Iterable[str | os.PathLike], *, verify_checksum: bool,
                       rename_files: Callable[[str], str] | None = None) -> Iterator[dict]:
    """webdataset's samples (`tarfile_to_samples`, with `__key__` and `__url__`) of each tar in turn, each tar
    checked first (`check_shard`); a tar that is not readable to its end raises DamagedFile."""
    for tar in tars:
        check_shard(tar, verify_checksum=verify_checksum)
        samples = wds.DataPipeline(wds.SimpleShardList([str(tar)]), wds.tarfile_to_samples(rename_files=rename_files))
        try:
            yield from samples
        except tarfile.TarError as err:
            raise DamagedFile(tar, f"not a readable tar ({_tar_reason(err)})") from err
