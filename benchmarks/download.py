"""Download benchmark: our CC shard pipeline vs img2dataset vs the CPU limit, on a loopback server.

What it does, in one run:
1. Generates (once, then cached in --workdir) photo-like JPEGs of random sizes from 640x480 to
   1024x768: smooth colour fields, blurred shapes and sensor-like noise, saved at quality 90, so
   their byte sizes (about 90-190 KB) are those of real photos rather than of flat test images.
2. Serves them from memory over HTTP/1.1 with keep-alive, from a small asyncio server in its own
   process pinned to --server-cpu, on 127.0.0.1 only.
3. Writes a Conceptual Captions TSV (caption<TAB>url, no header) of their URLs, and measures, in
   --rounds rounds whose order rotates, on the --client-cpus (one process per client core):
   - ours: `partition_cc_tsv` then `download_cc_shard` per shard (the workflow's own code path),
     resize {max_side: 384, mode: keep_ratio}, JPEG quality 95;
   - img2dataset (its own environment, via `uvx --from img2dataset==...`) on the same URLs with
     the same output: longest side 384 (its `keep_ratio_largest`; its `keep_ratio` fits the
     *shorter* side), only downscaling, quality 95, webdataset, the same thread count;
   - the CPU limit: our `resize_image` over the same files already in memory, no network.
   Rates are images/s over the work itself: each measured process takes its own clock after its
   imports, and a method's time runs from the first shard process's start to the last one's end.
   For img2dataset that is its per-shard stats JSON (`start_time`/`end_time`, taken inside its
   shard worker after its imports). Neither holds the splitting of the TSV for the shard workers
   (our partition step, img2dataset's reader). CPU time per image is the marginal one, for both:
   (full run - a CALIBRATION_ROWS-row run) / the rows in between, every process counted.
4. Takes ours apart, --rounds times after the rounds, in one process: CPU per image of the
   fetches alone, of resize_image alone on what they fetched, and of the writing (sha256, json,
   TarWriter).
5. Prints every round and the medians, and with --write-docs replaces the body of the
   "## Download (Conceptual Captions images)" section of docs/benchmarks.md.

Reproduce: uv run python benchmarks/download.py --write-docs
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import math
import multiprocessing
import os
import platform
import resource
import shlex
import shutil
import statistics
import subprocess
import sys
import tarfile
import time
from pathlib import Path

from docs_section import replace_section  # benchmarks/ is on sys.path when a benchmark runs as a script

REPO = Path(__file__).resolve().parents[1]
SECTION = "## Download (Conceptual Captions images)"
IMG2DATASET = "img2dataset==1.47.0"
GENERATOR_VERSION = 1  # bump when the image generator changes, so cached images are remade
MAX_SIDE = 384
QUALITY = 95
SPLIT = "bench"
METHODS = ("ours", "img2dataset", "cpu_limit")
CALIBRATION_ROWS = 32


# -- images ------------------------------------------------------------------------------------


def photo_like_jpeg(index: int, seed: int) -> bytes:
    """One photo-like JPEG: a smooth colour field, blurred shapes, and two scales of noise."""
    import numpy as np
    from PIL import Image, ImageDraw, ImageFilter

    rng = np.random.default_rng([seed, index])
    width, height = int(rng.integers(640, 1025)), int(rng.integers(480, 769))
    grid = rng.integers(0, 256, size=(4, 5, 3), dtype=np.uint8)  # sky / walls / ground
    image = Image.fromarray(grid, "RGB").resize((width, height), Image.Resampling.BICUBIC)
    draw = ImageDraw.Draw(image)
    for _ in range(int(rng.integers(4, 12))):
        x0, y0 = int(rng.integers(0, width)), int(rng.integers(0, height))
        w, h = int(rng.integers(20, width // 2)), int(rng.integers(20, height // 2))
        colour = tuple(int(c) for c in rng.integers(0, 256, 3))
        (draw.ellipse if rng.random() < 0.5 else draw.rectangle)((x0, y0, x0 + w, y0 + h), fill=colour)
    pixels = np.asarray(image.filter(ImageFilter.GaussianBlur(1.5)), dtype=np.float32)
    coarse = 7 * rng.standard_normal(size=((height + 1) // 2, (width + 1) // 2, 3), dtype=np.float32)
    pixels += np.repeat(np.repeat(coarse, 2, axis=0), 2, axis=1)[:height, :width]
    pixels += 2 * rng.standard_normal(size=(height, width, 3), dtype=np.float32)
    buffer = io.BytesIO()
    Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8), "RGB").save(buffer, format="JPEG", quality=90)
    return buffer.getvalue()


def _write_image(job: tuple[Path, int, int]) -> None:
    path, index, seed = job
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(photo_like_jpeg(index, seed))
    tmp.rename(path)


def ensure_images(workdir: Path, count: int, seed: int) -> list[Path]:
    """The benchmark images, generated in parallel the first time and reused afterwards."""
    folder = workdir / "images"
    manifest = folder / "manifest.json"
    wanted = {"count": count, "seed": seed, "generator": GENERATOR_VERSION}
    paths = [folder / f"{index:06d}.jpg" for index in range(count)]
    if manifest.exists() and json.loads(manifest.read_text()) == wanted and all(p.exists() for p in paths):
        return paths
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    print(f"generating {count} photo-like JPEGs in {folder} ...", flush=True)
    started = time.monotonic()
    with multiprocessing.get_context("fork").Pool(os.cpu_count()) as pool:
        pool.map(_write_image, [(path, index, seed) for index, path in enumerate(paths)], chunksize=16)
    manifest.write_text(json.dumps(wanted))
    print(f"generated in {time.monotonic() - started:.0f}s", flush=True)
    return paths


def describe_images(paths: list[Path]) -> dict:
    from PIL import Image

    sizes = [p.stat().st_size for p in paths]
    dims = []
    for path in paths:
        with Image.open(path) as image:
            dims.append(image.size)
    return {
        "count": len(paths),
        "kb_min": min(sizes) / 1e3,
        "kb_median": statistics.median(sizes) / 1e3,
        "kb_max": max(sizes) / 1e3,
        "width_range": (min(w for w, _ in dims), max(w for w, _ in dims)),
        "height_range": (min(h for _, h in dims), max(h for _, h in dims)),
        "megapixels_median": statistics.median(w * h for w, h in dims) / 1e6,
    }


# -- the loopback server -----------------------------------------------------------------------


class _ImageServer(asyncio.Protocol):
    """GET /<name> from a dict in memory; HTTP/1.1 keep-alive unless the client asks to close."""

    def __init__(self, files: dict[bytes, bytes]):
        self.files = files
        self.buffer = b""

    def connection_made(self, transport):
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while (end := self.buffer.find(b"\r\n\r\n")) >= 0:
            head, self.buffer = self.buffer[:end], self.buffer[end + 4 :]
            lines = head.split(b"\r\n")
            request = lines[0].split(b" ")
            if len(request) != 3 or request[0] != b"GET":
                self.transport.write(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
                self.transport.close()
                return
            connection = b""
            for line in lines[1:]:
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"connection":
                    connection = value.strip().lower()
            keep_alive = connection != b"close" if request[2] == b"HTTP/1.1" else connection == b"keep-alive"
            body = self.files.get(request[1])
            status = b"200 OK" if body is not None else b"404 Not Found"
            body = body if body is not None else b"not found"
            self.transport.write(
                b"HTTP/1.1 " + status + b"\r\nContent-Type: image/jpeg\r\nContent-Length: " + str(len(body)).encode()
                + (b"\r\n\r\n" if keep_alive else b"\r\nConnection: close\r\n\r\n")
            )
            self.transport.write(body)
            if not keep_alive:
                self.transport.close()
                return


def _serve(folder: str, cpu: int, ready) -> None:
    os.sched_setaffinity(0, {cpu})
    files = {f"/{path.name}".encode(): path.read_bytes() for path in Path(folder).glob("*.jpg")}

    async def main() -> None:
        loop = asyncio.get_running_loop()
        server = await loop.create_server(lambda: _ImageServer(files), "127.0.0.1", 0, backlog=4096)
        ready.send(server.sockets[0].getsockname()[1])
        await server.serve_forever()

    asyncio.run(main())


def start_server(folder: Path, cpu: int) -> tuple[multiprocessing.Process, int]:
    context = multiprocessing.get_context("fork")
    receive, send = context.Pipe(duplex=False)
    process = context.Process(target=_serve, args=(str(folder), cpu, send), daemon=True, name="image-server")
    process.start()
    if not receive.poll(60):
        process.kill()
        raise RuntimeError("the benchmark's image server did not start within 60 s")
    return process, receive.recv()


# -- workers (run as subprocesses, pinned, timing themselves after their imports) ---------------


def worker_partition(args: argparse.Namespace) -> dict:
    from vlbert_core.data.partition import partition_cc_tsv

    started, cpu_started = time.time(), _cpu_seconds()
    partition_cc_tsv(args.tsv, SPLIT, args.shard_rows, args.out)
    return {"start": started, "end": time.time(), "cpu_s": _cpu_seconds() - cpu_started}


def _cpu_seconds() -> float:
    """User + system CPU time of this process and of its children that have ended."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def _resize_as_ours(blob: bytes):
    from vlbert_core.data.resizer import resize_image  # the workers import it before their clocks

    return resize_image(blob, MAX_SIDE, "keep_ratio", quality=QUALITY)


