"""Fine-tuning: one training loop for VCR (Q->A, QA->R), VQA and RefCOCO+.

The loop (`finetune`) loads the pre-trained model (vlbert_core.models.registry), adds the task head, trains for
`epochs x schedule_factor` passes over the training split with the configured optimiser
(AdamW, or SGD with momentum), linear warm-up then linear decay (AdamW) or step decay (SGD),
gradient clipping, and writes into the fine-tune directory:
- `model.safetensors`: the pre-trained model's weights under `encoder.` and the head(s) under `head.` /
  `roi_classifier.`;
- `config.json`: {"encoder": its model_type and config, "task": task meta (answer vocabulary for VQA, object
  names for VCR, text/box limits, schedule and step counts)};
- `metrics.jsonl`: one row per step (loss, lr, task statistics);
- `tensorboard/`: the same rows as TensorBoard scalars, written as training goes (tensorboard_log.py).
While it trains, a checkpoint (weights, optimiser, scheduler, data position, RNG states, the rows so
far) is written to `checkpoint.pt` every `checkpoint_every` steps; a job killed mid-training finds it
and resumes, ending with the weights of an uninterrupted run. It is deleted once the outputs are written.
`load_finetuned(dir)` rebuilds the model for evaluation.
"""

from __future__ import annotations

import json
import math
import os
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any, Mapping

import torch
from torch import nn

from vlbert_core.images import DEFAULT_MAX_PIXELS
from vlbert_core.models.common.bert_init import load_tokenizer
from vlbert_core.models.common.config import ModelSettings, visual_pixel_format
from vlbert_core.models.common.output import EncoderOutput
from vlbert_core.models.common.pretrained import CONFIG_FILE, MODEL_FILE, load_state_exactly
from vlbert_core.models.registry import build_model, from_pretrained, split_model_type
from vlbert_core.optim import (OptimizerSettings, build_optimizer, build_scheduler, warmup_linear_decay,
                               warmup_step_decay)
from vlbert_core.resume import remove_resume_checkpoints, run_fingerprint
from vlbert_core.training import CHECKPOINT_FILE, TrainingRun
from vlbert_core.utils import atomic_path, get_logger, load_safetensors, save_safetensors, seed_everything

from . import modeling  # noqa: F401  (the tasks' samples and heads: see tasks.base.model_side)
from .base import Task
from .registry import get_task
from .samples import ImageLoader, Tokens
from .settings import FinetuneSettings

log = get_logger(__name__)

METRICS_FILE = "metrics.jsonl"
CHECKPOINT_FORMAT = 2  # 2: the pre-trained model under `encoder.` (was `vlbert.`)
# A fine-tuned model directory written before model families: its config.json holds the VL-BERT config under
# this key and its weights are prefixed with it.
LEGACY_ENCODER_KEY = "vlbert"
def resolve_hparams(task: str, hparams: Mapping[str, Any]) -> dict:
    """Task `task`'s section with the defaults filled in (FinetuneSettings.hparams), checked."""
    return FinetuneSettings.for_task(task, hparams).hparams


# ---- the model: a pre-trained encoder + task head --------------------------------------------------

FEATURE_CACHE_MB = 1024  # bound of the frozen RoI-feature cache (LRU), per process
# Images per pass of the frozen visual network. Its stage 5 runs on every RoI at 14 x 14: at the paper's 100 RoIs
# an image's maps take ~160 MB per fp32 tensor, so config/paper_base.yaml's VQA step of 256 images in one pass
# ran an 80 GB H100 out of memory (benchmarks/gpu.py); 16 at a time peak near 10 GB and still fill the GPU.
FROZEN_FEATURE_IMAGES_PER_PASS = 16


def forward_shared_images(encoder, batch, group: int) -> EncoderOutput:
    """The encoder's forward where each run of `group` consecutive rows shares one image and its boxes.

    The visual network runs once per image and its RoI features are repeated for the rows of
    the group (the four VCR candidates), instead of running the CNN four times.
    """
    return encoder.encode(batch, rows_per_image=group)


