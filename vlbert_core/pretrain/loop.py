"""The pre-training loop: one readable loop for every Table 4 setting (nanoGPT style).

AdamW (no weight decay on biases, LayerNorm and other 1-d parameters), linear warm-up then linear
decay, lr = lr_per_sample x global batch, gradient clipping, bf16 autocast on CUDA only, DDP when
launched by torchrun (WORLD_SIZE > 1). A checkpoint (model, heads, optimiser, scheduler, step,
metrics, RNG states and data positions of every rank) is written to <out_dir>/checkpoint.pt every
`checkpoint_every` steps and at the end, the one before kept as checkpoint.previous.pt; a run finds them there and
resumes from the newest readable one (vlbert_core/training.py, resume.py). Rank 0 also writes each
metrics record as TensorBoard scalars to <out_dir>/tensorboard/ (tensorboard_log.py). At the end, the visual-clue
check (visual_clue.py) measures MLM accuracy on held-out captions with and without the image.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import time
from collections import Counter
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Mapping

import torch
import torch.distributed as dist
from torch import nn

from vlbert_core.detector import load_detector
from vlbert_core.images import DEFAULT_MAX_PIXELS
from vlbert_core.models.common.batch import collate_samples
from vlbert_core.models.common.bert_init import load_tokenizer
from vlbert_core.models.common.config import ModelSettings, visual_pixel_format
from vlbert_core.models.common.heads import save_pretraining_heads
from vlbert_core.models.common.inputs import build_input_sequence
from vlbert_core.models.registry import family, from_pretrained
from vlbert_core.optim import OptimizerSettings, build_optimizer, build_scheduler, warmup_linear_decay
from vlbert_core.resume import previous_checkpoint, run_fingerprint
from vlbert_core.tensorboard_log import TrainingEvents
from vlbert_core.training import CHECKPOINT_FILE, TrainingRun, gather
from vlbert_core.utils import atomic_path, get_logger, seed_everything

from .config import PretrainSettings
from .data import (
    CaptionImageStream, DataStream, PretrainBatches, StreamConfig, TextStream, pair_shards_with_rois, read_cc_samples,
    read_held_out_captions,
)
from .masking import MaskingVocab
from .objectives import pretraining_module, target_counts
from .settings import PretrainSetting, get_setting
from .visual_clue import visual_clue_check

log = get_logger(__name__)

METRICS_FILE = "metrics.jsonl"
VISUAL_CLUE_FILE = "visual_clue.json"
CHECKPOINT_FORMAT = 2  # 2: data state per stream
ADAM_BETAS = (0.9, 0.999)
ADAM_EPS = 1e-6  # as in BERT and the released VL-BERT optimiser
APPEARANCE_STATS_IMAGES = 256  # training images whose RoI features give the appearance statistics


def _init_distributed(device: str, collective_timeout_s: float) -> tuple[int, int, torch.device]:
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size <= 1:
        return 0, 1, torch.device(device)
    use_cuda = device.startswith("cuda")
    if not dist.is_initialized():
        dist.init_process_group("nccl" if use_cuda else "gloo", timeout=timedelta(seconds=collective_timeout_s))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if use_cuda:
        torch.cuda.set_device(local_rank)
        return dist.get_rank(), world_size, torch.device("cuda", local_rank)
    return dist.get_rank(), world_size, torch.device(device)


def _write_metrics(path: Path, records: list[dict]) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in records))


def build_batches(spec: PretrainSetting, cc_shards: list, roi_parquets: list, text_shards: list, tokenizer,
                  num_object_classes: int, stream_cfg: StreamConfig, hp: PretrainSettings, rank: int,
                  world_size: int) -> PretrainBatches:
    """This rank's streams (see data.py): streams rank*k .. rank*k+k-1 of world_size*k, k = streams_per_rank,
    each with cc_batch_size/k CC samples (+ text_batch_size/k text samples) per step."""
    per_rank, cc_batch, text_batch = hp.streams_per_rank, hp.cc_batch_size, hp.text_batch_size
    if per_rank < 1 or cc_batch % per_rank or (spec.text_corpus and text_batch % per_rank):
        raise ValueError(f"pretrain.streams_per_rank={per_rank} must be >= 1 and divide cc_batch_size={cc_batch}"
                         f"{f' and text_batch_size={text_batch}' if spec.text_corpus else ''}")
    if spec.text_corpus and not text_shards:
        raise ValueError(f"setting {spec.name} uses the text corpus but no text shards were given")
    vocab = MaskingVocab.from_tokenizer(tokenizer)
    pairs = pair_shards_with_rois(list(cc_shards), list(roi_parquets))
    streams = []
    for j in range(per_rank):
        cfg = dataclasses.replace(stream_cfg, stream=rank * per_rank + j, num_streams=world_size * per_rank)
        cc = CaptionImageStream(pairs, tokenizer, vocab, cfg, spec, num_object_classes)
        text = TextStream(list(text_shards), tokenizer, vocab, cfg) if spec.text_corpus else None
        streams.append(DataStream(cc, text, cc_batch // per_rank, text_batch // per_rank))
    return PretrainBatches(streams, workers=hp.stream_workers)


@torch.no_grad()
def measure_appearance_statistics(model: nn.Module, cc_shards: list, roi_parquets: list, tokenizer,
                                  stream_cfg: StreamConfig, device: torch.device) -> int:
    """Give the visual FC its appearance statistics (model.standardise_appearance): mean and spread of the
    visual network's RoI features over about APPEARANCE_STATS_IMAGES training images, the first ones of each
    shard after the held-out samples. Every rank reads the same images, so all get the same numbers.
    Returns the number of boxes measured."""
    pairs = pair_shards_with_rois(list(cc_shards), list(roi_parquets))
    first = stream_cfg.held_out_per_shard
    samples = read_cc_samples(pairs, first, first + math.ceil(APPEARANCE_STATS_IMAGES / max(1, len(pairs))), stream_cfg)
    if not samples:
        raise ValueError(f"appearance statistics: no CC training sample with RoIs after the first {first} of the "
                         f"shards {list(cc_shards)[:4]}")
    was_training = model.training
    model.eval()
    features = []
    for start in range(0, len(samples), 16):
        batch = collate_samples([
            {"sequence": build_input_sequence([], None, len(s["boxes"]), cls_id=tokenizer.cls_token_id,
                                              sep_id=tokenizer.sep_token_id, pad_id=tokenizer.pad_token_id),
             "image": s["image"], "boxes": s["boxes"]} for s in samples[start:start + 16]]).to(device)
        features.append(model.visual_features(batch)[batch.box_valid])
    model.train(was_training)
    features = torch.cat(features)
    model.embeddings.visual_feature.set_appearance_statistics(features)
    return features.shape[0]


def run_visual_clue_check(module: nn.Module, cc_shards: list, roi_parquets: list, tokenizer,
                          stream_cfg: StreamConfig, out: Path, device: torch.device) -> dict:
    """Measure and write out/visual_clue.json (main rank only)."""
    held_out = read_held_out_captions(pair_shards_with_rois(list(cc_shards), list(roi_parquets)),
                                      stream_cfg.held_out_per_shard, stream_cfg)
    record = {"setting": module.setting.name,
              "held_out": f"the first {stream_cfg.held_out_per_shard} samples of each of the {len(cc_shards)} CC "
                          f"shards (pretrain.held_out_per_shard), never trained on; {len(held_out)} with RoIs"}
    if held_out:
        record |= visual_clue_check(module.model, module.heads.mlm, held_out, tokenizer, stream_cfg.max_caption_len,
                                    device)
    else:
        log.warning("no held-out caption (pretrain.held_out_per_shard=%d): visual-clue check not measured",
                    stream_cfg.held_out_per_shard)
        record |= {"captions": 0, "with_image": None, "blank_image": None, "paired": None}
    with atomic_path(out / VISUAL_CLUE_FILE) as tmp:
        tmp.write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
    return record


def start_from_model(init_from: str | os.PathLike, spec: PretrainSetting) -> nn.Module:
    """The model of the directory `init_from` (ours, or a converted released VL-BERT) with
    its pre-training heads (heads.safetensors), to continue pre-training it in setting `spec`.

    The architecture is the directory's; the setting decides whether the visual network is tuned. A head the
    setting trains but the directory lacks starts as in a fresh run (BERT's MLM head, else N(0, 0.02))."""
    saved = from_pretrained(init_from)
    if saved.model_type != spec.model_type:
        raise ValueError(f"{init_from} holds a {saved.model_type} model; setting {spec.name!r} pre-trains "
                         f"{spec.model_type}")
    config = saved.config_class.from_dict({**saved.config.to_dict(), "tune_frcnn": spec.tune_frcnn})
    model = type(saved)(config)
    model.load_state_dict(saved.state_dict())
    del saved
    module = pretraining_module(model, spec)
    loaded = module.load_heads(init_from)
    if not loaded.get("mlm"):
        module.heads.load_from_bert(config.bert_path)
    log.info("continuing from %s: heads loaded from it %s (missing ones start fresh)", init_from, loaded)
    return module


def start_from_bert(spec: PretrainSetting, detector_path: str, model_settings: ModelSettings) -> nn.Module:
    """A fresh model of setting `spec`'s family: BERT's weights, the detector's visual network, the pre-training
    heads from BERT where it has them (the rest N(0, 0.02))."""
    detector, detector_meta = load_detector(detector_path)
    record = family(spec.model_type)
    config = record.load("config_builder")(model_settings.section, detector_meta, tune_frcnn=spec.tune_frcnn)
    model = record.load("model_class").from_bert(config, detector.state_dict())
    del detector
    module = pretraining_module(model, spec)
    loaded = module.heads.load_from_bert(config.bert_path)
    log.info("heads from BERT: %s (the rest initialised N(0, 0.02))", loaded)
    return module


def stream_config(hp: PretrainSettings, model_settings: ModelSettings, config, seed: int,
                  max_image_pixels: int) -> StreamConfig:
    """What every data stream of the run shares (data.py); each stream then gets its own index."""
    return StreamConfig(max_caption_len=hp.max_caption_len, max_text_len=hp.max_text_len,
                        max_rois=model_settings.max_rois, image_max_side=model_settings.image_max_side, seed=seed,
                        held_out_per_shard=hp.held_out_per_shard, pixel_format=visual_pixel_format(config),
                        text_only_layout=getattr(config, "text_only_layout", "bert"),  # ViLBERT: no text-only rows
                        image_min_side=model_settings.image_min_side, max_image_pixels=max_image_pixels)


def write_untrained(module: nn.Module, spec: PretrainSetting, init_from: str | None, cc_shards: list,
                    roi_parquets: list, tokenizer, stream_cfg: StreamConfig, out: Path, dev: torch.device,
                    is_main: bool, world_size: int) -> dict:
    """Setting `none`: the model written as it is (BERT-initialised, or init_from's) and measured."""
    if is_main:
        module.model.save_pretrained(out)
        save_pretraining_heads(module.heads, out)
        record = {"step": 0, "setting": spec.name, "steps": 0, "samples": 0,
                  "note": "not pre-trained: the BERT-initialised model" if init_from is None
                  else f"not pre-trained further: the model of {init_from}"}
        _write_metrics(out / METRICS_FILE, [record])
        # The control: the visual term enters through zero-initialised LayerNorms, so both numbers match
        # (for a BERT-initialised model; a model given by init_from is measured as it is).
        clue = run_visual_clue_check(module, cc_shards, roi_parquets, tokenizer, stream_cfg, out, dev)
        with TrainingEvents(out) as events:
            events.write(record)
            events.write(clue, "visual_clue", step=0)
    log.info("setting %s: wrote the %s model to %s without training", spec.name,
             "BERT-initialised" if init_from is None else init_from, out)
    if world_size > 1:
        dist.barrier()
    return {"setting": spec.name, "steps": 0}


def pretraining_step(train_module: nn.Module, batches: PretrainBatches, optimizer, scheduler, trainable: list,
                     clip_grad: float, global_batch: int, setting: str, dev: torch.device,
                     world_size: int) -> Callable[[int], dict]:
    """The step function of the run (training.TrainingRun.train): one optimiser step on the next batch (bf16
    autocast on CUDA), its metrics record (under DDP the mean over ranks)."""
    autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if dev.type == "cuda" else contextlib.nullcontext())

    def train_step(step: int) -> dict:
        started = time.perf_counter()
        batch = next(batches).to(dev)
        normalisers = None
        if world_size > 1:  # each loss = this rank's sum / (global target count / world size): see objectives
            normalisers = target_counts(batch)
            dist.all_reduce(normalisers)
            normalisers /= world_size
        with autocast:
            results = train_module(batch, normalisers)
        optimizer.zero_grad(set_to_none=True)
        results["loss"].backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(trainable, clip_grad)
        lr = scheduler.get_last_lr()[0]
        optimizer.step()
        scheduler.step()
        seconds = time.perf_counter() - started
        record = {"step": step, "lr": lr, "grad_norm": float(grad_norm), "seconds": round(seconds, 4),
                  "samples_per_s": round(global_batch / seconds, 2)}
        names = sorted(results)
        stacked = torch.stack([results[k].detach().float() for k in names])
        if world_size > 1:  # metrics are the mean over ranks
            dist.all_reduce(stacked)
            stacked /= world_size
        values = dict(zip(names, stacked.tolist()))
        if not all(math.isfinite(v) for k, v in values.items() if k.endswith("loss")):
            raise FloatingPointError(f"setting {setting} step {step}: non-finite loss {values}")
        # An accuracy is NaN when the batch had no target for it (e.g. no RoI drawn): null in JSON.
        record.update({k: (v if math.isfinite(v) else None) for k, v in values.items()})
        return record

    return train_step


