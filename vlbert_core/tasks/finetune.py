"""Fine-tuning: one training loop for VCR (Q->A, QA->R), VQA and RefCOCO+.

The loop (`finetune`) loads the pre-trained VL-BERT, adds the task head, trains for
`epochs x schedule_factor` passes over the training split with the configured optimiser
(AdamW, or SGD with momentum), linear warm-up then linear decay (AdamW) or step decay (SGD),
gradient clipping, and writes into the fine-tune directory:
- `model.safetensors`: the VL-BERT weights under `vlbert.` and the head(s) under `head.` /
  `roi_classifier.`;
- `config.json`: {"vlbert": VLBertConfig, "task": task meta (answer vocabulary for VQA, object
  names for VCR, text/box limits, schedule and step counts)};
- `metrics.jsonl`: one row per step (loss, lr, task statistics).
`load_finetuned(dir)` rebuilds the model for evaluation.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any, Mapping

import torch
from torch import nn
from tqdm import tqdm

from vlbert_core.model import VLBertConfig, VLBertModel, VLBertOutput, load_tokenizer
from vlbert_core.model.config import visual_pixel_format
from vlbert_core.optim import (OptimizerSettings, build_optimizer, build_scheduler, warmup_linear_decay,
                               warmup_step_decay)
from vlbert_core.utils import atomic_path, get_logger, load_safetensors, save_safetensors, seed_everything

from . import modeling  # noqa: F401  (the tasks' samples and heads: see tasks.base.model_side)
from .base import Task
from .registry import get_task
from .samples import ImageLoader, Tokens, iterate_batches

log = get_logger(__name__)

MODEL_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
# Defaults of the optional hyper-parameters; config/schema.yaml fills the same values.
HPARAM_DEFAULTS = {"momentum": 0.9, "lr_steps": [], "warmup_steps": 0, "clip_grad": 1.0,
                   "weight_decay": 0.0001, "aux_roi_loss_weight": 0.5, "max_text_len": 64,
                   "max_examples": None}
REQUIRED_HPARAMS = ("epochs", "batch_size", "lr", "optimizer")


def resolve_hparams(task: str, hparams: Mapping[str, Any]) -> dict:
    required = (*REQUIRED_HPARAMS, *get_task(task).required_hparams)
    missing = [k for k in required if k not in hparams]
    if missing:
        raise KeyError(f"finetune.{task} lacks keys {missing}")
    resolved = {**HPARAM_DEFAULTS, **dict(hparams)}
    if resolved["optimizer"] not in ("adamw", "sgd"):
        raise ValueError(f"finetune.{task}.optimizer must be 'adamw' or 'sgd', got "
                         f"{resolved['optimizer']!r}")
    return resolved


# ---- the model: VL-BERT + task head --------------------------------------------------------------

FEATURE_CACHE_MB = 1024  # bound of the frozen RoI-feature cache (LRU), per process


def forward_shared_images(vlbert: VLBertModel, batch, group: int) -> VLBertOutput:
    """VL-BERT forward where each run of `group` consecutive rows shares one image and its boxes.

    The visual network runs once per image and its RoI features are repeated for the rows of
    the group (the four VCR candidates), instead of running the CNN four times.
    """
    return vlbert.encode(batch, rows_per_image=group)


class FrozenRoIFeatureCache:
    """RoI features of a frozen visual network, computed once per (image, boxes) and reused.

    With `tune_frcnn` off the visual network has no trainable parameter, no dropout and frozen
    BatchNorm, and fine-tuning masks no RoI, so its output for an image and its boxes never
    changes: several questions on one image, the four VCR candidates and later epochs all reuse
    it. Each image runs at its own size (box 0 = [0, 0, W, H]), images of equal size batched
    together, so a cached feature does not depend on which batch computed it. LRU-bounded by
    FEATURE_CACHE_MB.
    """

    def __init__(self, visual_network: nn.Module, appearance_dim: int,
                 max_mb: float = FEATURE_CACHE_MB):
        self.visual_network = visual_network
        self.appearance_dim = int(appearance_dim)
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
        keys = [(k, batch.boxes[i, : num_valid[i]].cpu().numpy().tobytes())
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
            w, h = (int(round(float(v))) for v in batch.boxes[row, 0, 2:4])
            by_size.setdefault((h, w), []).append(row)
        for (h, w), rows in by_size.items():
            index = torch.tensor(rows, device=batch.boxes.device)
            feats = self.visual_network(batch.images[index, :, :h, :w], batch.boxes[index],
                                        batch.box_valid[index], None)
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
    """VL-BERT with the head(s) of one task; `loss` for training, `scores` for prediction."""

    def __init__(self, task: str, vlbert: VLBertModel, meta: Mapping[str, Any]):
        super().__init__()
        self.task: Task = get_task(task)
        self.meta = dict(meta)
        self.vlbert = vlbert
        cfg = vlbert.config
        # plain attribute, not a submodule: the cache holds no parameters of its own
        self.feature_cache = (None if cfg.tune_frcnn
                              else FrozenRoIFeatureCache(vlbert.visual_network, cfg.appearance_dim))
        task_heads = self.task.build_heads(cfg, meta)
        self.head, self.roi_classifier = task_heads.head, task_heads.roi_classifier

    def encode(self, batch, extras: Mapping[str, Any] | None = None) -> VLBertOutput:
        """VL-BERT outputs; the frozen visual network's features come from the cache."""
        if self.feature_cache is not None and extras is not None and "image_keys" in extras:
            features = self.feature_cache.features(batch, extras["image_keys"])
            return self.vlbert.encode(batch, roi_features=features)
        return forward_shared_images(self.vlbert, batch, self.task.rows_per_image)

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

