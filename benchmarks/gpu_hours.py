"""What the paper's runs cost on one kind of GPU, from step times measured on it (issue 57).

The method, given what benchmarks/gpu.py measures on that GPU:

- BASE pre-training: config/paper_base.yaml's `pretrain.steps` (259,245: 10 epochs of Conceptual Captions at
  the released 128 <caption, image> samples a step) at the released global batch, 16 GPUs x (8 + 8) = 256
  samples (PAPER.md; `cc_batch_size` + `text_batch_size` per GPU x RELEASED_GPUS). Each of the 16 GPUs takes
  one released per-GPU batch a step, so a step costs 16 GPU-steps. A GPU-step takes the longer of the measured
  step at the released per-GPU batch and the time the GPU's data-loader workers need for that batch (per-GPU
  samples / (workers x one worker's samples/s)). GPU-hours = steps x GPUs x that time / 3600. Data-parallel
  communication is not counted (one GPU measures none), so this is the cost at perfect scaling.
- A fine-tune: steps = ceil(epochs x training samples / batch), each at the step time measured at the
  fine-tune's batch (config/paper_base.yaml runs its whole batch on one GPU); where only another batch was
  measured, at that batch's samples/s. GPU-hours = steps x step / 3600. Evaluation is not counted.

The authors report BASE pre-training at about 2 days on 16 V100s (PAPER.md): AUTHORS_V100_HOURS.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

RELEASED_GPUS = 16                    # cfgs/pretrain/base_e2e_16x16G_fp16.yaml: 16 GPUs (PAPER.md)
AUTHORS_V100_HOURS = 2 * 24 * 16      # "about 2 days on 16 V100s": 768
# Training-split sizes of the default fine-tunes (the published splits, one sample per question)
TRAIN_SAMPLES = {"vqa": 443_757,      # VQA v2 train2014 questions
                 "vcr_q2a": 212_923}  # VCR train questions


@dataclass(frozen=True)
class PretrainPlan:
    steps: int
    global_batch: int
    per_gpu_batch: int

    @property
    def gpus(self) -> int:
        return self.global_batch // self.per_gpu_batch


@dataclass(frozen=True)
class Estimate:
    gpu_hours: float
    steps: int
    gpu_step_s: float       # what one GPU-step was taken to cost
    bound: str              # "GPU" or "loader": which of the two set gpu_step_s
    gpus: int


def paper_pretrain_plan(cfg: dict, gpus: int = RELEASED_GPUS) -> PretrainPlan:
    pre = cfg["pretrain"]
    per_gpu = int(pre["cc_batch_size"]) + int(pre["text_batch_size"])
    return PretrainPlan(int(pre["steps"]), per_gpu * gpus, per_gpu)


def pretrain_gpu_hours(plan: PretrainPlan, step_s: float, loader_samples_per_s: float,
                       workers_per_gpu: int) -> Estimate:
    """GPU-hours of `plan` from the step time at its per-GPU batch and one loader worker's samples/s."""
    loader_s = plan.per_gpu_batch / (workers_per_gpu * loader_samples_per_s)
    gpu_step_s, bound = (step_s, "GPU") if step_s >= loader_s else (loader_s, "loader")
    return Estimate(plan.steps * plan.gpus * gpu_step_s / 3600, plan.steps, gpu_step_s, bound, plan.gpus)


def finetune_steps(epochs: float, train_samples: int, batch_size: int) -> int:
    return math.ceil(epochs * train_samples / batch_size)


def finetune_gpu_hours(epochs: float, train_samples: int, batch_size: int, measured_step_s: float,
                       measured_batch: int) -> Estimate:
    """GPU-hours of a fine-tune of `batch_size` a step, from a step measured at `measured_batch` (the same
    samples/s when the two differ)."""
    step_s = measured_step_s * batch_size / measured_batch
    steps = finetune_steps(epochs, train_samples, batch_size)
    return Estimate(steps * step_s / 3600, steps, step_s, "GPU", 1)


def default_finetunes(cfg: dict) -> dict[str, tuple[float, int]]:
    """(epochs of the full schedule, batch) of the fine-tunes TRAIN_SAMPLES knows, from the config."""
    factor = float(cfg["finetune"]["schedules"]["full"])
    return {task: (float(cfg["finetune"][task]["epochs"]) * factor, int(cfg["finetune"][task]["batch_size"]))
            for task in TRAIN_SAMPLES}


def estimate_lines(cfg: dict, pretrain_step_s: float, loader_samples_per_s: float, workers_per_gpu: int,
                   finetune_steps_measured: dict[str, tuple[float, int]], gpu: str) -> list[str]:
    """The report's lines: BASE pre-training and each measured fine-tune, in GPU-hours on `gpu`."""
    plan = paper_pretrain_plan(cfg)
    pre = pretrain_gpu_hours(plan, pretrain_step_s, loader_samples_per_s, workers_per_gpu)
    lines = [f"- BASE pre-training, {plan.steps:,} steps at {plan.global_batch} samples ({plan.gpus} x "
             f"{plan.per_gpu_batch}): **{pre.gpu_hours:,.0f} {gpu}-hours** ({pre.bound}-bound: "
             f"{1000 * pre.gpu_step_s:.0f} ms per per-GPU batch, {workers_per_gpu} loader workers per GPU at "
             f"{loader_samples_per_s:.1f} samples/s each); the authors: ~{AUTHORS_V100_HOURS} V100-hours"]
    for task, (epochs, batch) in default_finetunes(cfg).items():
        if task not in finetune_steps_measured:
            continue
        step_s, measured_batch = finetune_steps_measured[task]
        est = finetune_gpu_hours(epochs, TRAIN_SAMPLES[task], batch, step_s, measured_batch)
        lines.append(f"- {task} fine-tune, {epochs:g} epochs of {TRAIN_SAMPLES[task]:,} samples at batch {batch} "
                     f"({est.steps:,} steps of {est.gpu_step_s:.2f} s, from {measured_batch} measured): "
                     f"**{est.gpu_hours:.1f} {gpu}-hours**")
    return lines