def worker_shard(args: argparse.Namespace) -> dict:
    import logging

    import pyarrow.dataset  # noqa: F401  imported lazily by read_shard_rows; an import, so before the clock

    from vlbert_core.data.cc import download_cc_shard

    logging.getLogger("vlbert").setLevel(logging.ERROR)  # no per-shard chatter on the benchmark's output
    resize = {"max_side": MAX_SIDE, "mode": "keep_ratio", "quality": QUALITY}
    download = {"timeout_s": 10, "retries": 2, "threads": args.threads, "max_bytes": 20_000_000}
    out = Path(args.out)
    started, cpu_started = time.time(), _cpu_seconds()
    stats = download_cc_shard(
        args.rows, SPLIT, args.shard, resize, download,
        out.with_suffix(".tar"), out.with_suffix(".parquet"), out.with_suffix(".stats.json"),
    )
    return {"start": started, "end": time.time(), "cpu_s": _cpu_seconds() - cpu_started, "ok": stats["ok"]}


def worker_cpu_limit(args: argparse.Namespace) -> dict:
    """resize_image over in-memory files, on as many threads as ours downloads with: the same
    work without the network, and the same weight with the OS scheduler on a shared machine."""
    from concurrent.futures import ThreadPoolExecutor

    import vlbert_core.data.resizer  # noqa: F401  an import, so before the clock

    paths = Path(args.list).read_text().split("\n")
    blobs = [Path(path).read_bytes() for path in paths if path]
    started, cpu_started = time.time(), _cpu_seconds()
    with ThreadPoolExecutor(args.threads) as pool:
        done = sum(1 for _ in pool.map(_resize_as_ours, blobs))
    return {"start": started, "end": time.time(), "cpu_s": _cpu_seconds() - cpu_started, "ok": done}