def optimizer_settings(hp: Mapping[str, Any]) -> OptimizerSettings:
    """Weight decay on weight matrices only; the fused kernels update the 30k x hidden word embeddings
    ~10x faster on CPU."""
    return OptimizerSettings(hp["optimizer"], lr=float(hp["lr"]), weight_decay=float(hp["weight_decay"]),
                             momentum=float(hp["momentum"]), fused=True)


def lr_schedule(hp: Mapping[str, Any], plan: Mapping[str, Any]) -> Callable[[int], float]:
    """The lr multiplier of each step: linear warm-up, then linear decay to 0 (adamw) or x0.1 at each
    of the plan's decay steps (sgd)."""
    if hp["optimizer"] == "sgd":
        return lambda s: warmup_step_decay(s, plan["warmup_steps"], plan["decay_steps"])
    return lambda s: warmup_linear_decay(s, plan["total_steps"], plan["warmup_steps"])


def schedule_steps(num_examples: int, hp: Mapping[str, Any], schedule_factor: float) -> dict:
    """Total steps, warm-up steps and SGD decay steps for epochs x schedule_factor passes."""
    if num_examples < 1:
        raise ValueError("no training examples")
    steps_per_epoch = math.ceil(num_examples / int(hp["batch_size"]))
    epochs = float(hp["epochs"]) * float(schedule_factor)
    total = max(1, math.ceil(epochs * steps_per_epoch))
    return {"epochs": epochs, "steps_per_epoch": steps_per_epoch, "total_steps": total,
            "warmup_steps": min(int(hp["warmup_steps"]), total),
            "decay_steps": [round(float(e) * schedule_factor * steps_per_epoch) for e in hp["lr_steps"]]}


def _batches_forever(data, batch_size: int, generator: torch.Generator):
    epoch = 0
    while True:
        for item in iterate_batches(data, batch_size, shuffle=True, generator=generator):
            yield epoch, item
        epoch += 1


# ---- the loop ------------------------------------------------------------------------------------

