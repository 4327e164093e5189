"""One Conceptual Captions shard: TSV block -> download -> resize -> webdataset tar + accounting."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
import re
import time
from typing import Any, Mapping, NamedTuple

from vlbert_core.progress import Progress

from vlbert_core.damaged import CC_STATS_KEY, shard_record
from vlbert_core.data import status as st
from vlbert_core.data.downloader import Downloader
from vlbert_core.data.logger import ShardAccounting, write_stats
from vlbert_core.data.pool import imap_ordered
from vlbert_core.data.partition import read_shard_rows
from vlbert_core.data.reader import CCRow
from vlbert_core.data.resizer import ImageRejected, ResizedImage, resize_image
from vlbert_core.data.writer import TarShardWriter, cc_key, encode_json
from vlbert_core.images import DEFAULT_MAX_PIXELS, MAX_PIXELS_KEY, checked_max_pixels
from vlbert_core.utils import get_logger

log = get_logger(__name__)

RESIZE_REQUIRED = ("max_side", "mode")
RESIZE_OPTIONAL = ("quality",)  # the pixel cap is the top-level max_image_pixels (vlbert_core/images.py)
DOWNLOAD_REQUIRED = ("timeout_s", "retries", "threads", "max_bytes")
DOWNLOAD_OPTIONAL = ("backoff_s", "max_backoff_s", "max_redirects", "deadline_s", "user_agent", "allow_file_urls")
_MAX_LOGGED_FAILURES = 10  # per shard at WARNING; the parquet has them all


class _RowOutcome(NamedTuple):
    row: CCRow
    status: str
    error: str
    image: ResizedImage | None


def _checked_options(options: Mapping[str, Any], required: tuple, optional: tuple, what: str) -> dict[str, Any]:
    missing = [name for name in required if name not in options]
    unknown = [name for name in options if name not in required + optional]
    if missing or unknown:
        raise ValueError(
            f"config {what}: missing keys {missing}, unknown keys {unknown}; "
            f"expected {list(required)} and optionally {list(optional)}"
        )
    return dict(options)


def image_meta(url: str, row: int, image: ResizedImage) -> dict[str, Any]:
    """The KEY.json of a CC sample: where the image came from, its sizes and the sha256 of the JPEG."""
    return {
        "url": url,
        "row": row,
        "width": image.width,
        "height": image.height,
        "original_width": image.original_width,
        "original_height": image.original_height,
        "sha256": hashlib.sha256(image.jpeg).hexdigest(),
    }


def make_downloader(download: Mapping[str, Any], config_key: str = "cc.download") -> Downloader:
    """A Downloader from a download mapping of the config (cc.download, or `config_key` naming where
    else it comes from, for the errors); unknown keys are an error."""
    options = _checked_options(download, DOWNLOAD_REQUIRED, DOWNLOAD_OPTIONAL, config_key)
    return Downloader(**options, config_key=config_key)


def failed_accounting_path(out_parquet: str | os.PathLike) -> Path:
    """Where a failed shard leaves its per-row accounting: `<shard>.failed.parquet` beside the shard's outputs,
    a name no rule makes, so it is never taken for a finished output. A later run that succeeds removes it."""
    out_parquet = Path(out_parquet)
    return out_parquet.with_name(out_parquet.name.removesuffix(".parquet") + ".failed.parquet")


def download_cc_shard(
    rows_parquet: str | os.PathLike,
    split: str,
    shard: int,
    resize: Mapping[str, Any],
    download: Mapping[str, Any],
    out_tar: str | os.PathLike,
    out_parquet: str | os.PathLike,
    out_stats: str | os.PathLike,
    *,
    max_image_pixels: int = DEFAULT_MAX_PIXELS,
) -> dict[str, Any]:
    """Download, resize and write the rows of `shard` (from partition_cc_tsv's parquet); return the stats.

    An image over `max_image_pixels` (the config's top-level cap) is refused from its header: its row gets
    status too_large.

    Writes `out_tar` (samples KEY.jpg / KEY.txt / KEY.json, KEY = f"{split}-{row:09d}", in row
    order), `out_parquet` (one row per TSV row of the shard: row, key, url, caption, status,
    error) and `out_stats` (counts per status, rows_in, ok, failed, and under `tar` the tar's size and
    sha256, which its readers check: vlbert_core/damaged.py). Raises when a shard fetched
    URLs and got no image at all, which means a broken source or network rather than dead links.
    """
    if not re.fullmatch(r"[A-Za-z0-9_]+", split):
        raise ValueError(f"split name {split!r} must be letters, digits or '_' (it becomes part of sample keys)")
    if "max_pixels" in resize:
        raise ValueError(f"config cc.resize.max_pixels is now the top-level {MAX_PIXELS_KEY}, one cap for every "
                         f"image the pipeline opens: move it there")
    resize_options = _checked_options(resize, RESIZE_REQUIRED, RESIZE_OPTIONAL, "cc.resize")
    resize_options["max_pixels"] = checked_max_pixels(max_image_pixels)
    downloader = make_downloader(download)

    part = read_shard_rows(rows_parquet, shard)
    if part.split != split:
        raise ValueError(f"{rows_parquet}: holds the rows of split {part.split!r}, not {split!r}")
    tsv, row_start, row_stop = part.tsv, part.row_start, part.row_stop
    rows_in = row_stop - row_start
    log.info(
        "%s: shard %d of split %s takes rows [%d, %d) of %s; %d download threads",
        rows_parquet, shard, split, row_start, row_stop, tsv, downloader.threads,
    )

    def process(row: CCRow) -> _RowOutcome:
        if not row.ok:
            return _RowOutcome(row, st.MALFORMED_ROW, row.error or "malformed row", None)
        if row.row in part.duplicate_of:
            first = part.duplicate_of[row.row]
            return _RowOutcome(row, st.DUPLICATE_URL, f"same URL as row {first} ({cc_key(split, first)})", None)
        fetched = downloader.fetch(row.url)
        if fetched.status != st.OK:
            return _RowOutcome(row, fetched.status, fetched.error, None)
        try:
            image = resize_image(fetched.data, **resize_options, name=row.url)
        except ImageRejected as err:
            return _RowOutcome(row, err.status, str(err), None)
        return _RowOutcome(row, st.OK, "", image)

    accounting = ShardAccounting(row_start, row_stop)
    failures_logged = 0
    started = time.monotonic()
    with downloader, TarShardWriter(out_tar) as writer, Progress(
        total=rows_in, desc=f"{split}-{shard:05d}", unit="row", mininterval=2.0
    ) as progress:
        for outcome in imap_ordered(process, part.rows, downloader.threads):
            row = outcome.row
            key = cc_key(split, row.row)
            if outcome.image is not None:
                meta = image_meta(row.url, row.row, outcome.image)
                writer.write(key, {"jpg": outcome.image.jpeg, "txt": row.caption, "json": encode_json(meta)})
            else:
                failures_logged += 1
                level = log.warning if failures_logged <= _MAX_LOGGED_FAILURES else log.debug
                level("row %d (%s): %s: %s", row.row, row.url[:200], outcome.status, outcome.error)
            accounting.add(row.row, key, row.url, row.caption, outcome.status, outcome.error)
            progress.update(1)
            if progress.n % 256 == 0:
                progress.set_postfix(ok=writer.count, failed=progress.n - writer.count, refresh=False)
        stats = accounting.stats(split=split, shard=shard, tsv=str(tsv))
        fetched = rows_in - stats["counts"][st.MALFORMED_ROW] - stats["counts"][st.DUPLICATE_URL]
        if fetched > 0 and stats["ok"] == 0:
            failing = {name: count for name, count in stats["counts"].items() if count}
            failed_parquet = failed_accounting_path(out_parquet)
            accounting.write_parquet(failed_parquet)   # every row's status and error, under a name no rule makes
            raise RuntimeError(
                f"{tsv}: shard {shard} (rows [{row_start}, {row_stop})) produced no image at all: {failing}; "
                f"every row's status and error are in {failed_parquet}. Check that the URLs are reachable from "
                "this machine."
            )

    accounting.write_parquet(out_parquet)
    failed_accounting_path(out_parquet).unlink(missing_ok=True)   # an earlier failed attempt's record
    stats[CC_STATS_KEY] = shard_record(out_tar)
    write_stats(stats, out_stats)
    elapsed = time.monotonic() - started
    log.info(
        "%s: %d rows in, %d ok, %d failed in %.1fs; by status: %s",
        out_tar, stats["rows_in"], stats["ok"], stats["failed"], elapsed,
        {name: count for name, count in stats["counts"].items() if count},
    )
    return stats