def worker_img2dataset(args: argparse.Namespace) -> dict:
    """img2dataset's own `download` (what its command line calls), run by the Python of its uvx
    environment; its CPU time includes its shard worker processes."""
    from img2dataset import download

    cpu_started = _cpu_seconds()
    download(**json.loads(args.options))
    return {"cpu_s": _cpu_seconds() - cpu_started}


def worker_parts(args: argparse.Namespace) -> dict:
    """Ours taken apart, in one process: CPU ms per image of the fetches alone (the same thread
    pool, no resize), of resize_image alone on what was fetched, and of writing the results
    (sha256, json, webdataset TarWriter)."""
    import tempfile
    from concurrent.futures import ThreadPoolExecutor

    import vlbert_core.data.resizer  # noqa: F401  an import, so before the clock
    from vlbert_core.data.cc import image_meta
    from vlbert_core.data.downloader import Downloader
    from vlbert_core.data.pool import imap_ordered
    from vlbert_core.data.writer import TarShardWriter, encode_json

    urls = [line.split("\t")[1] for line in Path(args.tsv).read_text(encoding="utf-8").splitlines()]
    ms: dict[str, float] = {}
    with Downloader(timeout_s=10, retries=2, threads=args.threads, max_bytes=20_000_000) as downloader:
        # Timed with each body dropped at once, as the pipeline drops it after its resize: keeping
        # them all would time page faults on hundreds of MB of fresh memory as well.
        started = _cpu_seconds()
        fetched = sum(len(result.data) for result in imap_ordered(downloader.fetch, urls, args.threads))
        ms["fetch"] = 1e3 * (_cpu_seconds() - started) / len(urls)
        blobs = [result.data for result in imap_ordered(downloader.fetch, urls, args.threads)]
    if sum(map(len, blobs)) != fetched:
        raise RuntimeError("the two fetches of the same URLs gave different bytes")
    started = _cpu_seconds()
    with ThreadPoolExecutor(args.threads) as pool:
        images = list(pool.map(_resize_as_ours, blobs))
    ms["resize"] = 1e3 * (_cpu_seconds() - started) / len(urls)
    with tempfile.TemporaryDirectory() as folder:
        started = _cpu_seconds()
        with TarShardWriter(Path(folder) / "parts.tar") as writer:
            for row, (url, image) in enumerate(zip(urls, images)):
                meta = encode_json(image_meta(url, row, image))
                writer.write(f"{SPLIT}-{row:09d}", {"jpg": image.jpeg, "txt": f"photo {row}", "json": meta})
        ms["write"] = 1e3 * (_cpu_seconds() - started) / len(urls)
    return ms