class FrozenRoIFeatureCache:
    """RoI features of a frozen visual network, computed once per (image, boxes) and reused.

    With `tune_frcnn` off the visual network has no trainable parameter, no dropout and frozen
    BatchNorm, and fine-tuning masks no RoI, so its output for an image and its boxes never
    changes: several questions on one image, the four VCR candidates and later epochs all reuse
    it. Each image runs at its own size (`batch.image_size`), up to `images_per_pass` images of
    equal size batched together, so a cached feature does not depend on which batch computed it.
    LRU-bounded by FEATURE_CACHE_MB.
    """

    def __init__(self, visual_network: nn.Module, appearance_dim: int,
                 max_mb: float = FEATURE_CACHE_MB, images_per_pass: int = FROZEN_FEATURE_IMAGES_PER_PASS):
        if images_per_pass < 1:
            raise ValueError(f"images_per_pass must be at least 1, got {images_per_pass}")
        self.visual_network = visual_network
        self.appearance_dim = int(appearance_dim)
        self.images_per_pass = int(images_per_pass)
        self.max_bytes = int(max_mb * 2**20)
        self.bytes = 0
        self.entries: OrderedDict[tuple, torch.Tensor] = OrderedDict()
        self.hits = self.misses = 0

    @torch.no_grad()
    def features(self, batch, image_keys: list[str]) -> torch.Tensor:
        """[B, R, appearance_dim] for the batch rows (zeros on padded boxes)."""
        if len(image_keys) != batch.batch_size:
            raise ValueError(f"{len(image_keys)} image keys for a batch of {batch.batch_size}")
        num_valid = batch.box_valid.sum(dim=1).tolist()
        keys = [(k, batch.boxes[i, : num_valid[i]].cpu().numpy().tobytes(),
                 b"" if batch.instance_masks is None else batch.instance_masks[i, : num_valid[i]].cpu().numpy().tobytes())
                for i, k in enumerate(image_keys)]
        values: dict[tuple, torch.Tensor] = {}
        missing: dict[tuple, int] = {}
        for row, key in enumerate(keys):
            if key in values or key in missing:
                continue
            if key in self.entries:
                self.entries.move_to_end(key)
                values[key] = self.entries[key]
            else:
                missing[key] = row
        self.hits += len(keys) - len(missing)
        self.misses += len(missing)
        by_size: dict[tuple[int, int], list[int]] = {}
        for row in missing.values():
            w, h = (int(v) for v in batch.image_size[row].tolist())
            by_size.setdefault((h, w), []).append(row)
        passes = [(h, w, rows[i: i + self.images_per_pass]) for (h, w), rows in by_size.items()
                  for i in range(0, len(rows), self.images_per_pass)]
        for h, w, rows in passes:
            index = torch.tensor(rows, device=batch.boxes.device)
            feats = self.visual_network(batch.images[index, :, :h, :w], batch.boxes[index], batch.box_valid[index],
                                        None, None if batch.instance_masks is None else batch.instance_masks[index])
            for j, row in enumerate(rows):
                values[keys[row]] = feats[j, : num_valid[row]].clone()
                self._store(keys[row], values[keys[row]])
        out = batch.boxes.new_zeros(batch.batch_size, batch.boxes.shape[1], self.appearance_dim)
        for row, key in enumerate(keys):
            out[row, : num_valid[row]] = values[key]
        return out

    def _store(self, key: tuple, value: torch.Tensor) -> None:
        size = value.numel() * value.element_size()
        if size > self.max_bytes:
            return
        self.entries[key] = value
        self.bytes += size
        while self.bytes > self.max_bytes:
            _, old = self.entries.popitem(last=False)
            self.bytes -= old.numel() * old.element_size()


