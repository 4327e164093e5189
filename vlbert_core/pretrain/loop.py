"""The pre-training loop: one readable loop for every Table 4 setting (nanoGPT style).

AdamW (no weight decay on biases, LayerNorm and other 1-d parameters), linear warm-up then linear
decay, lr = lr_per_sample x global batch, gradient clipping, bf16 autocast on CUDA only, DDP when
launched by torchrun (WORLD_SIZE > 1). A checkpoint (model, heads, optimiser, scheduler, step,
metrics, RNG states and data positions of every rank) is written to <out_dir>/checkpoint.pt every
`checkpoint_every` steps and at the end, the one before kept as checkpoint.previous.pt; a run finds them there and
resumes from the newest readable one (vlbert_core/resume.py). Rank 0 also writes each
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
from typing import Any, Mapping

import torch
import torch.distributed as dist
from vlbert_core.progress import Progress

from vlbert_core.detector import build_resnet_c4, load_detector
from vlbert_core.model import VLBertConfig, VLBertModel, build_input_sequence, collate_samples, load_tokenizer
from vlbert_core.model.bert_init import read_bert_config
from vlbert_core.model.config import RELEASED_OPTION_KEYS, bert_fields_from_hf_config, visual_pixel_format
from vlbert_core.model.heads import save_pretraining_heads
from vlbert_core.images import DEFAULT_MAX_PIXELS
from vlbert_core.model_registry import from_pretrained, model_class
from vlbert_core.preemption import StopSignals
from vlbert_core.vilbert.config import ViLBertConfig
from vlbert_core.optim import OptimizerSettings, build_optimizer, build_scheduler, warmup_linear_decay
from vlbert_core.resume import (load_resume_checkpoint, previous_checkpoint, rng_state, run_fingerprint,
                                save_resume_checkpoint, set_rng_state)
from vlbert_core.tensorboard_log import TrainingEvents
from vlbert_core.utils import atomic_path, get_logger, seed_everything

from .data import (
    CaptionImageStream, DataStream, PretrainBatches, StreamConfig, TextStream, pair_shards_with_rois, read_cc_samples,
    read_held_out_captions,
)
from .launch import DEFAULT_COLLECTIVE_TIMEOUT_S
from .masking import MaskingVocab
from .objectives import VLBertForPretraining, pretraining_module, target_counts
from .settings import PretrainSetting, get_setting
from .visual_clue import visual_clue_check

log = get_logger(__name__)

CHECKPOINT_FILE = "checkpoint.pt"
METRICS_FILE = "metrics.jsonl"
VISUAL_CLUE_FILE = "visual_clue.json"
CHECKPOINT_FORMAT = 2  # 2: data state per stream
ADAM_BETAS = (0.9, 0.999)
ADAM_EPS = 1e-6  # as in BERT and the released VL-BERT optimiser
APPEARANCE_STATS_IMAGES = 256  # training images whose RoI features give the appearance statistics

PRETRAIN_KEYS = ("steps", "cc_batch_size", "text_batch_size", "lr_per_sample", "weight_decay", "warmup_steps",
                 "clip_grad", "max_text_len", "max_caption_len", "checkpoint_every", "streams_per_rank",
                 "stream_workers", "held_out_per_shard")
MODEL_KEYS = ("bert_path", "num_hidden_layers", "geometry_dim", "max_rois", "image_max_side", "frozen_stages",
              "freeze_bn")


def _require(cfg: Mapping[str, Any], keys: tuple[str, ...], section: str) -> None:
    missing = [k for k in keys if k not in cfg]
    if missing:
        raise KeyError(f"config section '{section}' lacks keys {missing}")


def visual_backbone(model_cfg: Mapping[str, Any], detector_meta: Mapping[str, Any]) -> tuple[dict, int]:
    """(the visual network's backbone config, its RoI feature size): the detector's, with the config's changes."""
    backbone = {k: v for k, v in dict(detector_meta["config"]["backbone"]).items() if k != "init_weights"}
    if model_cfg.get("visual_head_dilation") is not None:
        # released: the detector's stage 5 re-used per RoI at stride 1, dilation 2 (IMAGE_C5_DILATED)
        backbone["head_dilation"] = int(model_cfg["visual_head_dilation"])
    if model_cfg.get("visual_stem_pool") is not None:
        # released: VL-BERT's own ResNet pools its stem the torchvision way, though its weights are the Caffe
        # detector's (resnet101-pt-vgbua)
        backbone["stem_pool"] = str(model_cfg["visual_stem_pool"])
    _, _, _, appearance_dim = build_resnet_c4(backbone)
    return backbone, appearance_dim


def build_vlbert_config(model_cfg: Mapping[str, Any], detector_meta: Mapping[str, Any], *, tune_frcnn: bool) -> VLBertConfig:
    """VLBertConfig from the config's `model:` section, the BERT checkpoint and the detector checkpoint."""
    _require(model_cfg, MODEL_KEYS, "model")
    backbone, appearance_dim = visual_backbone(model_cfg, detector_meta)
    return VLBertConfig(
        **bert_fields_from_hf_config(read_bert_config(model_cfg["bert_path"]), int(model_cfg["num_hidden_layers"])),
        visual_backbone=backbone, appearance_dim=appearance_dim, geometry_dim=int(model_cfg["geometry_dim"]),
        num_object_classes=int(detector_meta["num_classes"]) + 1,  # + background, as in the RoI class scores
        tune_frcnn=tune_frcnn, frozen_stages=int(model_cfg["frozen_stages"]), freeze_bn=bool(model_cfg["freeze_bn"]),
        bert_path=str(model_cfg["bert_path"]),
        visual_scale_text_init=float(model_cfg.get("visual_scale_text_init", 0.0)),
        visual_scale_object_init=float(model_cfg.get("visual_scale_object_init", 0.0)),
        standardise_appearance=bool(model_cfg.get("standardise_appearance", False)),
        **{k: model_cfg[k] for k in RELEASED_OPTION_KEYS if model_cfg.get(k) is not None},
    )


def build_vilbert_config(model_cfg: Mapping[str, Any], detector_meta: Mapping[str, Any], *,
                         tune_frcnn: bool) -> ViLBertConfig:
    """ViLBertConfig from the config's `model:` section (its `vilbert:` sizes), the BERT checkpoint (the text
    stream, cut to num_hidden_layers as VL-BERT's) and the detector checkpoint (the same visual network)."""
    _require(model_cfg, MODEL_KEYS, "model")
    backbone, appearance_dim = visual_backbone(model_cfg, detector_meta)
    bert = read_bert_config(model_cfg["bert_path"])
    return ViLBertConfig(
        **bert_fields_from_hf_config(bert, int(model_cfg["num_hidden_layers"])),
        type_vocab_size=int(bert.get("type_vocab_size", 2)),
        **dict(model_cfg.get("vilbert") or {}),
        visual_backbone=backbone, appearance_dim=appearance_dim,
        num_object_classes=int(detector_meta["num_classes"]) + 1,  # + background, as in the RoI class scores
        tune_frcnn=tune_frcnn, frozen_stages=int(model_cfg["frozen_stages"]), freeze_bn=bool(model_cfg["freeze_bn"]),
        bert_path=str(model_cfg["bert_path"]),
        **{k: model_cfg[k] for k in ("roi_sampling_ratio", "task_heads") if model_cfg.get(k) is not None},
    )


# model_type -> how a pre-training run builds its config from the run's config
CONFIG_BUILDERS = {"vlbert": build_vlbert_config, "vilbert": build_vilbert_config}


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


def _gather(obj: Any, world_size: int) -> list:
    if world_size == 1:
        return [obj]
    out: list = [None] * world_size
    dist.all_gather_object(out, obj)
    return out


def _write_metrics(path: Path, records: list[dict]) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in records))


