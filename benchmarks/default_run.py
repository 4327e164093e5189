"""Benchmark: where the default run spends its time.

1. Per rule, from a finished run directory: the jobs' seconds from the Snakemake `benchmark:` files under
   RUN_DIR/benchmarks/rules/ (job seconds per rule, job count, share) and the run's wall time from its
   Snakemake log (vlbert_core/rule_times.py).
2. Per step part, for pre-training and fine-tuning: a few steps of the real loops (`pretrain`, `finetune`,
   unchanged) on the run's own data and the default config's model, timed from the outside. Module hooks
   on the visual network, the embeddings and the encoder, a hook on the optimizer's step and a wrapped
   batch source cut each step's wall time into consecutive parts:

     data            fetching and collating the batch (and moving it to the device)
     visual network  the Fast R-CNN forward (and its backward when it is tuned)
     encoder         embeddings + Transformer forward, and their backward up to the word-embedding gradient
                     (gradient clipping, which follows the backward, is counted here too)
     heads + losses  from the encoder's output to its gradient: the heads' forward, the losses, zero_grad
                     and the heads' backward
     optimizer       optimizer.step
     rest            the loop's bookkeeping after the step (scheduler, metrics, logging, checkpoints)

   The first measured step is a warm-up and is left out.

    uv run python benchmarks/default_run.py RUN_DIR --write-docs

RUN_DIR is the directory of a finished default run (`uv run snakemake --cores all
results/tables/table4_ablation.csv`): results/shards, results/rois, results/pretrain/<setting> and the
task sources under resources/ are read from it; nothing in it is written.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from docs_section import replace_section  # benchmarks/ is on sys.path when a benchmark runs as a script

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

# torch and the model are imported where a step is timed: --help and --rules-only answer without them
from vlbert_core.pretrain.__main__ import merge  # noqa: E402
from vlbert_core.rule_times import rule_table, rule_times, run_wall_seconds  # noqa: E402
from vlbert_core.utils import setup_compute  # noqa: E402

SECTION = "## Default run profile"
PARTS = ("data", "visual network", "encoder", "heads + losses", "optimizer", "rest")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", type=Path, help="directory of a finished default run")
    parser.add_argument("--configfile", type=Path, nargs="*", default=[],
                        help="the run's --configfile(s), merged over config/config.yaml as Snakemake does")
    parser.add_argument("--steps", type=int, default=12, help="measured steps of each loop (default 12)")
    parser.add_argument("--setting", default="d", help="pre-training setting whose step is timed (default d)")
    parser.add_argument("--finetune-task", default="vqa", help="fine-tuning task whose step is timed (default vqa)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads, as a workflow job gets (default 1)")
    parser.add_argument("--rules-only", action="store_true", help="only the per-rule table (no step timing)")
    parser.add_argument("--write-docs", action="store_true", help=f"replace '{SECTION}' in docs/benchmarks.md")
    return parser.parse_args()


class StepTimeline:
    """Charges the wall time between consecutive events of a training step to the part that was running."""

    def __init__(self) -> None:
        self.steps: list[Counter] = []
        self._current: Counter | None = None
        self._part = "rest"
        self._last = 0.0

    def enter(self, part: str) -> None:
        now = time.perf_counter()
        if self._current is not None:
            self._current[self._part] += now - self._last
        self._part, self._last = part, now

    def new_step(self) -> None:
        self.enter("data")
        if self._current is not None:
            self.steps.append(self._current)
        self._current = Counter()

    @contextlib.contextmanager
    def installed(self):
        """Hooks on every VL-BERT visual network, embeddings and encoder, and on every optimizer step."""
        import torch
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

        from vlbert_core.models.common.visual import FastRCNNVisualNetwork
        from vlbert_core.models.registry import family

        pretraining = family("vlbert").load("pretraining_module")
        parts = {}  # the running model's embeddings and encoder, read off its pre-training module

        def pre(module, args):
            if isinstance(module, pretraining):
                parts.update(embeddings=module.model.embeddings, encoder=module.model.encoder)
            elif isinstance(module, FastRCNNVisualNetwork):
                self.enter("visual network")
            elif module is parts.get("embeddings"):
                self.enter("encoder")

        def post(module, args, output):
            if isinstance(module, FastRCNNVisualNetwork):
                self.enter("encoder")
                if isinstance(output, torch.Tensor) and output.requires_grad:  # tuned: its backward comes last
                    output.register_hook(lambda grad: self.enter("visual network"))
            elif module is parts.get("encoder"):
                self.enter("heads + losses")
                if output.requires_grad:  # the heads' backward ends when the encoder output's gradient is ready
                    output.register_hook(lambda grad: self.enter("encoder"))

        handles = [torch.nn.modules.module.register_module_forward_pre_hook(pre),
                   torch.nn.modules.module.register_module_forward_hook(post),
                   register_optimizer_step_pre_hook(lambda *a: self.enter("optimizer")),
                   register_optimizer_step_post_hook(lambda *a: self.enter("rest"))]
        try:
            yield self
        finally:
            for handle in handles:
                handle.remove()

    def summary(self) -> tuple[dict[str, float], int]:
        """Mean seconds per step of each part, over the complete steps after the first (a warm-up)."""
        measured = self.steps[1:]
        if not measured:
            raise RuntimeError("fewer than two complete steps were timed")
        return {part: statistics.mean(s[part] for s in measured) for part in PARTS}, len(measured)


def time_pretraining(run_dir: Path, cfg: dict, setting: str, steps: int) -> tuple[dict[str, float], int]:
    from vlbert_core.pretrain import data as pretrain_data
    from vlbert_core.pretrain import pretrain

    results = run_dir / "results"
    cc = sorted(str(p) for split in cfg["cc"]["splits"] for p in (results / "shards" / "cc").glob(f"{split}-*.tar"))
    rois = [str(results / "rois" / "cc" / (Path(p).stem + ".parquet")) for p in cc]
    text = sorted(str(p) for corpus in cfg["text"]["corpora"]
                  for p in (results / "shards" / "text").glob(f"{corpus}-*.tar"))
    detector = cfg["detector"]["weights"] or str(results / "detector" / "model.pt")
    missing = [p for p in [*cc, *rois, *text, detector] if not Path(p).exists()] or ([] if cc else ["CC shards"])
    if missing:
        raise FileNotFoundError(f"{run_dir}: the pre-training inputs {missing[:4]} are missing; is it a finished run?")
    pretrain_cfg = {k: v for k, v in cfg["pretrain"].items() if k not in ("settings", "launch")}
    pretrain_cfg.update(steps=steps + 2, checkpoint_every=10 ** 9)   # + the warm-up and the step that closes the last
    timeline = StepTimeline()
    batches_next = pretrain_data.PretrainBatches.__next__

    def timed_next(self):
        timeline.new_step()
        return batches_next(self)

    pretrain_data.PretrainBatches.__next__ = timed_next
    try:
        with timeline.installed(), tempfile.TemporaryDirectory() as out:
            pretrain(setting, cc, rois, text, detector, dict(cfg["model"]), pretrain_cfg, out,
                     seed=int(cfg["seed"]), device=str(cfg["device"]), stop_after_step=steps + 2)
    finally:
        pretrain_data.PretrainBatches.__next__ = batches_next
    return timeline.summary()


def time_finetuning(run_dir: Path, cfg: dict, setting: str, task: str, steps: int) -> tuple[dict[str, float], int]:
    from vlbert_core.tasks import finetune as finetune_module
    from vlbert_core.tasks.registry import get_task

    task_def = get_task(task)
    pretrained = run_dir / "results" / "pretrain" / setting
    if not (pretrained / "model.safetensors").exists():
        raise FileNotFoundError(f"{pretrained}/model.safetensors is missing; is {run_dir} a finished run?")
    hparams = dict(cfg["finetune"][task])
    hparams.update(epochs=1, max_examples=(steps + 2) * int(hparams["batch_size"]))
    rois = ([str(run_dir / "results" / "rois" / task_def.roi_dataset / "train.parquet")]
            if task_def.roi_dataset else [])
    timeline = StepTimeline()
    batches_next = finetune_module.EpochBatches.__next__

    def timed_next(self):
        timeline.new_step()
        return batches_next(self)

    finetune_module.EpochBatches.__next__ = timed_next
    cwd = Path.cwd()
    try:
        os.chdir(run_dir)  # the config's source paths are relative to the run directory
        with timeline.installed(), tempfile.TemporaryDirectory() as out:
            finetune_module.finetune(
                task, pretrained, out, setting=setting, schedule="full", schedule_factor=1.0, hparams=hparams,
                tune_frcnn=bool(cfg["finetune"]["tune_frcnn"]), model_cfg=dict(cfg["model"]),
                sentence_readout=str(cfg["finetune"]["sentence_readout"]),
                sources=dict(cfg["sources"][task_def.dataset]), rois_paths=rois, seed=int(cfg["seed"]),
                device=str(cfg["device"]))
    finally:
        os.chdir(cwd)
        finetune_module.EpochBatches.__next__ = batches_next
    return timeline.summary()


def parts_table(parts: dict[str, float]) -> str:
    total = sum(parts.values())
    lines = ["| part | ms per step | share |", "|---|---|---|"]
    lines += [f"| {part} | {1000 * parts[part]:.1f} | {100 * parts[part] / total:.0f}% |" for part in PARTS]
    lines.append(f"| **step** | {1000 * total:.1f} | 100% |")
    return "\n".join(lines)


def main() -> None:
    args = parse_args()
    cfg = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    for path in args.configfile:
        cfg = merge(cfg, yaml.safe_load(path.read_text()))
    run_dir = args.run_dir.resolve()
    times = rule_times(run_dir)
    lines = [f"Run directory `{args.run_dir}`, measured {time.strftime('%Y-%m-%d')}. Jobs per rule (from "
             "`benchmarks/rules/`; job seconds are wall seconds of each job, so two jobs at once count twice):",
             "", rule_table(times, run_wall_seconds(run_dir))]
    if not args.rules_only:
        setup_compute(args.threads)
        pre, n_pre = time_pretraining(run_dir, cfg, args.setting, args.steps)
        fine, n_fine = time_finetuning(run_dir, cfg, args.setting, args.finetune_task, args.steps)
        lines += [
            "", f"Per step part ({platform.processor() or platform.machine()}, {os.cpu_count()} cores visible, "
            f"{args.threads} torch thread(s), device {cfg['device']}; mean of {n_pre} / {n_fine} steps after a "
            "warm-up step, the real loops timed by hooks: see benchmarks/default_run.py for what each part holds).",
            "", f"Pre-training, setting {args.setting}:", "", parts_table(pre),
            "", f"Fine-tuning {args.finetune_task} from setting {args.setting}:", "", parts_table(fine)]
    lines += ["", "```bash", f"uv run python benchmarks/default_run.py RUN_DIR --steps {args.steps} --setting "
              f"{args.setting} --finetune-task {args.finetune_task} --threads {args.threads}"
              + "".join(f" --configfile {path}" for path in args.configfile)
              + (" --rules-only" if args.rules_only else "") + (" --write-docs" if args.write_docs else ""),
              "```"]
    report = "\n".join(lines)
    print(report)
    if args.write_docs:
        replace_section(SECTION, report)


if __name__ == "__main__":
    main()
