"""Command line for one pre-training run, to be started under torchrun (one process per GPU) or srun.

    torchrun --standalone --nproc_per_node 8 -m vlbert_core.pretrain --setting full \\
        --config config/config.yaml --config my_cluster.yaml \\
        --cc-shards results/shards/cc/train-*.tar --roi-parquets results/rois/cc/train-*.parquet \\
        --text-shards results/shards/text/*.tar --detector results/detector/model.pt \\
        --out results/pretrain/full

The `model:` and `pretrain:` sections (and `seed`, `device`) come from the --config files, merged in
order like Snakemake's --configfile; it writes what rule `pretrain` writes. Every process runs this same
command: torchrun gives each its RANK / LOCAL_RANK / WORLD_SIZE.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from vlbert_core.utils import read_yaml, setup_compute, setup_logging

from .launch import RANK_LOG


def merge(base: dict, override: dict) -> dict:
    """Nested dicts merged key by key (override wins), as Snakemake merges --configfile over configfile."""
    out = dict(base)
    for key, value in override.items():
        out[key] = merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m vlbert_core.pretrain", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--setting", required=True, help="Table 4 setting: none, a, b, c, d or full")
    parser.add_argument("--config", action="append", required=True, type=Path,
                        help="YAML config file; repeat to merge several, later ones win")
    parser.add_argument("--cc-shards", nargs="+", required=True, help="CC webdataset tars")
    parser.add_argument("--roi-parquets", nargs="+", required=True, help="their RoI parquets (same file names)")
    parser.add_argument("--text-shards", nargs="*", default=[], help="text tars (settings d and full)")
    parser.add_argument("--detector", required=True, help="the detector checkpoint (results/detector/model.pt)")
    parser.add_argument("--out", required=True, type=Path, help="output directory (results/pretrain/{setting})")
    parser.add_argument("--init-from", default=None,
                        help="continue pre-training this model directory, its pre-training heads included (ours, or "
                             "a released VL-BERT converted with `python -m vlbert_core.convert vl-bert`), instead "
                             "of starting from BERT and the detector; with --setting none, only measure it (its "
                             "MLM accuracy on the held-out captions, visual_clue.json)")
    parser.add_argument("--device", help="cpu or cuda (default: the config's `device`)")
    parser.add_argument("--threads", type=int, default=None,
                        help="CPU threads per process (default: cores / processes on this node)")
    parser.add_argument("--log", type=Path, help="log file (default: <out>/pretrain.rank<RANK>.log)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    config: dict = {}
    for path in args.config:
        if not path.is_file():
            raise FileNotFoundError(f"--config {path} does not exist")
        config = merge(config, read_yaml(path, "--config"))
    for key in ("model", "pretrain", "seed"):
        if key not in config:
            raise KeyError(f"the merged --config files {[str(p) for p in args.config]} have no '{key}'")
    rank = int(os.environ.get("RANK", "0"))
    setup_logging(args.log or args.out / RANK_LOG.format(rank=rank))
    local_processes = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    setup_compute(args.threads or max(1, (os.cpu_count() or 1) // local_processes))
    from .loop import pretrain

    pretrain_cfg = {k: v for k, v in config["pretrain"].items() if k not in ("settings", "launch")}
    return pretrain(setting=args.setting, cc_shards=args.cc_shards, roi_parquets=args.roi_parquets,
                    text_shards=args.text_shards, detector_path=args.detector, model_cfg=dict(config["model"]),
                    pretrain_cfg=pretrain_cfg, out_dir=str(args.out), seed=int(config["seed"]),
                    device=args.device or str(config.get("device", "cpu")), init_from=args.init_from,
                    **({"max_image_pixels": int(config["max_image_pixels"])} if "max_image_pixels" in config else {}))


if __name__ == "__main__":
    import sys

    from vlbert_core.cli import run_command

    sys.exit(run_command(main, "python -m vlbert_core.pretrain"))