def finetune(task: str, pretrained_dir: str | os.PathLike, out_dir: str | os.PathLike, *,
             setting: str, schedule: str, schedule_factor: float, hparams: Mapping[str, Any],
             tune_frcnn: bool, model_cfg: Mapping[str, Any], sources: Mapping[str, str],
             rois_paths: list[str] | tuple = (), seed: int = 0, device: str = "cpu") -> dict:
    """Fine-tune the pre-trained model in `pretrained_dir` on `task`; returns the task meta."""
    task_def = get_task(task)
    hp = resolve_hparams(task, hparams)
    out_dir = Path(out_dir)
    seed_everything(seed)
    pretrained = VLBertModel.load(pretrained_dir)
    # tune_frcnn is a fine-tuning choice: rebuild with it so the visual network (un)freezes itself
    # so are the task heads' layout (model.task_heads) when the config names one
    overrides = {"tune_frcnn": bool(tune_frcnn)}
    if model_cfg.get("task_heads") is not None:
        overrides["task_heads"] = str(model_cfg["task_heads"])
    config = VLBertConfig.from_dict({**pretrained.config.to_dict(), **overrides})
    vlbert = VLBertModel(config)
    vlbert.load_state_dict(pretrained.state_dict())
    del pretrained

    tokens = Tokens(load_tokenizer(config.bert_path))
    images = ImageLoader(int(model_cfg["image_max_side"]), pixel_format=visual_pixel_format(config))
    rois, rois_source = read_task_rois(list(rois_paths))
    max_rois, max_text_len = int(model_cfg["max_rois"]), int(hp["max_text_len"])
    meta: dict[str, Any] = {"name": task, "setting": setting, "schedule": schedule,
                            "schedule_factor": float(schedule_factor), "seed": int(seed),
                            "pretrained": str(pretrained_dir), "tune_frcnn": bool(tune_frcnn),
                            "max_rois": max_rois, "image_max_side": int(model_cfg["image_max_side"]),
                            "max_text_len": max_text_len, "batch_size": int(hp["batch_size"]),
                            "mask_id": tokens.mask_id}
    common = dict(sources=sources, tokens=tokens, images=images, max_rois=max_rois,
                  max_text_len=max_text_len, rois=rois, rois_source=rois_source,
                  max_examples=hp["max_examples"])
    task_def.prepare(meta, hp, sources)
    data = task_def.build_data(task_def.train_split, meta, **common)

    model = FinetuneModel(task, vlbert, meta).to(device)
    model.train()
    optimizer = build_optimizer(model, optimizer_settings(hp))
    plan = schedule_steps(len(data), hp, schedule_factor)
    scheduler = build_scheduler(optimizer, lr_schedule(hp, plan))
    meta.update(num_train_examples=len(data), **plan)
    n_trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    log.info("fine-tuning %s (setting %s, schedule %s x%.2f): %d examples, %d steps of %d, "
             "%.2f epochs, %s, tune_frcnn=%s, %.1fM trainable parameters", task, setting, schedule,
             schedule_factor, len(data), plan["total_steps"], hp["batch_size"], plan["epochs"],
             hp["optimizer"], tune_frcnn, n_trainable / 1e6)

    generator = torch.Generator().manual_seed(int(seed))
    stream = _batches_forever(data, int(hp["batch_size"]), generator)
    start = time.perf_counter()
    metrics_path = out_dir / "metrics.jsonl"
    with atomic_path(metrics_path) as tmp_metrics, tmp_metrics.open("w") as metrics_file:
        progress = tqdm(range(plan["total_steps"]), desc=f"finetune {task}/{setting}/{schedule}",
                        mininterval=5.0)
        for step in progress:
            epoch, (_, batch, extras) = next(stream)
            batch = batch.to(device)
            extras = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in extras.items()}
            lr = scheduler.get_last_lr()[0]
            loss, stats = model.loss(batch, extras)
            if not torch.isfinite(loss):
                raise FloatingPointError(f"fine-tuning {task}: loss is {float(loss)} at step {step}")
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            grad_norm = nn.utils.clip_grad_norm_(
                [p for p in model.parameters() if p.requires_grad], float(hp["clip_grad"]))
            optimizer.step()
            scheduler.step()
            row = {"step": step + 1, "epoch": epoch, "loss": loss.item(), "lr": lr,
                   "grad_norm": float(grad_norm), **stats,
                   "elapsed_s": round(time.perf_counter() - start, 3)}
            metrics_file.write(json.dumps(row) + "\n")
            progress.set_postfix(loss=f"{loss.item():.4f}", lr=f"{lr:.2e}")
            if step == 0 or (step + 1) % max(1, plan["total_steps"] // 10) == 0:
                log.info("step %d/%d loss %.4f lr %.3g %s", step + 1, plan["total_steps"],
                         loss.item(), lr, {k: round(v, 4) for k, v in stats.items()})
        metrics_file.flush()
        meta["train_seconds"] = round(time.perf_counter() - start, 2)
        if model.feature_cache is not None:
            log.info("frozen RoI features: computed for %d images, reused for %d rows",
                     model.feature_cache.misses, model.feature_cache.hits)
        task_def.log_training_data(data, meta)
        save_finetuned(model, meta, out_dir)
    log.info("fine-tuned %s in %.1f s -> %s", task, meta["train_seconds"], out_dir)
    return meta


def save_finetuned(model: FinetuneModel, meta: Mapping[str, Any], out_dir: str | os.PathLike) -> None:
    out_dir = Path(out_dir)
    save_safetensors(model.state_dict(), out_dir / MODEL_FILE, metadata={"task": model.task.name})
    payload = {"vlbert": model.vlbert.config.to_dict(), "task": dict(meta)}
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
    if "vlbert" not in payload or "task" not in payload:
        raise ValueError(f"{config_path} is not a fine-tuned model config (needs 'vlbert' and 'task')")
    meta = payload["task"]
    with torch.device("meta"):  # every tensor comes from the file: no random init to throw away
        model = FinetuneModel(meta["name"], VLBertModel(VLBertConfig.from_dict(payload["vlbert"])), meta)
    missing, unexpected = model.load_state_dict(load_safetensors(weights_path), strict=False, assign=True)
    if missing or unexpected:
        raise ValueError(f"{weights_path} does not match {config_path}: missing {sorted(missing)[:8]}, "
                         f"unexpected {sorted(unexpected)[:8]}")
    model.eval()
    return model, meta