WORKERS = {
    "partition": worker_partition,
    "shard": worker_shard,
    "cpu-limit": worker_cpu_limit,
    "parts": worker_parts,
    "img2dataset": worker_img2dataset,
}


def _spawn_worker(kind: str, cpus: set[int], log: Path, python: tuple[str, ...] = (sys.executable,), **options):
    """Start one measured process on `cpus`; its stderr (progress, warnings) goes to `log`."""
    command = [*python, str(Path(__file__).resolve()), "worker", kind]
    for name, value in options.items():
        command += [f"--{name.replace('_', '-')}", str(value)]
    with open(log, "w") as stderr:
        return subprocess.Popen(
            command, cwd=REPO, stdout=subprocess.PIPE, stderr=stderr, text=True,
            env={**os.environ, "NO_ALBUMENTATIONS_UPDATE": "1"},  # img2dataset: no update check over the network
            preexec_fn=lambda: os.sched_setaffinity(0, cpus),
        )


def _collect(processes: list[subprocess.Popen]) -> list[dict]:
    results = []
    for process in processes:
        out, _ = process.communicate()
        if process.returncode != 0:
            raise RuntimeError(
                f"benchmark worker {shlex.join(process.args)} failed with exit code {process.returncode}; "
                "its stderr is in the .log file beside its outputs"
            )
        results.append(json.loads(out.strip().splitlines()[-1]))
    return results


# -- the three methods -------------------------------------------------------------------------


def run_ours(tsv: Path, out: Path, cpus: list[int], threads: int, count: int) -> dict:
    """partition_cc_tsv, then one download_cc_shard process per client CPU. Its images/s window is
    that of the shard processes, as img2dataset's is that of its shard workers: the partition
    (like img2dataset's reader, which splits the TSV before its workers start) is outside it, but
    its CPU time is counted."""
    out.mkdir(parents=True)
    rows = out / "rows.parquet"
    (partition,) = _collect([_spawn_worker("partition", set(cpus), out / "partition.log", tsv=tsv, shard_rows=math.ceil(count / len(cpus)), out=rows)])
    shards = _collect([
        _spawn_worker("shard", {cpu}, out / f"shard-{shard}.log", rows=rows, shard=shard, threads=threads, out=out / f"{SPLIT}-{shard:05d}")
        for shard, cpu in enumerate(cpus)
    ])
    ok = sum(shard["ok"] for shard in shards)
    if ok != count:
        raise RuntimeError(f"ours: {ok} of {count} images ok; see {out}/*.parquet")
    seconds = max(s["end"] for s in shards) - min(s["start"] for s in shards)
    cpu_s = partition["cpu_s"] + sum(shard["cpu_s"] for shard in shards)
    return {"images": ok, "seconds": seconds, "cpu_s": cpu_s, "partition_s": partition["end"] - partition["start"]}