def pretrain(setting: str, cc_shards: list, roi_parquets: list, text_shards: list, detector_path: str,
             model_cfg: ModelSettings | Mapping[str, Any], pretrain_cfg: PretrainSettings | Mapping[str, Any],
             out_dir: str, seed: int, device: str, *, stop_after_step: int | None = None, init_from: str | None = None,
             max_image_pixels: int = DEFAULT_MAX_PIXELS) -> dict:
    """Pre-train the model of one setting (vlbert_core/pretrain/settings.py); `model_cfg` / `pretrain_cfg`: the
    config's `model:` and `pretrain:` sections, typed (ModelSettings, PretrainSettings; a mapping is read into them);
    `max_image_pixels`: the config's cap on a CC image's pixels (vlbert_core/images.py); writes
    out_dir/{model.safetensors, heads.safetensors, config.json, metrics.jsonl, visual_clue.json}.

    `init_from`: a model directory (ours, or a released VL-BERT converted with `python -m vlbert_core.convert
    vl-bert`) to continue pre-training, heads included, instead of starting from BERT and the detector; with
    setting `none` it is written as it is and only measured (visual_clue.json: its MLM accuracy on the held-out
    captions, with and without the image). `stop_after_step` ends the run right after that step's
    checkpoint without writing the final outputs, as an interruption would (used to test resuming). Returns a
    summary dict.
    """
    spec, out = get_setting(setting), Path(out_dir)
    model_settings, hp = ModelSettings.of(model_cfg), PretrainSettings.of(pretrain_cfg)
    rank, world_size, dev = _init_distributed(device, hp.collective_timeout_s)
    is_main = rank == 0
    seed_everything(seed)
    module = (start_from_model(init_from, spec) if init_from is not None
              else start_from_bert(spec, detector_path, model_settings))
    model, config = module.model, module.model.config
    module.to(dev)
    tokenizer = load_tokenizer(config.bert_path)
    stream_cfg = stream_config(hp, model_settings, config, seed, max_image_pixels)
    if getattr(config, "standardise_appearance", False) and init_from is None:   # a given model keeps its own statistics
        boxes = measure_appearance_statistics(model, cc_shards, roi_parquets, tokenizer, stream_cfg, dev)
        log.info("appearance statistics from %d RoIs of the first training images", boxes)
    if not spec.trains:
        return write_untrained(module, spec, init_from, cc_shards, roi_parquets, tokenizer, stream_cfg, out, dev,
                               is_main, world_size)

    hp.check_schedule()
    seed_everything(seed + rank)  # identical init on every rank (above), but each rank its own dropout masks
    batches = build_batches(spec, cc_shards, roi_parquets, text_shards, tokenizer, config.num_object_classes,
                            stream_cfg, hp, rank, world_size)
    global_batch = batches.samples_per_batch * world_size
    peak_lr = hp.lr_per_sample * global_batch
    # The fused kernel (CPU and CUDA) makes the update of the 30k x hidden word-embedding matrix cheap.
    optimizer = build_optimizer(module, OptimizerSettings(
        "adamw", lr=peak_lr, weight_decay=hp.weight_decay, betas=ADAM_BETAS, eps=ADAM_EPS,
        fused=dev.type in ("cpu", "cuda")), lr_scales=[(module.model.visual_network, hp.visual_lr_scale)])
    scheduler = build_scheduler(optimizer, lambda s: warmup_linear_decay(s, hp.steps, hp.warmup_steps))
    trainable = [p for p in module.parameters() if p.requires_grad]

    fingerprint = run_fingerprint(setting=spec.to_dict(), seed=seed, world_size=world_size,
                                  model=model_settings.to_fingerprint(), pretrain=hp.to_fingerprint(),
                                  files=[*cc_shards, *roi_parquets, *(text_shards if spec.text_corpus else []),
                                         detector_path,
                                         *([] if init_from is None else [str(Path(init_from) / "model.safetensors")])])
    run = TrainingRun(out, f"pretrain {spec.name}", fingerprint=fingerprint, checkpoint_format=CHECKPOINT_FORMAT,
                      total_steps=hp.steps, checkpoint_every=hp.checkpoint_every, kind="a pre-training checkpoint",
                      parts={"model": module.model, "heads": module.heads, "optimizer": optimizer,
                             "scheduler": scheduler}, data=batches, labels={"setting": spec.name}, device=dev,
                      rank=rank, world_size=world_size, per_rank=True, final_checkpoint=True)
    run.resume()
    train_module: torch.nn.Module = module
    if world_size > 1:
        train_module = torch.nn.parallel.DistributedDataParallel(
            module, device_ids=[dev.index] if dev.type == "cuda" else None)
    log.info("setting %s (%s): %d steps, global batch %d (%d per rank, %d data streams%s), peak lr %.3g, "
             "%d/%d parameters trainable", spec.name, spec.to_dict(), hp.steps, global_batch,
             batches.samples_per_batch, world_size * len(batches.streams),
             " in DataLoader workers" if batches.workers else "", peak_lr,
             sum(p.numel() for p in trainable), sum(p.numel() for p in module.parameters()))
    train_module.train()
    step = pretraining_step(train_module, batches, optimizer, scheduler, trainable, hp.clip_grad, global_batch,
                            spec.name, dev, world_size)
    if run.train(step, stop_after_step):
        return {"setting": spec.name, "steps": run.step, "stopped": True, "resumed_from": run.resumed_from}

    skipped = sum((Counter(s) for s in gather(dict(batches.skipped()), world_size)), Counter())
    log.info("setting %s done: %d steps, skipped samples (all ranks) %s", spec.name, run.step, dict(skipped))
    if is_main:
        module.model.save_pretrained(out)
        save_pretraining_heads(module.heads, out)
        _write_metrics(out / METRICS_FILE, run.metrics)
        previous_checkpoint(run.checkpoint_path).unlink(missing_ok=True)  # the final checkpoint.pt stays (benchmarks)
        clue = run_visual_clue_check(module, cc_shards, roi_parquets, tokenizer, stream_cfg, out, dev)
        run.events.write(clue, "visual_clue", step=run.step)
    run.close()
    if world_size > 1:
        dist.barrier()
    return {"setting": spec.name, "steps": run.step, "resumed_from": run.resumed_from,
            "final": run.metrics[-1] if run.metrics else None, "skipped": dict(skipped)}