def build_batches(spec: PretrainSetting, cc_shards: list, roi_parquets: list, text_shards: list, tokenizer,
                  num_object_classes: int, stream_cfg: StreamConfig, pretrain_cfg: Mapping[str, Any], rank: int,
                  world_size: int) -> PretrainBatches:
    """This rank's streams (see data.py): streams rank*k .. rank*k+k-1 of world_size*k, k = streams_per_rank,
    each with cc_batch_size/k CC samples (+ text_batch_size/k text samples) per step."""
    per_rank = int(pretrain_cfg["streams_per_rank"])
    cc_batch, text_batch = int(pretrain_cfg["cc_batch_size"]), int(pretrain_cfg["text_batch_size"])
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
    return PretrainBatches(streams, workers=bool(pretrain_cfg["stream_workers"]))


@torch.no_grad()
def measure_appearance_statistics(model: VLBertModel, cc_shards: list, roi_parquets: list, tokenizer,
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


def run_visual_clue_check(module: VLBertForPretraining, cc_shards: list, roi_parquets: list, tokenizer,
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


def start_from_model(init_from: str | os.PathLike, spec: PretrainSetting) -> VLBertForPretraining:
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


def pretrain(setting: str, cc_shards: list, roi_parquets: list, text_shards: list, detector_path: str,
             model_cfg: dict, pretrain_cfg: dict, out_dir: str, seed: int, device: str, *,
             stop_after_step: int | None = None, init_from: str | None = None,
             max_image_pixels: int = DEFAULT_MAX_PIXELS) -> dict:
    """Pre-train the model of one setting (vlbert_core/pretrain/settings.py); `max_image_pixels`: the config's cap
    on a CC image's pixels (vlbert_core/images.py); writes out_dir/{model.safetensors, heads.safetensors,
    config.json, metrics.jsonl, visual_clue.json}.

    `init_from`: a model directory (ours, or a released VL-BERT converted with `python -m vlbert_core.convert
    vl-bert`) to continue pre-training, heads included, instead of starting from BERT and the detector; with
    setting `none` it is written as it is and only measured (visual_clue.json: its MLM accuracy on the held-out
    captions, with and without the image). `stop_after_step` ends the run right after that step's
    checkpoint without writing the final outputs, as an interruption would (used to test resuming). Returns a
    summary dict.
    """
    spec = get_setting(setting)
    _require(pretrain_cfg, PRETRAIN_KEYS, "pretrain")
    out = Path(out_dir)
    rank, world_size, dev = _init_distributed(
        device, float(pretrain_cfg.get("collective_timeout_s", DEFAULT_COLLECTIVE_TIMEOUT_S)))
    is_main = rank == 0
    seed_everything(seed)

    if init_from is not None:
        module = start_from_model(init_from, spec)
        model, config = module.model, module.model.config
    else:
        detector, detector_meta = load_detector(detector_path)
        config = CONFIG_BUILDERS[spec.model_type](model_cfg, detector_meta, tune_frcnn=spec.tune_frcnn)
        model = model_class(spec.model_type).from_bert(config, detector.state_dict())
        del detector
        module = pretraining_module(model, spec)
        loaded = module.heads.load_from_bert(config.bert_path)
        log.info("heads from BERT: %s (the rest initialised N(0, 0.02))", loaded)
    module.to(dev)
    tokenizer = load_tokenizer(config.bert_path)
    stream_cfg = StreamConfig(max_caption_len=int(pretrain_cfg["max_caption_len"]),
                              max_text_len=int(pretrain_cfg["max_text_len"]), max_rois=int(model_cfg["max_rois"]),
                              image_max_side=int(model_cfg["image_max_side"]), seed=seed,
                              held_out_per_shard=int(pretrain_cfg["held_out_per_shard"]),
                              pixel_format=visual_pixel_format(config),
                              text_only_layout=getattr(config, "text_only_layout", "bert"),  # ViLBERT: no text-only rows
                              image_min_side=None if model_cfg.get("image_min_side") is None
                              else int(model_cfg["image_min_side"]),
                              max_image_pixels=int(max_image_pixels))

    if getattr(config, "standardise_appearance", False) and init_from is None:   # a given model keeps its own statistics
        boxes = measure_appearance_statistics(model, cc_shards, roi_parquets, tokenizer, stream_cfg, dev)
        log.info("appearance statistics from %d RoIs of the first training images", boxes)

    if not spec.trains:
        if is_main:
            model.save_pretrained(out)
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

    steps, warmup = int(pretrain_cfg["steps"]), int(pretrain_cfg["warmup_steps"])
    if steps < 1 or warmup < 0 or int(pretrain_cfg["checkpoint_every"]) < 1:
        raise ValueError(f"pretrain: steps ({steps}) and checkpoint_every must be >= 1, warmup_steps >= 0")
    seed_everything(seed + rank)  # identical init on every rank (above), but each rank its own dropout masks
    batches = build_batches(spec, cc_shards, roi_parquets, text_shards, tokenizer, config.num_object_classes,
                            stream_cfg, pretrain_cfg, rank, world_size)

    global_batch = batches.samples_per_batch * world_size
    peak_lr = float(pretrain_cfg["lr_per_sample"]) * global_batch
    # The fused kernel (CPU and CUDA) makes the update of the 30k x hidden word-embedding matrix cheap.
    optimizer = build_optimizer(module, OptimizerSettings(
        "adamw", lr=peak_lr, weight_decay=float(pretrain_cfg["weight_decay"]), betas=ADAM_BETAS, eps=ADAM_EPS,
        fused=dev.type in ("cpu", "cuda")),
        lr_scales=[(module.model.visual_network, float(pretrain_cfg.get("visual_lr_scale", 1.0)))])
    scheduler = build_scheduler(optimizer, lambda s: warmup_linear_decay(s, steps, warmup))
    trainable = [p for p in module.parameters() if p.requires_grad]

    fingerprint = run_fingerprint(setting=spec.to_dict(), seed=seed, world_size=world_size, model=dict(model_cfg),
                               pretrain={k: v for k, v in pretrain_cfg.items()
                                         if k not in ("settings", "collective_timeout_s")},
                               files=[*cc_shards, *roi_parquets, *(text_shards if spec.text_corpus else []), detector_path,
                                      *([] if init_from is None else [str(Path(init_from) / "model.safetensors")])])
    step, metrics, resumed_from = 0, [], None
    ckpt_path = out / CHECKPOINT_FILE
    found, ckpt = load_resume_checkpoint(ckpt_path, "a pre-training checkpoint")
    if ckpt is not None:
        if ckpt.get("format") == CHECKPOINT_FORMAT and ckpt.get("fingerprint") == fingerprint:
            module.model.load_state_dict(ckpt["model"])
            module.heads.load_state_dict(ckpt["heads"])
            optimizer.load_state_dict(ckpt["optimizer"])
            scheduler.load_state_dict(ckpt["scheduler"])
            batches.load_state(ckpt["data"][rank])
            set_rng_state(ckpt["rng"][rank], dev)
            step, metrics = int(ckpt["step"]), list(ckpt["metrics"])
            resumed_from = step
            log.info("resumed from %s at step %d", found, step)
        else:
            log.warning("%s belongs to another configuration or input; starting from scratch", found)

    def save_checkpoint() -> None:
        data_states = _gather(batches.state(), world_size)
        rng_states = _gather(rng_state(dev), world_size)
        if is_main:
            save_resume_checkpoint({"format": CHECKPOINT_FORMAT, "fingerprint": fingerprint, "setting": spec.name,
                                    "step": step, "model": module.model.state_dict(),
                                    "heads": module.heads.state_dict(), "optimizer": optimizer.state_dict(),
                                    "scheduler": scheduler.state_dict(), "data": data_states, "rng": rng_states,
                                    "metrics": metrics}, ckpt_path)

    train_module: torch.nn.Module = module
    if world_size > 1:
        train_module = torch.nn.parallel.DistributedDataParallel(
            module, device_ids=[dev.index] if dev.type == "cuda" else None)
    autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if dev.type == "cuda" else contextlib.nullcontext())
    log.info("setting %s (%s): %d steps, global batch %d (%d per rank, %d data streams%s), peak lr %.3g, "
             "%d/%d parameters trainable", spec.name, spec.to_dict(), steps, global_batch, batches.samples_per_batch,
             world_size * len(batches.streams), " in DataLoader workers" if batches.workers else "", peak_lr,
             sum(p.numel() for p in trainable), sum(p.numel() for p in module.parameters()))

    events = TrainingEvents(out, resume_step=resumed_from, enabled=is_main)
    if metrics:
        events.write(metrics[-1])  # purged with the steps trained again after the checkpoint
    train_module.train()
    log_every = max(1, steps // 20)
    progress = Progress(total=steps, initial=step, desc=f"pretrain {spec.name}", unit="step", disable=not is_main)
    with StopSignals() as stop:
        while step < steps:
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
            grad_norm = torch.nn.utils.clip_grad_norm_(trainable, float(pretrain_cfg["clip_grad"]))
            lr = scheduler.get_last_lr()[0]
            optimizer.step()
            scheduler.step()
            step += 1
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
                raise FloatingPointError(f"setting {spec.name} step {step}: non-finite loss {values}")
            # An accuracy is NaN when the batch had no target for it (e.g. no RoI drawn): null in JSON.
            record.update({k: (v if math.isfinite(v) else None) for k, v in values.items()})
            metrics.append(record)
            events.write(record)
            progress.update(1)
            progress.set_postfix(loss=f"{record['loss']:.3f}", samples_s=record["samples_per_s"])
            if step % log_every == 0 or step == steps:
                log.info("step %d/%d %s", step, steps,
                         " ".join(f"{k}={v:.4g}" for k, v in record.items() if k != "step" and v is not None))
            why_stop = stop.after_step(step, steps, stop_after_step, world_size)
            if step % int(pretrain_cfg["checkpoint_every"]) == 0 or step == steps or why_stop:
                save_checkpoint()
            if why_stop:
                progress.close()
                events.close()
                if why_stop == "signal":  # SIGTERM: SLURM preempts or hits the time limit
                    raise stop.stop(f"pretrain {spec.name}", step, str(ckpt_path))
                log.info("stopping after step %d as asked (checkpoint written)", step)
                return {"setting": spec.name, "steps": step, "stopped": True, "resumed_from": resumed_from}
    progress.close()

    skipped = sum((Counter(s) for s in _gather(dict(batches.skipped()), world_size)), Counter())
    log.info("setting %s done: %d steps, skipped samples (all ranks) %s", spec.name, step, dict(skipped))
    if is_main:
        module.model.save_pretrained(out)
        save_pretraining_heads(module.heads, out)
        _write_metrics(out / METRICS_FILE, metrics)
        previous_checkpoint(ckpt_path).unlink(missing_ok=True)  # the final checkpoint.pt stays (benchmarks read it)
        clue = run_visual_clue_check(module, cc_shards, roi_parquets, tokenizer, stream_cfg, out, dev)
        events.write(clue, "visual_clue", step=step)
    events.close()
    if world_size > 1:
        dist.barrier()
    return {"setting": spec.name, "steps": step, "resumed_from": resumed_from, "final": metrics[-1] if metrics else None,
            "skipped": dict(skipped)}