def run_img2dataset(tsv_with_header: Path, out: Path, cpus: list[int], threads: int, rows: int) -> dict:
    out.mkdir(parents=True)
    options = {
        "url_list": str(tsv_with_header), "input_format": "tsv", "url_col": "url", "caption_col": "caption",
        "output_format": "webdataset", "output_folder": str(out / "output"),
        "processes_count": len(cpus), "thread_count": threads, "number_sample_per_shard": math.ceil(rows / len(cpus)),
        # its keep_ratio fits the shorter side; keep_ratio_largest fits the longest, like ours
        "image_size": MAX_SIDE, "resize_mode": "keep_ratio_largest", "resize_only_if_bigger": True,
        "encode_format": "jpg", "encode_quality": QUALITY,
        "extract_exif": False,  # we do not extract EXIF either
        "timeout": 10, "retries": 2, "enable_wandb": False, "distributor": "multiprocessing",
    }
    python = ("uvx", "--from", IMG2DATASET, "python")
    (result,) = _collect([
        _spawn_worker("img2dataset", set(cpus), out / "img2dataset.log", python, options=json.dumps(options))
    ])
    stats = [json.loads(path.read_text()) for path in sorted((out / "output").glob("*_stats.json"))]
    if not stats:
        raise RuntimeError(f"img2dataset wrote no *_stats.json in {out}/output; see {out}/img2dataset.log")
    ok = sum(s["successes"] for s in stats)
    if ok != rows:
        raise RuntimeError(f"img2dataset: {ok} of {rows} images ok: {[s['status_dict'] for s in stats]}")
    seconds = max(s["end_time"] for s in stats) - min(s["start_time"] for s in stats)
    return {"images": ok, "seconds": seconds, "cpu_s": result["cpu_s"]}


def run_cpu_limit(paths: list[Path], out: Path, cpus: list[int], threads: int) -> dict:
    out.mkdir(parents=True)
    processes = []
    for index, cpu in enumerate(cpus):
        listing = out / f"files-{index}.txt"
        listing.write_text("\n".join(str(p) for p in paths[index :: len(cpus)]))
        processes.append(_spawn_worker("cpu-limit", {cpu}, out / f"cpu-limit-{index}.log", list=listing, threads=threads))
    results = _collect(processes)
    seconds = max(r["end"] for r in results) - min(r["start"] for r in results)
    images = sum(r["ok"] for r in results)
    return {"images": images, "seconds": seconds, "cpu_ms_per_image": 1e3 * sum(r["cpu_s"] for r in results) / images}


def check_output_sizes(tar: Path) -> None:
    """The first image of a tar must have its longest side at MAX_SIDE (all inputs are larger)."""
    from PIL import Image

    with tarfile.open(tar) as archive:
        for member in archive:
            if member.name.endswith(".jpg"):
                with Image.open(archive.extractfile(member)) as image:
                    if max(image.size) != MAX_SIDE:
                        raise RuntimeError(f"{tar}:{member.name} is {image.size}, expected longest side {MAX_SIDE}")
                return
    raise RuntimeError(f"{tar} holds no .jpg")


# -- report ------------------------------------------------------------------------------------


def machine_notes(server_cpu: int, client_cpus: list[int]) -> str:
    import PIL
    import urllib3

    model = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return (
        f"{model}, {os.cpu_count()} logical CPUs, Python {platform.python_version()}, Pillow {PIL.__version__}, "
        f"urllib3 {urllib3.__version__}, {IMG2DATASET}; server pinned to CPU {server_cpu}, clients to CPU(s) {','.join(map(str, client_cpus))}"
    )