class FinetuneModel(nn.Module):
    """A pre-trained model (`encoder`, of a registered family: vlbert_core.models.registry) with the head(s) of one
    task; `loss` for training, `scores` for prediction."""

    def __init__(self, task: str, encoder: nn.Module, meta: Mapping[str, Any]):
        super().__init__()
        self.task: Task = get_task(task)
        self.meta = dict(meta)
        self.encoder = encoder
        cfg = encoder.config
        # plain attribute, not a submodule: the cache holds no parameters of its own
        self.feature_cache = (None if cfg.tune_frcnn
                              else FrozenRoIFeatureCache(encoder.visual_network, cfg.appearance_dim))
        task_heads = self.task.build_heads(encoder.head_spec(), meta)
        self.head, self.roi_classifier = task_heads.head, task_heads.roi_classifier

    def encode(self, batch, extras: Mapping[str, Any] | None = None) -> EncoderOutput:
        """The encoder's outputs; the frozen visual network's features come from the cache."""
        if self.feature_cache is not None and extras is not None and "image_keys" in extras:
            features = self.feature_cache.features(batch, extras["image_keys"])
            return self.encoder.encode(batch, roi_features=features)
        return forward_shared_images(self.encoder, batch, self.task.rows_per_image)

    def scores(self, batch, extras: Mapping[str, Any] | None = None) -> dict[str, torch.Tensor]:
        return self.task.scores(self, self.encode(batch, extras), batch)

    def loss(self, batch, extras: Mapping[str, Any]) -> tuple[torch.Tensor, dict[str, float]]:
        """(loss, statistics) of one training batch."""
        result = self.task.loss(self, self.scores(batch, extras), extras, self.meta)
        return result.loss, result.stats


# ---- data ----------------------------------------------------------------------------------------

def read_task_rois(paths: list[str | os.PathLike]) -> tuple[dict, str]:
    """All records of the given task RoI parquets, merged by image key."""
    if not paths:
        return {}, ""
    from vlbert_core.rois import read_rois

    merged: dict = {}
    for path in paths:
        merged.update(read_rois(path))
    return merged, ", ".join(str(p) for p in paths)


# ---- optimisation --------------------------------------------------------------------------------

def optimizer_settings(hp: FinetuneSettings | Mapping[str, Any]) -> OptimizerSettings:
    """The optimiser of a task's settings (or of its resolved section: resolve_hparams)."""
    return (hp if isinstance(hp, FinetuneSettings) else FinetuneSettings.from_config(hp, "finetune")).optimizer_settings()


def lr_schedule(hp: FinetuneSettings, plan: Mapping[str, Any]) -> Callable[[int], float]:
    """The lr multiplier of each step: linear warm-up, then linear decay to 0 (adamw) or x0.1 at each
    of the plan's decay steps (sgd)."""
    if hp.optimizer == "sgd":
        return lambda s: warmup_step_decay(s, plan["warmup_steps"], plan["decay_steps"])
    return lambda s: warmup_linear_decay(s, plan["total_steps"], plan["warmup_steps"])


def schedule_steps(num_examples: int, hp: FinetuneSettings, schedule_factor: float) -> dict:
    """Total steps, warm-up steps and SGD decay steps for epochs x schedule_factor passes."""
    if num_examples < 1:
        raise ValueError("no training examples")
    steps_per_epoch = math.ceil(num_examples / hp.batch_size)
    epochs = hp.epochs * float(schedule_factor)
    total = max(1, math.ceil(epochs * steps_per_epoch))
    return {"epochs": epochs, "steps_per_epoch": steps_per_epoch, "total_steps": total,
            "warmup_steps": min(hp.warmup_steps, total),
            "decay_steps": [round(e * schedule_factor * steps_per_epoch) for e in hp.lr_steps]}


class EpochBatches:
    """Shuffled training batches, epoch after epoch: each epoch a new permutation from one seeded
    generator. Its state (epoch, batches taken from it, the generator's state when it began) lets a
    resumed run continue at the next batch without loading the ones before."""

    def __init__(self, data, batch_size: int, seed: int):
        self.data, self.batch_size = data, int(batch_size)
        self.generator = torch.Generator().manual_seed(int(seed))
        self.epoch = 0
        self._begin_epoch()

    def _begin_epoch(self) -> None:
        self.epoch_generator_state = self.generator.get_state()
        self.order = torch.randperm(len(self.data), generator=self.generator).tolist()
        self.position = 0  # batches taken from this epoch

    def __next__(self) -> tuple[int, Any, dict]:
        """(epoch, batch, extras) of the next batch."""
        if self.position * self.batch_size >= len(self.order):
            self.epoch += 1
            self._begin_epoch()
        start = self.position * self.batch_size
        self.position += 1
        batch, extras = self.data.collate([self.data.sample(i) for i in self.order[start:start + self.batch_size]])
        return self.epoch, batch, extras

    def state(self) -> dict:
        return {"epoch": self.epoch, "position": self.position, "generator": self.epoch_generator_state}

    def load_state(self, state: Mapping[str, Any]) -> None:
        self.generator.set_state(state["generator"])
        self.epoch = int(state["epoch"])
        self._begin_epoch()
        self.position = int(state["position"])


