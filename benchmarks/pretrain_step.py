"""Benchmark: one VL-BERT pre-training step against a bare transformers.BertModel step of the same size.

Measured in one run, alternating (A B C D E F G, A B C D E F G, ...) so that a noisy shared machine slows all of
them alike, and reported as medians:

  A  VL-BERT step, setting d (frozen Fast R-CNN): the real loss path of the loop (VLBertForPretraining:
     visual network on the pixel-masked images, embeddings, encoder, MLM / masked-RoI heads, losses),
     backward, gradient clipping, fused AdamW step.
  B  the same step without the visual CNN: the RoI features of the batch are computed once beforehand
     (`VLBertModel.visual_features`, with the batch's RoI masking) and passed in (`roi_features=`), so the
     step skips the CNN and nothing else. In a frozen setting the CNN runs without gradients and depends on
     nothing that trains, so B computes exactly the same step as A.
  C  bare transformers.BertModel (same hidden size, layers, heads, intermediate size and vocabulary), on the
     same batch size, sequence length and padding mask: forward, a scalar loss on the last hidden states,
     backward, the same clipping and fused AdamW step.
  D  VL-BERT step, setting full (stages 3-5 of the Fast R-CNN tuned: the CNN runs with gradients).
  E  the visual network's forward alone (frozen mode, no gradients).
  F  the MLM head alone (transform, decoder tied to the vocabulary x hidden word embeddings, cross-entropy)
     on the batch's masked positions, forward + backward: a part of B that a bare BertModel has no
     counterpart of.
  G  B with the MLM decoder as a plain nn.functional.linear (the head before its tied decoder computed the
     weight gradient in the embedding's layout): the before/after of that change in one run.

Target (issue 20): B / C <= 1.15.

    uv run python benchmarks/pretrain_step.py --threads 2 --size embedded base --write-docs
"""

from __future__ import annotations

import argparse
import copy
import platform
import re
import statistics
import sys
import time
from pathlib import Path

from docs_section import replace_section  # benchmarks/ is on sys.path when a benchmark runs as a script
from gpu import training_step  # the step as the training loops take one (fp32 here: no autocast)

import numpy as np
import torch
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from vlbert_core.detector import build_resnet_c4  # noqa: E402
from vlbert_core.models.common.bert_init import load_tokenizer, read_bert_config  # noqa: E402
from vlbert_core.models.common.config import bert_fields_from_hf_config  # noqa: E402
from vlbert_core.models.common.inputs import build_input_sequence  # noqa: E402
from vlbert_core.models.registry import family  # noqa: E402
from vlbert_core.optim import OptimizerSettings, build_optimizer  # noqa: E402
from vlbert_core.pretrain import get_setting  # noqa: E402
from vlbert_core.pretrain.data import collate_pretrain  # noqa: E402
from vlbert_core.pretrain.loop import ADAM_BETAS, ADAM_EPS  # noqa: E402
from vlbert_core.pretrain.masking import IGNORE_INDEX, MaskingVocab, mask_rois, whole_word_mask  # noqa: E402
from vlbert_core.utils import keep_freed_memory  # noqa: E402

VLBERT = family("vlbert")
VLBertConfig, VLBertModel = VLBERT.config_class, VLBERT.load("model_class")
VLBertForPretraining = VLBERT.load("pretraining_module")


