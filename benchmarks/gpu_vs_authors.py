"""benchmarks/gpu.py --authors-repo DIR: a pre-training step of ours beside the authors' (jackroos/VL-BERT) on
the same device, as each side's own training loop takes it.

- Same weights and batch as benchmarks/vs_authors.py makes them (its `prepare`: the stand-in of the released
  e2e checkpoint in the authors' format, converted for us; its `released_batch` at the sizes asked for): on a
  GPU the released per-GPU batch at full size, 8 <caption, image> rows of 1000 x 600 with 101 boxes + 8
  text-only rows of 64 word pieces, and `multiple` times that; in the CPU dry run a fixture size.
- Each side in its own process (one CUDA context, so torch.cuda.max_memory_allocated is its own), alternating
  (ours, theirs / theirs, ours / ...) for --authors-pairs pairs per batch; the ratio is taken per pair, ours /
  theirs, of the processes' median step.
- Ours: vlbert_core/pretrain/loop.py's step: bf16 autocast on CUDA (fp32 on the CPU), backward,
  clip_grad_norm_ 10, fused AdamW (benchmarks/gpu.py `training_step`, `measure`, whose FLOP count gives the
  MFU column). Theirs: benchmarks/authors_step.py with their training loop's step: torch.autocast fp16 + a
  dynamic GradScaler for their apex O2 on CUDA (fp32 on the CPU), torchvision's RoIAlign for their op, clip 10,
  their own AdamW. Both at lr 2.56e-5 (1e-7 per sample x 256), weight decay 1e-4.
- Peak memory: torch.cuda.max_memory_allocated over the warm-up and timed steps on a GPU; the process's peak
  RSS on the CPU (loading included).
- Both sides report the three losses on the batch in eval mode (fp32, no dropout); on the CPU they must agree
  within vs_authors.LOSS_TOLERANCE (the converter's exactness).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(BENCH))

import vs_authors  # noqa: E402

LR = 1e-7 * 256            # PAPER.md: lr 1e-7 per sample, 2.56e-5 at the released batch of 256
WEIGHT_DECAY = 1e-4
CLIP = 10.0


@dataclass(frozen=True)
class BatchSize:
    image: tuple[int, int]     # W x H
    boxes: int                 # per image, box 0 included
    rows: int                  # <caption, image> rows, and as many text-only rows
    text_length: int


RELEASED = BatchSize((1000, 600), 101, 8, 64)     # the released per-GPU batch at full size (gpu.py's IMAGE_WH)
DRY_RUN = BatchSize((112, 80), 3, 2, 12)


def batch_name(multiple: int) -> str:
    return f"x{multiple}"


def prepare(workdir: Path, size: BatchSize, multiples: list[int], seed: int) -> dict:
    def batch_of(name: str, seed: int) -> dict:
        return vs_authors.released_batch(seed, size.image, size.boxes, size.rows * int(name[1:]), size.text_length)

    return vs_authors.prepare(workdir, [batch_name(k) for k in multiples], seed, batch_of=batch_of)


# ---- our side (a worker process) ----------------------------------------------------------------------------

def our_worker(model_dir: Path, inputs_path: Path, device_name: str, warmup: int, steps: int, threads: int) -> dict:
    import torch

    import gpu
    from vlbert_core.convert.stages import load_arrays
    from vlbert_core.convert.vlbert.reference import pretrain_batch
    from vlbert_core.optim import OptimizerSettings, build_optimizer
    from vlbert_core.pretrain.loop import ADAM_BETAS, ADAM_EPS, start_from_model
    from vlbert_core.pretrain.settings import get_setting
    from vlbert_core.utils import setup_compute

    setup_compute(threads)
    torch.manual_seed(0)
    device = torch.device(device_name)
    module = start_from_model(model_dir, get_setting("full")).to(device)
    batch = pretrain_batch(load_arrays(inputs_path), module.model.config).to(device)
    module.eval()
    with torch.no_grad():
        out = module(batch)
    losses = {"mlm_caption": float(out["mlm_loss"]), "mlm_text": float(out["mlm_text_loss"]),
              "roi": float(out["roi_loss"])}
    module.train()
    optimizer = build_optimizer(module, OptimizerSettings("adamw", lr=LR, weight_decay=WEIGHT_DECAY, betas=ADAM_BETAS,
                                                          eps=ADAM_EPS, fused=True))
    dtype = torch.bfloat16 if device.type == "cuda" else None
    step = gpu.training_step(module, optimizer, lambda: module(batch)["loss"], CLIP, dtype, device)
    median, spread, flops, peak = gpu.measure(step, device, warmup, steps)
    return {"side": "ours", "step_s": [median], "spread_s": spread, "flops": flops, "peak_gpu_bytes": peak,
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "losses": losses,
            "trainable": sum(p.numel() for p in module.parameters() if p.requires_grad)}


# ---- alternating runs -----------------------------------------------------------------------------------------

def side_command(side: str, args, prepared: dict, multiple: int) -> list[str]:
    inputs = str(prepared["batches"][batch_name(multiple)])
    if side == "ours":
        return [sys.executable, str(Path(__file__).resolve()), "--worker", "--model", str(prepared["converted"]),
                "--inputs", inputs, "--device", args.device, "--warmup", str(args.warmup),
                "--steps", str(args.steps), "--threads", str(args.threads)]
    return [str(args.authors_python), str(vs_authors.AUTHORS_STEP), "--repo", str(args.authors_repo),
            "--config", "cfgs/pretrain/base_e2e_16x16G_fp16.yaml", "--checkpoint", str(prepared["checkpoint"]),
            "--vocab", str(prepared["vocab"]), "--inputs", inputs, "--threads", str(args.threads),
            "--steps", str(args.steps), "--warmup", str(args.warmup), "--device", args.device,
            "--precision", "fp16" if args.device == "cuda" else "fp32", "--optimizer", "adamw",
            "--lr", str(LR), "--weight-decay", str(WEIGHT_DECAY), "--clip", str(CLIP)]


def run_side(command: list[str], threads: int) -> dict | None:
    """The side's JSON record, or None where it ran out of GPU memory."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    result = subprocess.run(command, capture_output=True, text=True, env=env, cwd=REPO)
    if result.returncode != 0:
        if "out of memory" in result.stderr or "OutOfMemoryError" in result.stderr:
            return None
        raise SystemExit(f"gpu.py --authors-repo: a step failed ({' '.join(command)}):\n{result.stderr[-3000:]}")
    record = json.loads(result.stdout.strip().splitlines()[-1])
    record["median_s"] = statistics.median(record["step_s"])
    return record