def _fingerprint(task: str, pretrained_dir: Path, rois_paths: list, **settings: Any) -> str:
    """What a fine-tuning checkpoint must agree on to be resumed: the job's settings and its input files."""
    def files_in(value: Any) -> list[str]:
        if isinstance(value, Mapping):
            return [f for v in value.values() for f in files_in(v)]
        if isinstance(value, (list, tuple)):
            return [f for v in value for f in files_in(v)]
        return [value] if isinstance(value, str) and os.path.isfile(value) else []

    inputs = [str(pretrained_dir / MODEL_FILE), str(pretrained_dir / CONFIG_FILE), *map(str, rois_paths),
              *files_in(settings.get("sources", {}))]
    return run_fingerprint(task=task, **settings, files=inputs)


# ---- the loop ------------------------------------------------------------------------------------

def finetune(task: str, pretrained_dir: str | os.PathLike, out_dir: str | os.PathLike, *,
             setting: str, schedule: str, schedule_factor: float, hparams: FinetuneSettings | Mapping[str, Any],
             tune_frcnn: bool, model_cfg: ModelSettings | Mapping[str, Any], sources: Mapping[str, str],
             rois_paths: list[str] | tuple = (), seed: int = 0, device: str = "cpu",
             sentence_readout: str = "cls", stop_after_step: int | None = None,
             max_image_pixels: int = DEFAULT_MAX_PIXELS) -> dict:
    """Fine-tune the pre-trained model in `pretrained_dir` on `task`; returns the task meta. `hparams` /
    `model_cfg`: the config's `finetune.<task>:` and `model:` sections, typed (FinetuneSettings, ModelSettings; a
    mapping is read into them).

    `max_image_pixels` (the config's top-level key) caps the task images: a larger one fails the job with
    `vlbert_core.images.ImageTooLarge` naming it, read from its header before it is decoded.

    `stop_after_step` ends the run right after that step's checkpoint without writing the outputs, as an
    interruption would (used to test resuming)."""
    task_def = get_task(task)
    hp, model_settings = FinetuneSettings.for_task(task, hparams), ModelSettings.of(model_cfg)
    out_dir = Path(out_dir)
    seed_everything(seed)
    encoder = load_encoder(pretrained_dir, tune_frcnn, model_settings.task_heads, sentence_readout, task)
    config = encoder.config
    readout = getattr(config, "sentence_readout", "pooled")

    tokens = Tokens(load_tokenizer(config.bert_path))
    images = ImageLoader(model_settings.image_max_side, pixel_format=visual_pixel_format(config),
                         min_side=model_settings.image_min_side, max_pixels=max_image_pixels)
    rois, rois_source = read_task_rois(list(rois_paths))
    max_rois, max_text_len = model_settings.max_rois, hp.max_text_len
    meta: dict[str, Any] = {"name": task, "setting": setting, "schedule": schedule,
                            "schedule_factor": float(schedule_factor), "seed": int(seed),
                            "pretrained": str(pretrained_dir), "tune_frcnn": bool(tune_frcnn),
                            "sentence_readout": readout,
                            "max_rois": max_rois, "image_max_side": model_settings.image_max_side,
                            "image_min_side": images.min_side,
                            "instance_mask_size": encoder.visual_network.stage5_size(),
                            "max_text_len": max_text_len, "batch_size": hp.batch_size,
                            "mask_id": tokens.mask_id}
    common = dict(sources=sources, tokens=tokens, images=images, max_rois=max_rois,
                  max_text_len=max_text_len, rois=rois, rois_source=rois_source,
                  max_examples=hp.max_examples)
    task_def.prepare(meta, hp.hparams, sources)
    data = task_def.build_data(task_def.train_split, meta, **common)

    model = FinetuneModel(task, encoder, meta)
    start_from_released_head(model, pretrained_dir)
    model = model.to(device)
    model.train()
    optimizer = build_optimizer(model, hp.optimizer_settings())
    plan = schedule_steps(len(data), hp, schedule_factor)
    scheduler = build_scheduler(optimizer, lr_schedule(hp, plan))
    meta.update(num_train_examples=len(data), **plan)
    n_trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    log.info("fine-tuning %s (setting %s, schedule %s x%.2f): %d examples, %d steps of %d, "
             "%.2f epochs, %s, tune_frcnn=%s, sentence readout %s, %.1fM trainable parameters", task, setting,
             schedule, schedule_factor, len(data), plan["total_steps"], hp.batch_size, plan["epochs"],
             hp.optimizer, tune_frcnn, readout, n_trainable / 1e6)

    fingerprint = _fingerprint(task, Path(pretrained_dir), list(rois_paths), setting=setting, schedule=schedule,
                               schedule_factor=float(schedule_factor), tune_frcnn=bool(tune_frcnn), seed=int(seed),
                               sentence_readout=readout, hparams=hp.to_fingerprint(),
                               model=model_settings.to_fingerprint(), sources=dict(sources))
    batches = EpochBatches(data, hp.batch_size, seed)
    dev = torch.device(device)
    run = TrainingRun(out_dir, f"finetune {task}/{setting}/{schedule}", fingerprint=fingerprint,
                      checkpoint_format=CHECKPOINT_FORMAT, total_steps=plan["total_steps"],
                      checkpoint_every=hp.checkpoint_every, kind="a fine-tuning checkpoint",
                      parts={"model": model, "optimizer": optimizer, "scheduler": scheduler}, data=batches,
                      device=dev, timed=True)
    run.resume()
    if run.train(finetuning_step(model, batches, optimizer, scheduler, hp.clip_grad, run, dev, task), stop_after_step):
        return {**meta, "stopped": True, "resumed_from": run.resumed_from}
    run.close()
    meta["train_seconds"] = round(run.elapsed(), 2)
    if model.feature_cache is not None:
        log.info("frozen RoI features: computed for %d images, reused for %d rows",
                 model.feature_cache.misses, model.feature_cache.hits)
    task_def.log_training_data(data, meta)
    save_finetuned(model, meta, out_dir)
    with atomic_path(out_dir / METRICS_FILE) as tmp:
        tmp.write_text("".join(json.dumps(r) + "\n" for r in run.metrics))
    remove_resume_checkpoints(run.checkpoint_path)  # the job's outputs are complete: a rerun starts afresh
    log.info("fine-tuned %s in %.1f s -> %s", task, meta["train_seconds"], out_dir)
    return meta