def overload_note(load_before: float, load_after: float, shares: dict[str, float]) -> str:
    """A warning for the docs when other jobs held more CPUs than the machine has: then the methods'
    images/s differ by the share of the client CPU each got, more than by their own cost."""
    if min(load_before, load_after) <= (os.cpu_count() or 1):
        return ""
    got = ", ".join(f"{method} {share:.0%}" for method, share in shares.items())
    return (
        f"\n**This run was overloaded** (load above the {os.cpu_count()} CPUs throughout): the methods got unequal"
        f" shares of the client CPU ({got}), so their images/s compare those shares more than the methods."
        " Compare CPU time per image here; images/s only on a quiet machine."
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command")
    worker = sub.add_parser("worker", help="internal: one measured process")
    worker.add_argument("kind", choices=sorted(WORKERS))
    for name in ("tsv", "out", "rows", "list", "options"):
        worker.add_argument(f"--{name}")
    for name in ("shard-rows", "shard", "threads"):
        worker.add_argument(f"--{name}", type=int)
    parser.add_argument("--images", type=int, default=2000, help="number of generated JPEGs (default 2000)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of all three methods (default 3)")
    parser.add_argument("--threads", type=int, default=8, help="download threads per process, ours and img2dataset")
    parser.add_argument("--server-cpu", type=int, default=0)
    parser.add_argument("--client-cpus", default="1", help="comma-separated; one measured process per CPU")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/vlbert-bench-download"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--methods", default=",".join(METHODS), help="subset to run, comma-separated")
    parser.add_argument("--write-docs", action="store_true", help=f"replace the {SECTION!r} section of docs/benchmarks.md")
    args = parser.parse_args(argv)

    if args.command == "worker":
        print(json.dumps(WORKERS[args.kind](args)))
        return 0

    client_cpus = [int(cpu) for cpu in args.client_cpus.split(",")]
    methods = args.methods.split(",")
    if unknown := set(methods) - set(METHODS):
        parser.error(f"unknown methods {sorted(unknown)}; known: {METHODS}")
    available = os.sched_getaffinity(0)
    if not {args.server_cpu, *client_cpus} <= available:
        parser.error(f"CPUs {sorted({args.server_cpu, *client_cpus})} are not all available (have {sorted(available)})")
    args.workdir.mkdir(parents=True, exist_ok=True)
    paths = ensure_images(args.workdir, args.images, args.seed)
    images = describe_images(paths)
    server, port = start_server(paths[0].parent, args.server_cpu)
    runs = args.workdir / "runs"
    shutil.rmtree(runs, ignore_errors=True)
    runs.mkdir()
    try:
        tsv = runs / "cc.tsv"  # the official layout: caption<TAB>url, no header
        lines = [f"photo number {i} of the benchmark\thttp://127.0.0.1:{port}/{p.name}" for i, p in enumerate(paths)]
        tsv.write_text("\n".join(lines) + "\n", encoding="utf-8")
        tsv_with_header = runs / "cc_with_header.tsv"  # img2dataset reads column names from a header line
        tsv_with_header.write_text("caption\turl\n" + tsv.read_text(encoding="utf-8"), encoding="utf-8")
        # A run's CPU time holds fixed costs (img2dataset's shard and logger processes import their
        # modules anew; our partition's first pyarrow array imports pandas); a run of each method
        # over CALIBRATION_ROWS rows measures that fixed part, to subtract.
        tsv_calibration = runs / "cc_calibration.tsv"
        tsv_calibration.write_text("\n".join(lines[:CALIBRATION_ROWS]) + "\n", encoding="utf-8")
        tsv_calibration_with_header = runs / "cc_calibration_with_header.tsv"
        tsv_calibration_with_header.write_text("caption\turl\n" + tsv_calibration.read_text(encoding="utf-8"), encoding="utf-8")

        rates: dict[str, list[float]] = {method: [] for method in methods}
        cpu_ms: dict[str, list[float]] = {method: [] for method in methods}
        fixed_cpu_s: dict[str, list[float]] = {method: [] for method in methods}
        partition_s: list[float] = []
        load_before = os.getloadavg()
        for round_index in range(args.rounds):
            order = methods[round_index % len(methods) :] + methods[: round_index % len(methods)]
            for method in order:
                out = runs / f"{method}-round{round_index}"
                if method == "ours":
                    fixed = run_ours(tsv_calibration, out / "calibration", client_cpus, args.threads, CALIBRATION_ROWS)
                    result = run_ours(tsv, out / "full", client_cpus, args.threads, len(paths))
                    partition_s.append(result["partition_s"])
                    check_output_sizes(out / "full" / f"{SPLIT}-00000.tar")
                elif method == "img2dataset":
                    fixed = run_img2dataset(tsv_calibration_with_header, out / "calibration", client_cpus, args.threads,
                                            CALIBRATION_ROWS)
                    result = run_img2dataset(tsv_with_header, out / "full", client_cpus, args.threads, len(paths))
                    check_output_sizes(sorted((out / "full" / "output").glob("*.tar"))[0])
                else:
                    result = run_cpu_limit(paths, out, client_cpus, args.threads)
                if method != "cpu_limit":
                    result["cpu_ms_per_image"] = (
                        1e3 * (result["cpu_s"] - fixed["cpu_s"]) / (len(paths) - CALIBRATION_ROWS)
                    )
                    fixed_cpu_s[method].append(fixed["cpu_s"])
                rate = result["images"] / result["seconds"]
                rates[method].append(rate)
                cpu_ms[method].append(result["cpu_ms_per_image"])
                cpu_note = f", {result['cpu_ms_per_image']:.2f} CPU ms/image"
                print(f"round {round_index} {method:12s} {result['images']} images in {result['seconds']:6.2f} s"
                      f" = {rate:6.1f} images/s{cpu_note}", flush=True)
                if method != "cpu_limit":
                    shutil.rmtree(out)  # keep the disk use of many rounds small
        load_after = os.getloadavg()
        parts = [] if "ours" not in methods else [
            _collect([_spawn_worker("parts", {client_cpus[0]}, runs / "parts.log", tsv=tsv, threads=args.threads)])[0]
            for _ in range(args.rounds)
        ]
    finally:
        server.kill()
        server.join()

    medians = {method: statistics.median(values) for method, values in rates.items()}
    print("medians (images/s):", {method: round(value, 1) for method, value in medians.items()})
    if not {"ours", "img2dataset", "cpu_limit"} <= set(methods):
        return 0
    ratio = medians["ours"] / medians["img2dataset"]
    fraction = medians["ours"] / medians["cpu_limit"]
    cpu_medians = {method: statistics.median(values) for method, values in cpu_ms.items()}
    cpu_ratio = cpu_medians["img2dataset"] / cpu_medians["ours"]
    cpu_fraction = cpu_medians["cpu_limit"] / cpu_medians["ours"]
    # Round by round (the two ran minutes apart at most): how far the machine moves a single ratio.
    round_fractions = ", ".join(f"{ours / limit:.0%}" for ours, limit in zip(rates["ours"], rates["cpu_limit"]))
    print(f"ours / img2dataset = {ratio:.2f} (target >= 1.2); ours / CPU limit = {fraction:.0%} (target >= 90%)")
    print(f"by CPU time per image: ours / img2dataset = {cpu_ratio:.2f}, ours / CPU limit = {cpu_fraction:.0%}")
    part_ms = {name: statistics.median(run[name] for run in parts) for name in ("fetch", "resize", "write")}
    breakdown = f"""\
Ours taken apart (`worker parts`: each part alone over all the images, in one process on the
client CPU; medians of {len(parts)} runs), in CPU ms per image:

| part | CPU ms per image | of the resize |
|---|---|---|
| fetch: urllib3 over loopback, {args.threads} threads, no resize | {part_ms['fetch']:.2f} | {part_ms['fetch'] / part_ms['resize']:.0%} |
| resize_image on what was fetched (the CPU limit's work) | {part_ms['resize']:.2f} | 100% |
| write: sha256, json and webdataset TarWriter (3 members per sample) | {part_ms['write']:.2f} | {part_ms['write'] / part_ms['resize']:.0%} |
| the three, added | {sum(part_ms.values()):.2f} | {sum(part_ms.values()) / part_ms['resize']:.0%} |
| ours, whole (the median above) | {cpu_medians['ours']:.2f} | {cpu_medians['ours'] / part_ms['resize']:.0%} |
"""
    fixed_note = " and ".join(
        f"{statistics.median(fixed_cpu_s[method]):.2f} s ({method})" for method in ("ours", "img2dataset")
    )
    command = "uv run python benchmarks/download.py " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
    shares = {method: medians[method] * cpu_medians[method] / 1e3 / len(client_cpus) for method in methods}
    rows = "\n".join(
        f"| {method} | {medians[method]:.1f} | {', '.join(f'{r:.1f}' for r in rates[method])} | "
        f"{cpu_medians[method]:.2f} | {shares[method]:.0%} |"
        for method in methods
    )
    body = f"""\
Measured {time.strftime('%Y-%m-%d')} with `{command.strip()}`.

{images['count']} generated photo-like JPEGs (quality 90), {images['width_range'][0]}-{images['width_range'][1]} x \
{images['height_range'][0]}-{images['height_range'][1]} px (median {images['megapixels_median']:.2f} MP), \
{images['kb_min']:.0f}-{images['kb_max']:.0f} KB (median {images['kb_median']:.0f} KB), served from memory by a keep-alive HTTP/1.1
server on 127.0.0.1. Output: longest side {MAX_SIDE} (only shrinking), JPEG quality
{QUALITY}, webdataset tars; {args.threads} download threads per process; one process per client CPU.

| method | images/s (median) | each round (rotating order) | CPU ms per image (median) | client CPU share |
|---|---|---|---|---|
{rows}

- **ours / img2dataset: {ratio:.2f}x** in images/s (target >= 1.2x); {cpu_ratio:.2f}x in CPU time per image
- **ours / CPU limit: {fraction:.0%}** in images/s (target >= 90%); {cpu_fraction:.0%} in CPU time per image
  (round by round, in images/s: {round_fractions})

{breakdown}
CPU time per image (user + system, of the measured processes and their children) is what a
loaded machine disturbs least. Wall-clock rates also depend on the share of the client CPU that
each run gets while other jobs run on the machine (the last column: images/s x CPU time per
image); on a quiet machine every run gets the whole client CPU and images/s is 1000 / CPU ms.

Ours is `partition_cc_tsv` + `download_cc_shard`, each timed inside its process after its
imports; images/s is over the shard processes. img2dataset ({IMG2DATASET}, `--resize_mode keep_ratio_largest
--resize_only_if_bigger True --encode_quality {QUALITY} --extract_exif False`, same threads and
processes) is timed by its per-shard stats JSON (`start_time` to `end_time`, inside its shard
worker). So neither rate holds the step that splits the TSV for the shard workers (our partition
took {statistics.median(partition_s) if partition_s else float("nan"):.2f} s of wall time, median). The CPU time per image of
both is that of the full run (every process, the partition included) minus that of a
{CALIBRATION_ROWS}-row run, over the rows in between: what one more image costs. The {CALIBRATION_ROWS}-row runs
themselves took {fixed_note} of CPU (median): start-up that a real shard of thousands of rows
pays once. The CPU limit is our `resize_image` over the same files already in memory, on as many
threads as the downloaders use.
Machine: {machine_notes(args.server_cpu, client_cpus)}. Load average {load_before[0]:.1f} before and
{load_after[0]:.1f} after, on {os.cpu_count()} CPUs (other jobs share this machine, hence the rotating rounds
and medians).{overload_note(load_before[0], load_after[0], shares)}
"""
    print(body)
    if args.write_docs:
        replace_section(SECTION, body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
