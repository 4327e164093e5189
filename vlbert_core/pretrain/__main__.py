"""Command line for one pre-training run, to be started under torchrun (one process per GPU) or srun.

    torchrun --standalone --nproc_per_node 8 -m vlbert_core.pretrain --setting full \\
        --config config/config.yaml --config my_cluster.yaml \\
        --cc-shards results/shards/cc/train-*.tar --roi-parquets results/rois/cc/train-*.parquet \\
        --text-shards results/shards/text/*.tar --detector results/detector/model.pt \\
        --out results/pretrain/full

The `model:` and `pretrain:` sections and the run context (`seed`, `device`, `max_image_pixels`: every one
required, --device overrides the device; vlbert_core/run_context.py) come from the --config files, merged in
order like Snakemake's --configfile (rule pretrain writes them into launch_config.yaml); it writes what rule
`pretrain` writes. Every process runs this same command: torchrun gives each its RANK / LOCAL_RANK / WORLD_SIZE.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from vlbert_core.config_schema import check_input_dir, check_input_file, merge, read_configs  # noqa: F401 (merge: re-exported)
from vlbert_core.run_context import RunContext
from vlbert_core.utils import setup_compute, setup_logging

from .launch import RANK_LOG


def build_parser() -> argparse.ArgumentParser:
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
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def check_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The flags' values, before anything is read, written or loaded (issue #56): a bad one is argparse's error
    (exit 2). The --config files, then the input paths (`check_inputs`), follow in `main`."""
    from .settings import SETTINGS

    if args.setting not in SETTINGS:
        parser.error(f"--setting {args.setting!r}: not a pre-training setting; expected one of {list(SETTINGS)}")
    if args.threads is not None and args.threads < 1:
        parser.error(f"--threads {args.threads}: must be at least 1")
    if args.device is not None and args.device not in ("cpu", "cuda"):
        parser.error(f"--device {args.device!r}: expected cpu or cuda")


def check_inputs(args: argparse.Namespace) -> None:
    """Every input path exists and is what it must be (a file, a model directory), and --out is no file: one line
    naming it (exit 1), before anything is written. Pairing each CC shard with its RoI parquet, and what the files
    hold, are the loop's checks."""
    for shard in args.cc_shards:
        check_input_file(shard, "--cc-shards")
    for parquet in args.roi_parquets:
        check_input_file(parquet, "--roi-parquets")
    for shard in args.text_shards:
        check_input_file(shard, "--text-shards")
    if args.init_from is None:
        check_input_file(args.detector, "--detector")   # with --init-from the detector is not read
    else:
        from vlbert_core.models.common.pretrained import CONFIG_FILE, MODEL_FILE

        directory = check_input_dir(args.init_from, "--init-from")
        for name in (CONFIG_FILE, MODEL_FILE):
            if not (directory / name).is_file():
                raise FileNotFoundError(f"--init-from {directory} has no {name}: a model directory holds "
                                        f"{MODEL_FILE} and {CONFIG_FILE}")
    if args.out.exists() and not args.out.is_dir():
        raise NotADirectoryError(f"--out {args.out} is a file, not a directory")
    if args.log is not None and args.log.is_dir():
        raise IsADirectoryError(f"--log {args.log} is a directory, not a file")


def check_device(device: str, where: str) -> None:
    """A cuda device on a machine without one is an error saying how to run on the CPU."""
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise RuntimeError(f"{where}: device cuda, but torch sees no CUDA device on this machine; run on the CPU "
                               f"with --device cpu (or device: cpu in the config)")


def main(argv: list[str] | None = None) -> dict:
    parser = build_parser()
    args = parser.parse_args(argv)
    check_arguments(parser, args)   # the flags' values (exit 2), then the input paths
    config = read_configs(args.config)   # each file exists, gives no key twice and fits config/schema.yaml
    files = f"the merged --config files {[str(p) for p in args.config]}"
    for key in ("model", "pretrain"):
        if key not in config:
            raise KeyError(f"{files} have no '{key}'")
    run = RunContext.from_params({**config, **({"device": args.device} if args.device else {})}, source=files)
    check_inputs(args)
    check_device(run.device, "--device" if args.device else files)
    rank = int(os.environ.get("RANK", "0"))
    setup_logging(args.log or args.out / RANK_LOG.format(rank=rank))
    local_processes = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    setup_compute(args.threads or max(1, (os.cpu_count() or 1) // local_processes))
    from vlbert_core.models.common.config import ModelSettings

    from .config import PretrainSettings
    from .loop import pretrain

    pretrain_cfg = {k: v for k, v in config["pretrain"].items() if k not in ("settings", "launch")}
    return pretrain(setting=args.setting, cc_shards=args.cc_shards, roi_parquets=args.roi_parquets,
                    text_shards=args.text_shards, detector_path=args.detector,
                    model_cfg=ModelSettings.from_config(dict(config["model"])),
                    pretrain_cfg=PretrainSettings.from_config(pretrain_cfg), out_dir=str(args.out), seed=run.seed,
                    device=run.device,
                    init_from=args.init_from, max_image_pixels=run.max_image_pixels)


if __name__ == "__main__":
    import sys

    from vlbert_core.cli import run_command

    sys.exit(run_command(main, "python -m vlbert_core.pretrain"))
