"""Benchmark: one pre-training step of this project against the authors' own code (jackroos/VL-BERT), side by side.

Both sides train the released e2e architecture (cfgs/pretrain/base_e2e_16x16G_fp16.yaml: ResNet-101 C4 with
stages 1-2 and every BatchNorm frozen, dilated stage 5 on 14 x 14 RoIs, BERT-BASE) from the same weights, on
the same batch: <caption, image> rows with masked words and masked RoIs (pixels zeroed), text-only rows with
masked words; MLM on both kinds, masked-RoI classification. A step is forward, backward and a plain SGD
update of the trainable parameters, fp32 on the CPU.

- The weights: a stand-in of the released checkpoint with trained-like random values
  (vlbert_core/convert/vlbert/reference.py), in the authors' format for them and converted (`python -m
  vlbert_core.convert vl-bert`) for us. Our model continues from it in setting `full`
  (pretrain.start_from_model), as `pretrain.init_from` does.
- The batch, in the authors' arrays: `fixture` is the converter check's batch (2 images of 112 x 80 and
  96 x 64 with 5 and 4 boxes, 2 text-only rows); `released` has the released per-GPU batch, 8 <caption, image>
  rows and 8 text-only rows of 64 word pieces (TRAIN.BATCH_IMAGES [8, 8], SEQ_LEN 64), on images of
  RELEASED_IMAGE (W x H) with RELEASED_BOXES boxes each instead of 600 x 1000 with 10-100: a step at full
  size takes minutes on a CPU, and the image size scales both sides' convolutions alike.
- Their code runs in their own environment (--authors-python), from a checkout the user downloaded
  (--authors-repo; nothing of it is in this repository), with two CPU stand-ins, torchvision's RoIAlign for
  their compiled op and a Loader for yaml.load (benchmarks/authors_step.py,
  vlbert_core/convert/authors_runner.py). Their data loader zeroes the masked RoIs' pixels; that is done
  before their timed steps.
- Timing: each side in its own process, alternating (ours, theirs / theirs, ours / ...) for --pairs pairs per
  thread count; a process times --steps steps after one untimed step and reports their median and its peak
  RSS (the whole process: loading included). The ratio is taken per pair, ours / theirs.
- Both sides also report the three losses on the batch in eval mode (no dropout): they must agree (the
  converter's exactness, docs/released-architecture.md).
- The floor: the least a step of ours could take beside the authors' visual network, whose convolutions are
  the same kernels on the same shapes on both sides. It is our visual network's forward and backward as
  measured, plus the rest of the step's counted FLOPs (torch.utils.flop_counter: matmuls, convolutions,
  attention) at the rate of a 1024 x 1024 x 1024 matmul in the same process, plus the SGD update as timed in
  the steps; every other operation is taken to cost nothing. A floor / authors ratio above a target says that
  no saving outside the convolutions reaches it.

    uv run python benchmarks/vs_authors.py --authors-repo VL-BERT --authors-python VENV/bin/python \\
        --threads 1 2 --batch fixture released --write-docs
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from docs_section import replace_section  # noqa: E402

SECTION = "## Against the authors' code (pre-training step, paper architecture)"
LAYOUT = "pretrain-e2e"
MANIFEST = REPO / "vlbert_core" / "convert" / "manifests" / "vl-bert-base-e2e.json"
AUTHORS_STEP = REPO / "benchmarks" / "authors_step.py"
RELEASED_IMAGE = (160, 120)       # W x H of the released batch's images
RELEASED_BOXES = 10               # per image, the whole-image box included
RELEASED_ROWS = 8                 # <caption, image> rows, and as many text-only rows (TRAIN.BATCH_IMAGES)
TEXT_ROW_LENGTH = 64              # the general corpus' SEQ_LEN
MASK_PROBABILITY = 0.15
LOSS_TOLERANCE = 1e-4
VISUAL_REPEATS = 3                # our visual network's forward + backward, timed alone (median)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--authors-repo", type=Path, help="a checkout of jackroos/VL-BERT")
    parser.add_argument("--authors-python", default=sys.executable, help="the Python of the authors' environment")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--batch", nargs="+", choices=["fixture", "released"], default=["fixture", "released"])
    parser.add_argument("--pairs", type=int, default=4, help="alternating pairs per batch and thread count")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per process (after one untimed)")
    parser.add_argument("--seed", type=int, default=0, help="of the stand-in weights and of the batches")
    parser.add_argument("--workdir", type=Path, default=None, help="keep the weights and batches here")
    parser.add_argument("--write-docs", action="store_true", help="write the section of docs/benchmarks.md")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--inputs", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if not args.worker and args.authors_repo is None:
        parser.error("--authors-repo is required")
    return args


# ---- the batches ----------------------------------------------------------------------------------------------

def released_batch(seed: int, image: tuple[int, int] = RELEASED_IMAGE, boxes_per_image: int = RELEASED_BOXES,
                   rows: int = RELEASED_ROWS, text_length: int = TEXT_ROW_LENGTH) -> dict[str, np.ndarray]:
    """The released per-GPU batch in the authors' arrays (reference.reference_inputs' keys): `rows`
    (RELEASED_ROWS) images of `image` (W x H) with `boxes_per_image` boxes and a caption each, `rows` text-only
    rows of `text_length` word pieces; 15% of the words and of the boxes (never box 0) masked, at least one of
    each per row. benchmarks/gpu.py --authors-repo asks for the full released sizes."""
    RELEASED_IMAGE, RELEASED_BOXES, RELEASED_ROWS, TEXT_ROW_LENGTH = image, boxes_per_image, rows, text_length
    from vlbert_core.convert.vlbert.reference import CLS_ID, FIRST_WORD_ID, MASK_ID, NUM_REGION_CLASSES, SEP_ID

    rng = np.random.default_rng([seed, 1])
    (w, h), n = RELEASED_IMAGE, RELEASED_BOXES
    yy, xx = np.mgrid[0:h, 0:w]
    images = np.stack([np.clip(128 + 90 * np.stack([np.sin(xx / (7.0 + 3 * c) + yy / (5.0 + c) + rng.uniform(0, 6))
                                                     for c in range(3)], -1) + rng.normal(0, 20, (h, w, 3)), 0, 255)
                       for _ in range(RELEASED_ROWS)]).astype(np.uint8)
    boxes = np.zeros((RELEASED_ROWS, n, 4), dtype=np.float32)
    boxes[:, 0] = [0, 0, w - 1, h - 1]
    x1, y1 = rng.uniform(0, w * 0.6, (RELEASED_ROWS, n - 1)), rng.uniform(0, h * 0.6, (RELEASED_ROWS, n - 1))
    boxes[:, 1:] = np.stack([x1, y1, rng.uniform(x1 + 8, w - 1), rng.uniform(y1 + 8, h - 1)], -1)

    def masked(ids: np.ndarray, first: int, last: int) -> tuple[np.ndarray, np.ndarray]:
        ids, labels = ids.copy(), np.full(len(ids), -1, dtype=np.int64)
        positions = np.arange(first, last)
        chosen = positions[rng.uniform(size=len(positions)) < MASK_PROBABILITY]
        chosen = chosen if len(chosen) else rng.choice(positions, 1)
        labels[chosen] = ids[chosen]
        ids[chosen] = MASK_ID
        return ids, labels

    def padded(rows: list[np.ndarray], pad: int) -> np.ndarray:
        out = np.full((len(rows), max(len(r) for r in rows)), pad, dtype=np.int64)
        for i, r in enumerate(rows):
            out[i, : len(r)] = r
        return out

    captions = [masked(np.concatenate([[CLS_ID], rng.integers(FIRST_WORD_ID, 29000, k), [SEP_ID]]), 1, k + 1)
                for k in rng.integers(8, 21, RELEASED_ROWS)]
    texts = [masked(rng.integers(FIRST_WORD_ID, 29000, TEXT_ROW_LENGTH), 0, TEXT_ROW_LENGTH)
             for _ in range(RELEASED_ROWS)]
    ops = (rng.uniform(size=(RELEASED_ROWS, n)) < MASK_PROBABILITY).astype(np.int64)
    ops[:, 0] = 0
    ops[ops.sum(1) == 0, 1] = 1
    labels = np.zeros((RELEASED_ROWS, n, NUM_REGION_CLASSES), dtype=np.float32)
    labels[ops == 1] = rng.dirichlet(np.full(NUM_REGION_CLASSES, 0.05), int(ops.sum()))
    return {"images": images, "image_sizes": np.array([RELEASED_IMAGE] * RELEASED_ROWS, dtype=np.int64),
            "boxes": boxes, "num_boxes": np.full(RELEASED_ROWS, n, dtype=np.int64),
            "text": padded([c for c, _ in captions], 0), "mlm_labels": padded([l for _, l in captions], -1),
            "aux_text": padded([t for t, _ in texts], 0), "aux_mlm_labels": padded([l for _, l in texts], -1),
            "mvrc_ops": ops, "mvrc_labels": labels}


def batch_inputs(name: str, seed: int) -> dict[str, np.ndarray]:
    from vlbert_core.convert.released_heads import get_layout
    from vlbert_core.convert.vlbert.reference import reference_inputs

    return reference_inputs(get_layout(LAYOUT), seed) if name == "fixture" else released_batch(seed)


def prepare(workdir: Path, batches: list[str], seed: int, batch_of=None) -> dict:
    """The stand-in checkpoint (the authors' format), its conversion, and each batch with its normalised images
    (batch_of(name, seed): the batch's arrays; default batch_inputs)."""
    from vlbert_core.convert.released_heads import get_layout
    from vlbert_core.convert.stages import save_arrays
    from vlbert_core.convert.verify import convert_files, write_stand_in_files
    from vlbert_core.convert.vlbert.reference import normalised_images
    from vlbert_core.models.common.config import visual_pixel_format
    from vlbert_core.models.registry import family

    layout = get_layout(LAYOUT)
    files = write_stand_in_files(MANIFEST, layout, workdir, seed)
    converted = convert_files(files, layout, workdir / "converted")
    config = family("vlbert").config_class.from_dict(json.loads((converted / "config.json").read_text()))
    paths = {}
    for name in batches:
        inputs = (batch_of or batch_inputs)(name, seed)
        inputs["normalised_images"] = normalised_images(inputs, visual_pixel_format(config))
        paths[name] = workdir / f"{name}.npz"
        save_arrays(inputs, paths[name])
    return {"checkpoint": files["checkpoint"], "vocab": Path(files["bert_path"]) / "vocab.txt",
            "converted": converted, "batches": paths}


# ---- our side (a worker process) ------------------------------------------------------------------------------

def our_worker(model_dir: Path, inputs_path: Path, threads: int, steps: int) -> dict:
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from vlbert_core.convert.stages import load_arrays
    from vlbert_core.convert.vlbert.reference import pretrain_batch
    from vlbert_core.pretrain.loop import start_from_model
    from vlbert_core.pretrain.settings import get_setting
    from vlbert_core.utils import setup_compute

    setup_compute(threads)     # as every job of the workflow starts (its threads, freed memory kept for reuse)
    torch.manual_seed(0)
    module = start_from_model(model_dir, get_setting("full"))
    batch = pretrain_batch(load_arrays(inputs_path), module.model.config)
    module.eval()
    with torch.no_grad():
        out = module(batch)
    losses = {"mlm_caption": float(out["mlm_loss"]), "mlm_text": float(out["mlm_text_loss"]),
              "roi": float(out["roi_loss"])}
    module.train()
    optimizer = torch.optim.SGD([p for p in module.parameters() if p.requires_grad], lr=1e-4)
    times, update_times = [], []
    for step in range(steps + 1):
        start = time.perf_counter()
        module(batch)["loss"].backward()
        before_update = time.perf_counter()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step > 0:
            times.append(time.perf_counter() - start)
            update_times.append(time.perf_counter() - before_update)

    def visual_forward_backward():
        # the Fast R-CNN alone: the part both sides compute with the same convolutions
        features = module.model.visual_features(batch.inputs)
        features.backward(torch.ones_like(features))

    visual_times = []
    for _ in range(VISUAL_REPEATS):
        start = time.perf_counter()
        visual_forward_backward()
        visual_times.append(time.perf_counter() - start)
        optimizer.zero_grad(set_to_none=True)
    visual_s = statistics.median(visual_times)
    with FlopCounterMode(display=False) as step_flops:
        module(batch)["loss"].backward()
    optimizer.zero_grad(set_to_none=True)
    with FlopCounterMode(display=False) as visual_flops:
        visual_forward_backward()
    optimizer.zero_grad(set_to_none=True)
    return {"side": "ours", "step_s": times, "update_s": statistics.median(update_times), "visual_s": visual_s,
            "rest_flops": step_flops.get_total_flops() - visual_flops.get_total_flops(),
            "gemm_flops_per_s": gemm_rate(), "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "losses": losses, "trainable": sum(p.numel() for p in module.parameters() if p.requires_grad)}


def gemm_rate(size: int = 1024, repeats: int = 10) -> float:
    """FLOP/s of a size^3 fp32 matmul at this process's threads (median of `repeats`, after one): about the
    fastest any of the step's matmuls can run here."""
    import torch

    a, b = torch.randn(size, size), torch.randn(size, size)
    a @ b
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - start)
    return 2 * size**3 / statistics.median(times)


def step_floor(ours: dict) -> float:
    """Seconds: our measured visual network + the rest's counted FLOPs at the GEMM rate + the measured update
    (the module docstring's floor)."""
    return ours["visual_s"] + ours["rest_flops"] / ours["gemm_flops_per_s"] + ours["update_s"]


# ---- alternating runs -----------------------------------------------------------------------------------------

def run_side(side: str, args, prepared: dict, batch: str, threads: int) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    if side == "ours":
        command = [sys.executable, str(Path(__file__).resolve()), "--worker", "--model", str(prepared["converted"]),
                   "--inputs", str(prepared["batches"][batch]), "--threads", str(threads), "--steps", str(args.steps)]
    else:
        command = [str(args.authors_python), str(AUTHORS_STEP), "--repo", str(args.authors_repo),
                   "--config", "cfgs/pretrain/base_e2e_16x16G_fp16.yaml", "--checkpoint", str(prepared["checkpoint"]),
                   "--vocab", str(prepared["vocab"]), "--inputs", str(prepared["batches"][batch]),
                   "--threads", str(threads), "--steps", str(args.steps)]
    result = subprocess.run(command, capture_output=True, text=True, env=env, cwd=REPO)
    if result.returncode != 0:
        raise SystemExit(f"vs_authors: the {side} step failed ({' '.join(command)}):\n{result.stderr[-3000:]}")
    record = json.loads(result.stdout.strip().splitlines()[-1])
    record["median_s"] = statistics.median(record["step_s"])
    return record


def measure(args, prepared: dict) -> list[dict]:
    rows = []
    for batch in args.batch:
        for threads in args.threads:
            pairs = []
            for k in range(args.pairs):
                order = ("ours", "authors") if k % 2 == 0 else ("authors", "ours")
                runs = {side: run_side(side, args, prepared, batch, threads) for side in order}
                ratio = runs["ours"]["median_s"] / runs["authors"]["median_s"]
                pairs.append({**runs, "ratio": ratio})
                print(f"{batch}, {threads} thread(s), pair {k + 1}: ours {runs['ours']['median_s']:.3f} s, "
                      f"authors {runs['authors']['median_s']:.3f} s, ratio {ratio:.3f}", file=sys.stderr, flush=True)
            rows.append({"batch": batch, "threads": threads, "pairs": pairs})
    return rows


def loss_check(pairs: list[dict]) -> tuple[float, dict, dict]:
    """The largest |ours - theirs| of the three eval-mode losses (the first pair's processes), and both sides'."""
    ours, theirs = pairs[0]["ours"]["losses"], pairs[0]["authors"]["losses"]
    return max(abs(ours[k] - theirs[k]) for k in ours), ours, theirs


def table(rows: list[dict]) -> str:
    lines = ["| batch | threads | ours, median step (s) | authors' (s) | ours / authors per pair | median ratio | "
             "ours: visual network fwd + bwd (s) | the rest, ours / authors' | floor (s) | floor / authors | "
             "peak RSS ours / authors (GB) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        pairs = row["pairs"]
        ours = statistics.median(p["ours"]["median_s"] for p in pairs)
        theirs = statistics.median(p["authors"]["median_s"] for p in pairs)
        ratios = [p["ratio"] for p in pairs]
        visual = statistics.median(p["ours"]["visual_s"] for p in pairs)
        floor = statistics.median(step_floor(p["ours"]) for p in pairs)
        rss_ours = max(p["ours"]["peak_rss_mb"] for p in pairs) / 1024
        rss_theirs = max(p["authors"]["peak_rss_mb"] for p in pairs) / 1024
        lines.append(f"| {row['batch']} | {row['threads']} | {ours:.3f} | {theirs:.3f} | "
                     f"{', '.join(f'{r:.3f}' for r in ratios)} | **{statistics.median(ratios):.3f}** | "
                     f"{visual:.3f} ({visual / ours:.0%}) | {(ours - visual) / (theirs - visual):.2f} | "
                     f"{floor:.3f} | {floor / theirs:.3f} | {rss_ours:.2f} / {rss_theirs:.2f} |")
    return "\n".join(lines)


def report(args, rows: list[dict]) -> str:
    command = ("uv run python benchmarks/vs_authors.py --authors-repo VL-BERT --authors-python AUTHORS_VENV/bin/python "
               f"--threads {' '.join(map(str, args.threads))} --batch {' '.join(args.batch)} --pairs {args.pairs} "
               f"--steps {args.steps} --write-docs")
    loss_lines = []
    for batch in args.batch:
        worst, ours, theirs = loss_check(next(r for r in rows if r["batch"] == batch)["pairs"])
        loss_lines.append(f"- {batch}: ours " + ", ".join(f"{k} {v:.6f}" for k, v in ours.items())
                          + "; the authors' " + ", ".join(f"{k} {v:.6f}" for k, v in theirs.items())
                          + f"; largest difference {worst:.1e}")
    first = rows[0]["pairs"][0]
    return "\n".join([
        "What a researcher choosing between this pipeline and the authors' repository pays per pre-training step on "
        "the same machine: the released e2e architecture (ResNet-101 C4, stages 1-2 and BatchNorm frozen; BERT-BASE), "
        "the same weights and batch, forward + backward + SGD step, fp32 on the CPU. How it is measured, and the "
        "stand-ins their code needs to run here, is in the script's docstring.",
        "",
        "```bash",
        command,
        "```",
        "",
        f"Measured {time.strftime('%Y-%m-%d')} on {platform.processor() or platform.machine()}, {os.cpu_count()} cores; "
        f"{args.pairs} alternating pairs per row, {args.steps} timed steps per process. Trainable parameters: ours "
        f"{first['ours']['trainable'] / 1e6:.1f}M, the authors' {first['authors']['trainable'] / 1e6:.1f}M. The "
        "visual network column is our process's Fast R-CNN forward and backward alone (median of "
        f"{VISUAL_REPEATS}, after the timed steps), with its share of our step. The same convolutions on the same "
        "shapes run on both sides, so the next column compares what is left of each step, taking the authors' "
        "visual network to cost what ours does: the embeddings, encoder, heads, losses and the update. The floor "
        "is the least our step could take with this visual network: it as measured, plus the rest's counted FLOPs "
        "at this process's rate for a 1024^3 matmul, plus the update as timed, everything else free. A floor / "
        "authors above 0.85 means that no saving outside the convolutions, which are the same kernels on both "
        "sides, brings the row to 0.85.",
        "",
        table(rows),
        "",
        "The losses on the batch in eval mode (dropout off), the two sides:",
        "",
        *loss_lines,
    ])


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        print(json.dumps(our_worker(args.model, args.inputs, args.threads[0], args.steps)))
        return 0
    with tempfile.TemporaryDirectory() as scratch:
        workdir = args.workdir or Path(scratch)
        workdir.mkdir(parents=True, exist_ok=True)
        prepared = prepare(workdir, args.batch, args.seed)
        rows = measure(args, prepared)
    text = report(args, rows)
    print(text)
    for row in rows:
        worst = loss_check(row["pairs"])[0]
        if worst > LOSS_TOLERANCE:
            print(f"vs_authors: the losses differ by {worst:.2e} on the {row['batch']} batch", file=sys.stderr)
            return 1
    if args.write_docs:
        replace_section(SECTION, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