def start_from_released_head(model: FinetuneModel, pretrained_dir: str | os.PathLike) -> bool:
    """Start the task head from the released head of the task when the pre-trained directory holds one (a
    converted fine-tuned ViLBERT's task_heads.safetensors, tasks/modeling/vilbert_released.py); returns whether
    it did."""
    from .modeling.vilbert_released import released_task_head

    released = released_task_head(model.task.name, pretrained_dir, model.encoder.head_spec())
    if released is None:
        return False
    model.head.load_state_dict(released.state_dict(), strict=True)
    log.info("task head %s: from the released head in %s", model.task.name, pretrained_dir)
    return True


def load_encoder(pretrained_dir: str | os.PathLike, tune_frcnn: bool, task_heads: str | None,
                 sentence_readout: str, task: str | None = None) -> nn.Module:
    """The pre-trained model of `pretrained_dir`, rebuilt with the fine-tuning choices: tune_frcnn (so the visual
    network (un)freezes itself), the task heads' layout (model.task_heads) when the config names one, what the
    task's sentence-level head reads (finetune.sentence_readout), and what the model takes of the task
    (`task_config`: a converted multi-task ViLBERT's task token)."""
    pretrained = from_pretrained(pretrained_dir)
    fields = pretrained.config.to_dict()
    overrides: dict[str, Any] = {"tune_frcnn": bool(tune_frcnn)}
    if task is not None:
        overrides.update(pretrained.task_config(task))
    if task_heads is not None:
        overrides["task_heads"] = task_heads
    if "sentence_readout" in fields:
        overrides["sentence_readout"] = str(sentence_readout)
    elif sentence_readout != "cls":
        # one config serves both families (the model comparison): the choice is VL-BERT's, and the job's meta
        # records what this model reads ("pooled")
        log.info("finetune.sentence_readout %r does not apply to the %s model in %s: it reads its own pooled "
                 "output", sentence_readout, pretrained.model_type, pretrained_dir)
    config = pretrained.config_class.from_dict({**fields, **overrides})
    encoder = type(pretrained)(config)
    encoder.load_state_dict(pretrained.state_dict())
    return encoder