SECTION = "## Pre-training step"
# BERT-BASE's shape; the benchmark's default is the embedded model of config/config.yaml.
BASE_SHAPE = {"hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12, "intermediate_size": 3072}
COLOURS = ["red", "green", "blue", "yellow", "purple", "orange"]
OBJECTS = ["ball", "box", "triangle", "person", "star", "ring"]
TEXT = ("the little red ball had promised to stay close to the big blue box until the evening , because it "
        "believed that every purple thing deserved at least one friend and nobody had ever told it that stars "
        "could not dance . ") * 8


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads (default 2)")
    parser.add_argument("--system-allocator", action="store_true",
                        help="leave glibc's malloc thresholds alone (the jobs' before keep_freed_memory)")
    parser.add_argument("--size", nargs="+", choices=["embedded", "base"], default=["embedded", "base"],
                        help="model sizes, measured one after the other (default both). embedded: the model of "
                             "config/config.yaml (MiniLM's shape, its first k layers); base: BERT-BASE's shape "
                             "(768 hidden, 12 layers, 12 heads, 3072)")
    parser.add_argument("--reps", type=int, default=5, help="measured rounds (each runs A B C D E F G once)")
    parser.add_argument("--warmup", type=int, default=2, help="unmeasured rounds first")
    parser.add_argument("--write-docs", action="store_true", help=f"replace the body of '{SECTION}' in docs/benchmarks.md")
    return parser.parse_args()


def build_config(size: str, cfg: dict, *, tune_frcnn: bool) -> VLBertConfig:
    """The default config's VL-BERT (random weights: only the shapes matter for timing)."""
    model_cfg = cfg["model"]
    bert = bert_fields_from_hf_config(read_bert_config(model_cfg["bert_path"]), model_cfg["num_hidden_layers"])
    if size == "base":
        bert.update(BASE_SHAPE)
    backbone = dict(cfg["detector"]["backbone"])
    _, _, _, appearance_dim = build_resnet_c4(backbone)
    return VLBertConfig(**bert, visual_backbone=backbone, appearance_dim=appearance_dim,
                        geometry_dim=int(model_cfg["geometry_dim"]), num_object_classes=len(OBJECTS) + 1,
                        tune_frcnn=tune_frcnn, frozen_stages=int(model_cfg["frozen_stages"]),
                        freeze_bn=bool(model_cfg["freeze_bn"]), bert_path=model_cfg["bert_path"],
                        standardise_appearance=bool(model_cfg["standardise_appearance"]))


def build_batch(cfg: dict, tokenizer, rng: np.random.Generator):
    """A setting-d mini-batch as the loop builds it: cc_batch_size <Caption, Image> samples (image of
    image_max_side px, max_rois boxes incl. the whole image, MLM and RoI masking) + text_batch_size
    <Text, ∅> samples of max_text_len tokens."""
    vocab = MaskingVocab.from_tokenizer(tokenizer)
    side, max_rois = int(cfg["model"]["image_max_side"]), int(cfg["model"]["max_rois"])
    pre = cfg["pretrain"]
    samples = []
    for _ in range(int(pre["cc_batch_size"])):
        words = []
        for _ in range(2):
            words += ["a", str(rng.choice(["small", "large"])), str(rng.choice(COLOURS)), str(rng.choice(OBJECTS))]
        caption = " ".join(words[:4] + ["beside"] + words[4:] + ["on", "a", "striped", "background"])
        ids = tokenizer(caption, add_special_tokens=False)["input_ids"][: int(pre["max_caption_len"]) - 2]
        masked_ids, labels = whole_word_mask(ids, tokenizer.convert_ids_to_tokens(ids), rng, vocab)
        corners = np.sort(rng.uniform(0, side, size=(max_rois - 1, 2, 2)), axis=1)    # x1<x2, y1<y2
        boxes = np.concatenate([[[0, 0, side, side]], corners.reshape(-1, 4)])          # x1, y1, x2, y2
        selected, masked = mask_rois(max_rois, rng)
        seq = build_input_sequence(masked_ids, None, max_rois, cls_id=tokenizer.cls_token_id,
                                   sep_id=tokenizer.sep_token_id, pad_id=tokenizer.pad_token_id)
        scores = rng.dirichlet(np.ones(len(OBJECTS) + 1), size=max_rois).astype(np.float32)
        scores[0] = 0.0
        samples.append({
            "sequence": seq, "mlm_labels": [IGNORE_INDEX, *labels] + [IGNORE_INDEX] * (len(seq) - len(labels) - 1),
            "image": torch.randn(3, side, side), "boxes": torch.as_tensor(boxes, dtype=torch.float32),
            "roi_masked": torch.from_numpy(masked), "roi_selected": torch.from_numpy(selected),
            "roi_labels": torch.from_numpy(scores), "relationship": IGNORE_INDEX,
        })
    text_ids = tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    for i in range(int(pre["text_batch_size"])):
        ids = text_ids[i: i + int(pre["max_text_len"]) - 2]
        masked_ids, labels = whole_word_mask(ids, tokenizer.convert_ids_to_tokens(ids), rng, vocab)
        seq = build_input_sequence(masked_ids, None, None, cls_id=tokenizer.cls_token_id,
                                   sep_id=tokenizer.sep_token_id, pad_id=tokenizer.pad_token_id)
        samples.append({"sequence": seq, "mlm_labels": [IGNORE_INDEX, *labels, IGNORE_INDEX],
                        "relationship": IGNORE_INDEX})
    return collate_pretrain(samples)


def optimizer_for(module: torch.nn.Module, cfg: dict) -> torch.optim.Optimizer:
    # As in the loop: AdamW without decay on 1-d parameters, fused kernel, lr is irrelevant to timing.
    settings = OptimizerSettings("adamw", lr=1e-5, weight_decay=float(cfg["pretrain"]["weight_decay"]),
                                 betas=ADAM_BETAS, eps=ADAM_EPS, fused=True)
    return build_optimizer(module, settings)


def machine() -> str:
    cpu = "unknown CPU"
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        match = re.search(r"model name\s*:\s*(.+)", cpuinfo.read_text())
        if match:
            cpu = match.group(1).strip()
    import os

    return (f"{cpu}, {os.cpu_count()} cores visible, {platform.system()} {platform.machine()}, "
            f"Python {platform.python_version()}, torch {torch.__version__}")


def measure(size: str, cfg: dict, batch, args: argparse.Namespace) -> tuple[dict[str, list[float]], VLBertConfig]:
    """Seconds of the steps A-E (see the module docstring) in each measured round, for one model size."""
    clip = float(cfg["pretrain"]["clip_grad"])
    torch.manual_seed(0)
    frozen = VLBertForPretraining(VLBertModel(build_config(size, cfg, tune_frcnn=False)), get_setting("d")).train()
    tuned = VLBertForPretraining(VLBertModel(build_config(size, cfg, tune_frcnn=True)), get_setting("full")).train()
    config = frozen.model.config
    with torch.no_grad():
        precomputed = frozen.model.visual_features(batch.inputs)

    from transformers import BertConfig, BertModel

    bert = BertModel(BertConfig(vocab_size=config.vocab_size, hidden_size=config.hidden_size,
                                num_hidden_layers=config.num_hidden_layers,
                                num_attention_heads=config.num_attention_heads,
                                intermediate_size=config.intermediate_size, hidden_act=config.hidden_act,
                                hidden_dropout_prob=config.hidden_dropout_prob,
                                attention_probs_dropout_prob=config.attention_probs_dropout_prob,
                                max_position_embeddings=config.max_position_embeddings),
                     add_pooling_layer=False).train()
    input_ids, attention_mask = batch.inputs.input_ids, batch.inputs.attention_mask.long()

    def visual_forward() -> None:
        with torch.no_grad():
            frozen.model.visual_features(batch.inputs)

    targets = batch.mlm_labels != IGNORE_INDEX
    head_input = torch.randn(int(targets.sum()), config.hidden_size, requires_grad=True)

    def mlm_head() -> None:
        frozen.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(frozen.heads.mlm(head_input), batch.mlm_labels[targets]).backward()

    plain = copy.deepcopy(frozen)
    plain.heads.mlm.__dict__["_word_embeddings"] = plain.model.word_embeddings()
    plain_mlm = plain.heads.mlm
    plain_mlm.forward = lambda hidden: torch.nn.functional.linear(  # the decoder as it was before G's change
        plain_mlm.transform(hidden), plain_mlm._word_embeddings.weight, plain_mlm.bias)

    steps = {
        "A": training_step(frozen, optimizer_for(frozen, cfg), lambda: frozen(batch)["loss"], clip),
        "B": training_step(frozen, optimizer_for(frozen, cfg), lambda: frozen(batch, roi_features=precomputed)["loss"], clip),
        "C": training_step(bert, optimizer_for(bert, cfg), lambda: bert(input_ids=input_ids, attention_mask=attention_mask)
                       .last_hidden_state.square().mean(), clip),
        "D": training_step(tuned, optimizer_for(tuned, cfg), lambda: tuned(batch)["loss"], clip),
        "E": visual_forward,
        "F": mlm_head,
        "G": training_step(plain, optimizer_for(plain, cfg), lambda: plain(batch, roi_features=precomputed)["loss"], clip),
    }
    times: dict[str, list[float]] = {k: [] for k in steps}
    for round_index in range(args.warmup + args.reps):
        for name, step in steps.items():
            started = time.perf_counter()
            step()
            if round_index >= args.warmup:
                times[name].append(time.perf_counter() - started)
        print(f"{size} round {round_index + 1}/{args.warmup + args.reps}"
              + ("" if round_index >= args.warmup else " (warm-up)"),
              " ".join(f"{k}={v[-1]:.3f}s" for k, v in times.items() if v and round_index >= args.warmup),
              file=sys.stderr)
    return times, config


def summarise(times: dict[str, list[float]]) -> dict[str, float]:
    """Medians of the times, and of the per-round ratios and differences: the steps of one round run within
    seconds of each other, so a change of the machine's load between rounds cancels out of those."""
    out = {k: statistics.median(v) for k, v in times.items()}
    rounds = range(len(times["C"]))
    for name in ("A", "B", "D", "F", "G"):
        out[f"{name}/C"] = statistics.median(times[name][i] / times["C"][i] for i in rounds)
    out["(B-F)/C"] = statistics.median((times["B"][i] - times["F"][i]) / times["C"][i] for i in rounds)
    out["A-B"] = statistics.median(times["A"][i] - times["B"][i] for i in rounds)
    out["D-B"] = statistics.median(times["D"][i] - times["B"][i] for i in rounds)
    out["B/G"] = statistics.median(times["B"][i] / times["G"][i] for i in rounds)
    return out


def mlm_head_share(config: VLBertConfig, batch) -> float:
    """Matmul FLOPs of the MLM head (transform + vocabulary decoder on the masked positions) over those of the
    encoder layers on the whole batch: what the VL-BERT step computes and a bare BertModel does not."""
    tokens = int(batch.inputs.attention_mask.numel())
    masked = int((batch.mlm_labels != IGNORE_INDEX).sum())
    hidden, inter = config.hidden_size, config.intermediate_size
    encoder = tokens * config.num_hidden_layers * (4 * hidden * hidden + 2 * hidden * inter)
    head = masked * (hidden * hidden + hidden * config.vocab_size)
    return head / encoder


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    if not args.system_allocator:
        keep_freed_memory()   # as every workflow job does (vlbert_core.utils.setup_compute)
    cfg = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    tokenizer = load_tokenizer(cfg["model"]["bert_path"])
    batch = build_batch(cfg, tokenizer, np.random.default_rng(0))
    results = {size: measure(size, cfg, batch, args) for size in args.size}

    batch_size, length = batch.inputs.input_ids.shape
    num_cc = int(batch.inputs.has_image.sum())
    any_config = next(iter(results.values()))[1]
    lines = [
        f"Batch (setting d of config/config.yaml): {batch_size} samples ({num_cc} <Caption, Image> with "
        f"{batch.inputs.boxes.shape[1]} boxes on {batch.inputs.images.shape[-1]}-px images + {batch_size - num_cc} "
        f"<Text, ∅>), padded length {length}, {int((batch.mlm_labels != IGNORE_INDEX).sum())} masked tokens; the "
        "bare BertModel gets the same ids and padding mask. VL-BERT's encoder runs its projections on the "
        f"{int(batch.inputs.attention_mask.sum())} real elements only (`PackedLayout`, models/common/encoder.py), as the "
        "loop does. Visual network: the default detector's ResNet-C4 "
        f"(stage widths {any_config.visual_backbone['stage_widths']}, {any_config.appearance_dim}-d RoI "
        f"features), geometry {any_config.geometry_dim}-d. Random weights.",
        f"Machine: {machine()}; {args.threads} threads; "
        + ("glibc's default malloc thresholds (`--system-allocator`)" if args.system_allocator
           else "freed memory kept for reuse, as in the jobs (`keep_freed_memory`)")
        + f"; {args.warmup} warm-up rounds, then {args.reps} measured "
        "rounds of A B C D E F G; per-round times: "
        + "; ".join(f"{size} " + " ".join(f"{k}=[{', '.join(f'{t:.2f}' for t in v)}]" for k, v in times.items())
                    for size, (times, _) in results.items()) + ".",
    ]
    for size, (times, config) in results.items():
        median = summarise(times)
        name = (f"embedded model (config/config.yaml: MiniLM-L6's shape, first {config.num_hidden_layers} layers)"
                if size == "embedded" else "BERT-BASE size")
        lines += [
            "",
            f"**{name}**: hidden {config.hidden_size}, {config.num_hidden_layers} layers, "
            f"{config.num_attention_heads} heads, intermediate {config.intermediate_size}, vocabulary "
            f"{config.vocab_size}.",
            "",
            "| step | median s | vs bare BertModel (median of per-round ratios) |",
            "|---|---|---|",
            f"| A: VL-BERT, setting d (frozen Fast R-CNN in the step) | {median['A']:.3f} | {median['A/C']:.2f}× |",
            f"| **B: VL-BERT, setting d, RoI features precomputed (no CNN)** | {median['B']:.3f} | "
            f"**{median['B/C']:.2f}×** (target ≤ 1.15×) |",
            f"| C: bare `transformers.BertModel` forward + backward + AdamW | {median['C']:.3f} | 1.00× |",
            f"| D: VL-BERT, setting full (Fast R-CNN stages 3-5 tuned) | {median['D']:.3f} | {median['D/C']:.2f}× |",
            f"| E: visual network forward alone (frozen) | {median['E']:.3f} | |",
            f"| F: MLM head alone (part of B), forward + backward | {median['F']:.3f} | {median['F/C']:.2f}× |",
            f"| B without its MLM head (B − F) | | {median['(B-F)/C']:.2f}× |",
            f"| G: B with the MLM decoder as a plain `linear` (before the tied-decoder change) | {median['G']:.3f} | "
            f"{median['G/C']:.2f}× (B / G = {median['B/G']:.2f}) |",
            "",
            f"Visual-network cost: {median['E']:.3f} s a step frozen (E; A − B, the median of per-round "
            f"differences, is {median['A-B']:.3f} s), {median['D-B']:.3f} s tuned (D − B, with setting full's "
            f"backward through stages 3-5); B itself varied by {max(times['B']) - min(times['B']):.2f} s between "
            f"rounds, so a difference below that is noise. The MLM head over the masked tokens (a {config.vocab_size}-word decoder), which "
            f"B computes and C does not, has {100 * mlm_head_share(config, batch):.0f}% of the encoder's matmul "
            "FLOPs at this size, and its vocabulary x hidden matrix is read and written several times a step.",
        ]
    lines += [
        "",
        "B computes exactly A's step: in a frozen setting the CNN runs without gradients and its output does "
        "not depend on anything that trains; B passes the batch's RoI features (computed once beforehand, with "
        "the same pixel masking) as `roi_features=` and skips only the CNN. C's loss is the mean square of the "
        "last hidden states.",
        "",
        "```bash",
        f"uv run python benchmarks/pretrain_step.py --threads {args.threads} --size {' '.join(args.size)} "
        f"--reps {args.reps} --warmup {args.warmup}" + (" --system-allocator" if args.system_allocator else "")
        + (" --write-docs" if args.write_docs else ""),
        "```",
    ]
    report = "\n".join(lines)
    print(report)
    if args.write_docs:
        replace_section(SECTION, report)


if __name__ == "__main__":
    main()