def measure_pairs(args, prepared: dict, multiples: list[int], run=run_side) -> list[dict]:
    """Per batch multiple: the alternating pairs, or why the batch was not measured."""
    rows = []
    for multiple in multiples:
        pairs, why = [], None
        for k in range(args.authors_pairs):
            order = ("ours", "authors") if k % 2 == 0 else ("authors", "ours")
            runs = {}
            for side in order:
                runs[side] = run(side_command(side, args, prepared, multiple), args.threads)
                if runs[side] is None:
                    why = f"{'ours' if side == 'ours' else 'the authors’'} ran out of GPU memory"
                    break
            if why:
                break
            pairs.append({**runs, "ratio": runs["ours"]["median_s"] / runs["authors"]["median_s"]})
            print(f"vs authors, x{multiple}, pair {k + 1}: ours {runs['ours']['median_s']:.3f} s, authors "
                  f"{runs['authors']['median_s']:.3f} s, ratio {pairs[-1]['ratio']:.3f}", file=sys.stderr, flush=True)
        rows.append({"multiple": multiple, "pairs": pairs, "why": why})
        if why:
            break   # a larger batch fits no better
    return rows


def peak_of(record: dict) -> float:
    """GiB: the GPU peak where there is one, else the process's peak RSS."""
    return (record["peak_gpu_bytes"] / 2**30 if record.get("peak_gpu_bytes") is not None
            else record["peak_rss_mb"] / 1024)


def table(rows: list[dict], size: BatchSize, peak_flops: float | None) -> str:
    memory = "peak GPU memory" if rows and rows[0]["pairs"] and rows[0]["pairs"][0]["ours"].get(
        "peak_gpu_bytes") is not None else "peak RSS"
    lines = [f"| batch per step | ours, median step (ms) | authors' (ms) | ours / authors per pair | median ratio | "
             f"{memory} ours / authors (GiB) | ours: MFU |",
             "|---|---:|---:|---|---:|---:|---:|"]
    for row in rows:
        rows_ = size.rows * row["multiple"]
        batch = f"{rows_} <caption, image> ({size.image[0]}x{size.image[1]}, {size.boxes} boxes) + {rows_} text-only"
        if not row["pairs"]:
            lines.append(f"| {batch} | {row['why']} | | | | | |")
            continue
        pairs = row["pairs"]
        ours = statistics.median(p["ours"]["median_s"] for p in pairs)
        theirs = statistics.median(p["authors"]["median_s"] for p in pairs)
        ratios = [p["ratio"] for p in pairs]
        mfu = "n/a" if peak_flops is None else f"{100 * pairs[0]['ours']['flops'] / ours / peak_flops:.1f}%"
        lines.append(f"| {batch} | {1000 * ours:.0f} | {1000 * theirs:.0f} | {', '.join(f'{r:.3f}' for r in ratios)} | "
                     f"**{statistics.median(ratios):.3f}** | {max(peak_of(p['ours']) for p in pairs):.1f} / "
                     f"{max(peak_of(p['authors']) for p in pairs):.1f} | {mfu} |")
    return "\n".join(lines)


def loss_gaps(rows: list[dict]) -> list[float]:
    return [max(abs(r["pairs"][0]["ours"]["losses"][k] - r["pairs"][0]["authors"]["losses"][k])
                for k in r["pairs"][0]["ours"]["losses"]) for r in rows if r["pairs"]]


def run(args, size: BatchSize, peak_flops: float | None) -> tuple[str, list[dict]]:
    """The table of ours beside the authors' at args.authors_multiples x `size`."""
    with tempfile.TemporaryDirectory() as scratch:
        prepared = prepare(Path(scratch), size, args.authors_multiples, seed=0)
        rows = measure_pairs(args, prepared, args.authors_multiples)
    gaps = loss_gaps(rows)
    if args.device == "cpu" and any(g > vs_authors.LOSS_TOLERANCE for g in gaps):
        raise SystemExit(f"gpu.py --authors-repo: the two sides' eval losses differ by {max(gaps):.1e} (fp32)")
    text = "\n".join([
        table(rows, size, peak_flops), "",
        f"Eval-mode losses (fp32, dropout off), largest |ours - theirs| per batch: "
        f"{', '.join(f'{g:.1e}' for g in gaps) or 'none measured'}."])
    return text, rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", action="store_true", required=True)
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--inputs", type=Path, required=True)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    print(json.dumps(our_worker(args.model, args.inputs, args.device, args.warmup, args.steps, args.threads)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