def finetuning_step(model: FinetuneModel, batches: EpochBatches, optimizer, scheduler, clip_grad: float,
                    run: TrainingRun, device: torch.device, task: str) -> Callable[[int], dict]:
    """The step function of the run (training.TrainingRun.train): one optimiser step on the next batch, its row."""
    trainable = [p for p in model.parameters() if p.requires_grad]

    def train_step(step: int) -> dict:
        epoch, batch, extras = next(batches)
        batch = batch.to(device)
        extras = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in extras.items()}
        lr = scheduler.get_last_lr()[0]
        loss, stats = model.loss(batch, extras)
        if not torch.isfinite(loss):
            raise FloatingPointError(f"fine-tuning {task}: loss is {float(loss)} at step {step}")
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = nn.utils.clip_grad_norm_(trainable, clip_grad)
        optimizer.step()
        scheduler.step()
        return {"step": step, "epoch": epoch, "loss": loss.item(), "lr": lr, "grad_norm": float(grad_norm), **stats,
                "elapsed_s": round(run.elapsed(), 3)}

    return train_step


def save_finetuned(model: FinetuneModel, meta: Mapping[str, Any], out_dir: str | os.PathLike) -> None:
    """model.safetensors (the encoder under `encoder.`, the task heads) and config.json ({"encoder": its
    model_type and config, "task": the task meta})."""
    out_dir = Path(out_dir)
    save_safetensors(model.state_dict(), out_dir / MODEL_FILE, metadata={"task": model.task.name})
    payload = {"encoder": {"model_type": model.encoder.model_type, **model.encoder.config.to_dict()},
               "task": dict(meta)}
    with atomic_path(out_dir / CONFIG_FILE) as tmp:
        tmp.write_text(json.dumps(payload, indent=2, sort_keys=True) + "\n")


def load_finetuned(directory: str | os.PathLike) -> tuple[FinetuneModel, dict]:
    """(model in eval mode, task meta) of a fine-tune directory."""
    directory = Path(directory)
    config_path, weights_path = directory / CONFIG_FILE, directory / MODEL_FILE
    for path in (config_path, weights_path):
        if not path.is_file():
            raise FileNotFoundError(f"fine-tuned model: {path} does not exist")
    payload = json.loads(config_path.read_text())
    encoder_key = "encoder" if "encoder" in payload else LEGACY_ENCODER_KEY
    if encoder_key not in payload or "task" not in payload:
        raise ValueError(f"{config_path} is not a fine-tuned model config (needs 'encoder' and 'task')")
    model_type, fields = split_model_type(payload[encoder_key], str(config_path))
    meta = payload["task"]
    state = load_safetensors(weights_path)
    if encoder_key == LEGACY_ENCODER_KEY:
        state = {("encoder." + k[len("vlbert."):] if k.startswith("vlbert.") else k): v for k, v in state.items()}
    with torch.device("meta"):  # every tensor comes from the file: no random init to throw away
        model = FinetuneModel(meta["name"], build_model(model_type, fields), meta)
    load_state_exactly(model, state, weights_path, config_path)
    model.eval()
    return model, meta
