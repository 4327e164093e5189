"""Why the visual-clue check shows no gap: three measurements on a finished embedded-world run.

A diagnostic: run to settle one question, not a benchmark that is re-run. Backs docs/benchmarks.md "Visual
grounding (why the visual-clue check shows no gap)" and, with --probes-only, "Colour in the RoI features (the
detector's attribute head)", which docs/detector-attributes.md "Measured" cites.

Pre-training writes `results/pretrain/{setting}/visual_clue.json` (MLM accuracy on held-out caption words with
the image and with it blanked). In the embedded world the two are equal. This script separates the possible
causes, on the outputs of a run (default: this checkout's `results/`):

1. **What the RoI features encode.** The frozen visual network (the detector's backbone and box head, as in
   settings a-d) computes the features of box 0 (the whole image) and of the detected boxes of CC images. A
   logistic-regression probe per word predicts whether the caption names that colour or shape, from box 0 or
   from the mean of the object boxes; held-out accuracy against the majority-class rate.
2. **What a pre-trained model does with them.** For each setting's `checkpoint.pt`: MLM accuracy per word kind
   (colour, shape, size, count, other), one word masked at a time, with the image and blanked.
3. **Whether the visual path can learn at all.** Setting a's model trained from BERT for --steps steps on the
   pre-training stream, but with every shape word of each caption masked and only those as targets: a
   diagnostic objective, not the paper's. Then shape-word accuracy on the held-out captions, image vs blanked.

Reproduce: uv run python benchmarks/diagnostics/visual_grounding.py --run . --write-docs
(about 5 minutes on 2 CPU cores; needs a completed `snakemake ... results/tables/table4_ablation.csv`).

`--probes-only` runs measurement 1 alone, which needs only the detector and the CC RoIs
(`snakemake --cores all results/rois/cc/train-00000.parquet results/rois/cc/train-00001.parquet`), and
with --write-docs replaces its own section (the probes of the detector with the attribute head).
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/, for docs_section
from docs_section import replace_section  # noqa: E402

import numpy as np
import torch
import yaml
from torchvision.ops import roi_align

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from vlbert_core.detector import load_detector  # noqa: E402
from vlbert_core.detector.resnet_c4 import FEATURE_STRIDE, ROI_ALIGNED  # noqa: E402
from vlbert_core.models.common.batch import collate_samples  # noqa: E402
from vlbert_core.models.common.bert_init import load_tokenizer  # noqa: E402
from vlbert_core.models.common.config import visual_pixel_format  # noqa: E402
from vlbert_core.models.common.inputs import build_input_sequence  # noqa: E402
from vlbert_core.models.registry import family  # noqa: E402
from vlbert_core.optim import OptimizerSettings, build_optimizer  # noqa: E402
from vlbert_core.pretrain.data import StreamConfig, pair_shards_with_rois, read_held_out_captions  # noqa: E402
from vlbert_core.pretrain.loop import build_batches, measure_appearance_statistics  # noqa: E402
from vlbert_core.pretrain.masking import word_groups  # noqa: E402
from vlbert_core.pretrain.settings import get_setting  # noqa: E402
from vlbert_core.safe_pickle import load_torch_file  # noqa: E402
from vlbert_core.tasks.samples import ImageLoader, image_and_boxes  # noqa: E402
from vlbert_core.utils import setup_compute  # noqa: E402

VLBERT = family("vlbert")
VLBertModel, VLBertForPretraining = VLBERT.load("model_class"), VLBERT.load("pretraining_module")
build_vlbert_config = VLBERT.load("config_builder")
from vlbert_core.world.vocabulary import CATEGORIES, COLOUR_NAMES, SIZE_NAMES  # noqa: E402

SECTION = "## Visual grounding (why the visual-clue check shows no gap)"
PROBES_SECTION = "## Colour in the RoI features (the detector's attribute head)"
SHAPES = tuple(c.name for c in CATEGORIES)
SHAPE_WORDS = frozenset(SHAPES) | frozenset(c.plural for c in CATEGORIES)
SIZES = frozenset(SIZE_NAMES)
COUNTS = frozenset({"two", "three", "four", "five", "six"})
PROBE_SAMPLES_PER_SHARD = 300
PROBE_TRAIN_FRACTION = 0.7
BOX_PROBE_IMAGES = 400  # detector images whose annotated objects the per-box probe reads


def word_kind(word: str) -> str:
    if word in COLOUR_NAMES:
        return "colour"
    if word in SHAPE_WORDS:
        return "shape"
    return "size" if word in SIZES else "count" if word in COUNTS else "other"


class Run:
    """The inputs of one finished run: config, detector, CC shards and RoIs, tokenizer."""

    def __init__(self, root: Path):
        self.root = root
        self.config = yaml.safe_load((root / "config" / "config.yaml").read_text())
        self.shards = sorted(glob.glob(str(root / "results/shards/cc/train-*.tar")))
        self.rois = sorted(glob.glob(str(root / "results/rois/cc/train-*.parquet")))
        if not self.shards or len(self.shards) != len(self.rois):
            raise FileNotFoundError(f"{root}/results: need the CC train shards and their RoI parquets "
                                    f"(found {len(self.shards)} tars, {len(self.rois)} parquets); run the workflow first")
        detector, self.detector_meta = load_detector(str(root / "results/detector/model.pt"))
        self.detector_state = detector.state_dict()
        model_cfg, pretrain_cfg = self.config["model"], self.config["pretrain"]
        self.vlbert_config = build_vlbert_config(dict(model_cfg), self.detector_meta, tune_frcnn=False)
        self.tokenizer = load_tokenizer(self.vlbert_config.bert_path)
        self.stream_cfg = StreamConfig(max_caption_len=int(pretrain_cfg["max_caption_len"]),
                                       max_text_len=int(pretrain_cfg["max_text_len"]),
                                       max_rois=int(model_cfg["max_rois"]), image_max_side=int(model_cfg["image_max_side"]),
                                       seed=int(self.config["seed"]),
                                       held_out_per_shard=int(pretrain_cfg["held_out_per_shard"]))

    def captions(self, per_shard: int) -> list[dict]:
        return read_held_out_captions(pair_shards_with_rois(self.shards, self.rois), per_shard, self.stream_cfg)

    def fresh_model(self) -> VLBertModel:
        """The model pre-training starts from (appearance statistics measured as the loop does)."""
        model = VLBertModel.from_bert(self.vlbert_config, self.detector_state)
        if self.vlbert_config.standardise_appearance:
            measure_appearance_statistics(model, self.shards, self.rois, self.tokenizer, self.stream_cfg,
                                          torch.device("cpu"))
        return model

    def sequence(self, ids: list[int], num_boxes: int):
        tok = self.tokenizer
        return build_input_sequence(ids, None, num_boxes, cls_id=tok.cls_token_id, sep_id=tok.sep_token_id,
                                    pad_id=tok.pad_token_id)


# -- 1. linear probes ------------------------------------------------------------------------------------------


@torch.no_grad()
def probe_features(run: Run, samples: list[dict]) -> tuple[torch.Tensor, torch.Tensor]:
    """(box 0 features, mean of the object boxes' features), each [N, appearance_dim]."""
    model = run.fresh_model().eval()
    whole, objects = [], []
    for start in range(0, len(samples), 32):
        chunk = samples[start:start + 32]
        batch = collate_samples([{"sequence": run.sequence([run.tokenizer.mask_token_id], len(s["boxes"])),
                                  "image": s["image"], "boxes": s["boxes"]} for s in chunk])
        features = model.visual_features(batch)                                          # [B, R, D]
        valid = batch.box_valid[:, 1:, None].float()
        whole.append(features[:, 0])
        objects.append((features[:, 1:] * valid).sum(1) / valid.sum(1).clamp(min=1.0))
    return torch.cat(whole), torch.cat(objects)


def standardised_split(features: torch.Tensor, n: int) -> tuple[torch.Tensor, int]:
    """The probes' inputs z-scored with the fitting part's statistics, and where that part ends (seeds the
    probe's initialisation)."""
    torch.manual_seed(0)
    cut = int(n * PROBE_TRAIN_FRACTION)
    mean, std = features[:cut].mean(0), features[:cut].std(0) + 1e-6
    return (features - mean) / std, cut


def probe_accuracy(features: torch.Tensor, labels: torch.Tensor, steps: int = 300) -> tuple[float, float]:
    """Held-out accuracy of a logistic regression, and the majority-class rate on the same held-out part."""
    z, cut = standardised_split(features, len(labels))
    linear = torch.nn.Linear(z.shape[1], 1)
    optimizer = torch.optim.Adam(linear.parameters(), lr=1e-2, weight_decay=1e-3)
    for _ in range(steps):
        optimizer.zero_grad()
        loss = torch.nn.functional.binary_cross_entropy_with_logits(linear(z[:cut]).squeeze(-1), labels[:cut])
        loss.backward()
        optimizer.step()
    with torch.no_grad():
        predicted = (linear(z[cut:]).squeeze(-1) > 0).float()
    held = labels[cut:]
    return float((predicted == held).float().mean()), float(max(held.mean(), 1 - held.mean()))


def run_probes(run: Run) -> dict:
    samples = run.captions(PROBE_SAMPLES_PER_SHARD)
    whole, objects = probe_features(run, samples)
    rows = {}
    for word in (*COLOUR_NAMES, *SHAPES):
        plural = next((c.plural for c in CATEGORIES if c.name == word), word)
        labels = torch.tensor([1.0 if re.search(rf"\b({word}|{plural})\b", s["caption"]) else 0.0 for s in samples])
        rows[word] = {"box0": probe_accuracy(whole, labels), "objects": probe_accuracy(objects, labels)}
    return {"samples": len(samples), "rows": rows}


def box_probe_accuracy(features: torch.Tensor, labels: torch.Tensor, steps: int = 300) -> tuple[float, float]:
    """Held-out accuracy of a softmax regression over the classes in `labels`, and the majority rate."""
    z, cut = standardised_split(features, len(labels))
    linear = torch.nn.Linear(z.shape[1], int(labels.max()) + 1)
    optimizer = torch.optim.Adam(linear.parameters(), lr=1e-2, weight_decay=1e-3)
    with torch.enable_grad():  # the features come from a no_grad pass
        for _ in range(steps):
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(linear(z[:cut]), labels[:cut]).backward()
            optimizer.step()
    with torch.no_grad():
        predicted = linear(z[cut:]).argmax(-1)
    held = labels[cut:]
    return float((predicted == held).float().mean()), float(torch.bincount(held).max() / len(held))


@torch.no_grad()
def box_features_by_layer(model: VLBertModel, image: torch.Tensor, boxes: torch.Tensor) -> dict[str, torch.Tensor]:
    """Each box's features at three depths of the frozen visual network: the mean of its pixels (the
    input), RoIAlign on the stride-16 feature map averaged over the box (the backbone's output), and
    the box head's feature (what VL-BERT reads)."""
    network = model.visual_network
    rois = torch.cat([torch.zeros(len(boxes), 1), boxes], dim=1)
    feature_map = network.body(image[None])
    pooled = roi_align(feature_map, rois, output_size=network.roi_align_size, spatial_scale=1.0 / FEATURE_STRIDE,
                       sampling_ratio=network.roi_sampling_ratio, aligned=ROI_ALIGNED)
    return {"pixels": roi_align(image[None], rois, output_size=4, spatial_scale=1.0, aligned=ROI_ALIGNED).mean((2, 3)),
            "backbone": pooled.mean((2, 3)), "box head": network.head(pooled)}


def run_box_probes(run: Run, max_images: int = BOX_PROBE_IMAGES) -> dict:
    """Per annotated object of the detector's val (then train) images: its colour, size and class
    from its ground-truth box's features at each depth of the frozen visual network."""
    model = run.fresh_model().eval()
    images = ImageLoader.from_settings(run.config["model"], visual_pixel_format(run.vlbert_config))
    sources = run.config["sources"]["detector"]
    colour_of = {c: i for i, c in enumerate(COLOUR_NAMES)}
    size_of = {s: i for i, s in enumerate(SIZE_NAMES)}
    features: dict[str, list[torch.Tensor]] = collections.defaultdict(list)
    labels: dict[str, list[int]] = collections.defaultdict(list)
    used = 0
    for split in ("val", "train"):
        coco = json.loads((run.root / sources["annotations"].format(split=split)).read_text())
        by_image = collections.defaultdict(list)
        for ann in coco["annotations"]:
            by_image[ann["image_id"]].append(ann)
        for img in coco["images"]:
            anns = [a for a in by_image[img["id"]] if any(x in colour_of for x in a.get("attributes", []))]
            if not anns or used >= max_images:
                continue
            used += 1
            xywh = np.array([a["bbox"] for a in anns], dtype=np.float32)
            image, boxes = image_and_boxes(images, run.root / sources["images"] / img["file_name"],
                                           np.concatenate([xywh[:, :2], xywh[:, :2] + xywh[:, 2:]], axis=1),
                                           len(anns) + 1, None, "probe")
            for depth, value in box_features_by_layer(model, image, boxes[1:len(anns) + 1]).items():
                features[depth].append(value)
            for a in anns:
                labels["colour"].append(next(colour_of[x] for x in a["attributes"] if x in colour_of))
                labels["size"].append(next((size_of[x] for x in a["attributes"] if x in size_of), len(SIZE_NAMES)))
                labels["class"].append(int(a["category_id"]))
    classes = sorted(set(labels["class"]))
    labels["class"] = [classes.index(c) for c in labels["class"]]
    rows = {name: {depth: box_probe_accuracy(torch.cat(feats), torch.tensor(values)) for depth, feats in features.items()}
            for name, values in labels.items()}
    return {"images": used, "boxes": len(labels["colour"]), "rows": rows}


def box_probe_table(box_probes: dict) -> list[str]:
    depths = list(next(iter(box_probes["rows"].values())))
    lines = [f"Per object ({box_probes['boxes']} annotated objects of {box_probes['images']} detector images, "
             f"{PROBE_TRAIN_FRACTION:.0%} to fit, the rest to test): the object's attribute or class from its "
             "ground-truth box, at three depths of the frozen visual network: the mean of the box's pixels, the "
             "backbone's stride-16 map averaged over the box, and the box head's feature (what VL-BERT reads). "
             "Held-out accuracy of a softmax regression / majority-class rate.", "",
             "| label | " + " | ".join(depths) + " |", "|---|" + "---|" * len(depths)]
    for name, row in box_probes["rows"].items():
        lines.append(f"| {name} | " + " | ".join(f"{acc:.2f} / {major:.2f}" for acc, major in row.values()) + " |")
    return lines


# -- 2. per-word-kind accuracy of the pre-trained settings --------------------------------------------------------


@torch.no_grad()
def word_kind_accuracy(run: Run, module: VLBertForPretraining, held_out: list[dict]) -> dict:
    """{kind: [correct with image, correct blanked, words]}: each word masked alone (all its WordPieces)."""
    tok = run.tokenizer
    counts: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0, 0])
    for caption in held_out:
        ids = tok(caption["caption"], add_special_tokens=False)["input_ids"][: run.stream_cfg.max_caption_len - 2]
        tokens = tok.convert_ids_to_tokens(ids)
        groups = word_groups(tokens)
        kinds = [word_kind(tok.convert_tokens_to_string([tokens[i] for i in g])) for g in groups]
        for column, image in enumerate((caption["image"], torch.zeros_like(caption["image"]))):
            samples = []
            for group in groups:
                masked = [tok.mask_token_id if i in group else t for i, t in enumerate(ids)]
                samples.append({"sequence": run.sequence(masked, len(caption["boxes"])), "image": image,
                                "boxes": caption["boxes"]})
            hidden = module.model(collate_samples(samples)).sequence_output
            for row, (group, kind) in enumerate(zip(groups, kinds)):
                predicted = module.heads.mlm(hidden[row, [1 + i for i in group]]).argmax(-1)
                counts[kind][column] += int(predicted.tolist() == [ids[i] for i in group])
                counts[kind][2] += column == 0
    return dict(counts)


def load_pretrained(run: Run, setting: str) -> VLBertForPretraining | None:
    path = run.root / "results" / "pretrain" / setting / "checkpoint.pt"
    if not path.is_file():
        return None
    checkpoint = load_torch_file(path, "a pre-training checkpoint")
    spec = get_setting(setting)
    config = build_vlbert_config(dict(run.config["model"]), run.detector_meta, tune_frcnn=spec.tune_frcnn)
    module = VLBertForPretraining(VLBertModel(config), spec)
    module.model.load_state_dict(checkpoint["model"])
    module.heads.load_state_dict(checkpoint["heads"])
    return module.eval()


# -- 3. the shape-word-only diagnostic objective ----------------------------------------------------------------


def shape_token_ids(run: Run) -> torch.Tensor:
    ids = [run.tokenizer.convert_tokens_to_ids(w) for w in sorted(SHAPE_WORDS)]
    return torch.tensor([i for i in ids if i != run.tokenizer.unk_token_id])


def train_on_shape_words(run: Run, steps: int, peak_lr: float) -> VLBertForPretraining:
    """Setting a's model, trained with every shape word of each caption masked and only those as targets."""
    torch.manual_seed(int(run.config["seed"]))
    spec = get_setting("a")
    module = VLBertForPretraining(run.fresh_model(), spec)
    pretrain_cfg = {k: v for k, v in run.config["pretrain"].items() if k not in ("settings", "launch")}
    batches = build_batches(spec, run.shards, run.rois, [], run.tokenizer, run.vlbert_config.num_object_classes,
                            run.stream_cfg, pretrain_cfg, 0, 1)
    optimizer = build_optimizer(module, OptimizerSettings("adamw", lr=peak_lr,
                                                          weight_decay=float(pretrain_cfg["weight_decay"])))
    shapes = shape_token_ids(run)
    module.train()
    for _ in range(steps):
        batch = next(batches)
        inputs = batch.inputs
        words = torch.where(batch.mlm_labels != -100, batch.mlm_labels, inputs.input_ids)   # undo the MLM masking
        target = torch.isin(words, shapes) & (inputs.element_kind == 0)
        inputs.input_ids = torch.where(target, run.tokenizer.mask_token_id, words)
        batch.mlm_labels = torch.where(target, words, torch.full_like(words, -100))
        loss = module(batch)["loss"]
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(module.parameters(), float(pretrain_cfg["clip_grad"]))
        optimizer.step()
    return module.eval()


@torch.no_grad()
def shape_word_accuracy(run: Run, module: VLBertForPretraining, held_out: list[dict]) -> tuple[int, int, int]:
    """(correct with image, correct blanked, shape words), every shape word of a caption masked together."""
    shapes = set(shape_token_ids(run).tolist())
    correct = [0, 0]
    total = 0
    for caption in held_out:
        ids = run.tokenizer(caption["caption"], add_special_tokens=False)["input_ids"][: run.stream_cfg.max_caption_len - 2]
        positions = [i for i, t in enumerate(ids) if t in shapes]
        if not positions:
            continue
        masked = [run.tokenizer.mask_token_id if i in positions else t for i, t in enumerate(ids)]
        total += len(positions)
        for column, image in enumerate((caption["image"], torch.zeros_like(caption["image"]))):
            batch = collate_samples([{"sequence": run.sequence(masked, len(caption["boxes"])), "image": image,
                                      "boxes": caption["boxes"]}])
            hidden = module.model(batch).sequence_output[0, [1 + i for i in positions]]
            predicted = module.heads.mlm(hidden).argmax(-1).tolist()
            correct[column] += sum(p == ids[i] for p, i in zip(predicted, positions))
    return correct[0], correct[1], total


# -- report -----------------------------------------------------------------------------------------------------


def probe_table(probes: dict) -> list[str]:
    """The probes' Markdown table: held-out accuracy / majority-class rate per word."""
    lines = ["| word | from box 0 (whole image) | from the mean of the object boxes |", "|---|---|---|"]
    for word, row in probes["rows"].items():
        lines.append(f"| {word} | {row['box0'][0]:.2f} / {row['box0'][1]:.2f} | "
                     f"{row['objects'][0]:.2f} / {row['objects'][1]:.2f} |")
    return lines


def report(run: Run, probes: dict, kinds: dict, diagnostic: dict, args: argparse.Namespace, seconds: float) -> str:
    lines = [
        f"Measured {time.strftime('%Y-%m-%d')} with `uv run python benchmarks/diagnostics/visual_grounding.py --run {args.run} "
        f"--steps {args.steps}{' --write-docs' if args.write_docs else ''}` on the run's own outputs "
        f"({seconds / 60:.1f} min). Held-out captions: the first {run.stream_cfg.held_out_per_shard} of each CC "
        "shard, never pre-trained on.",
        "",
        f"**1. Linear probes on the frozen RoI features** ({probes['samples']} CC images, "
        f"{PROBE_TRAIN_FRACTION:.0%} to fit, the rest to test): does the caption name this word? Held-out accuracy "
        "of a logistic regression / majority-class rate.",
        "",
    ]
    lines += probe_table(probes)
    lines += ["", "**2. Pre-trained settings, MLM accuracy by word kind** (each word masked alone; with image / "
              "blanked; words):", "", "| setting | " + " | ".join(sorted(next(iter(kinds.values())))) + " |",
              "|---|" + "---|" * len(next(iter(kinds.values())))]
    for setting, counts in kinds.items():
        cells = [f"{c[0] / c[2]:.3f} / {c[1] / c[2]:.3f} ({c[2]})" for _, c in sorted(counts.items())]
        lines.append(f"| {setting} | " + " | ".join(cells) + " |")
    with_image, blanked, words = diagnostic["result"]
    lines += [
        "",
        f"**3. Diagnostic objective** (setting a's model from BERT, {args.steps} steps of "
        f"{run.config['pretrain']['cc_batch_size']} captions, peak lr {args.lr:g}, every shape word masked and "
        f"the only target): held-out shape-word accuracy {with_image}/{words} = {with_image / words:.3f} with the "
        f"image, {blanked}/{words} = {blanked / words:.3f} blanked (chance 1/{len(SHAPES)}).",
    ]
    return "\n".join(lines) + "\n"


def probes_report(run: Run, probes: dict, box_probes: dict, args: argparse.Namespace, seconds: float) -> str:
    metrics_path = run.root / "results" / "detector" / "metrics.json"
    metrics = yaml.safe_load(metrics_path.read_text()) if metrics_path.is_file() else {}
    # The checkpoint's own config: the detector measured may come from an override of the checkout's config.
    weight = run.detector_meta["config"].get("attribute_loss_weight", 0)
    lines = [
        f"Measured {time.strftime('%Y-%m-%d')} with `uv run python benchmarks/diagnostics/visual_grounding.py --run {args.run} "
        f"--probes-only{' --write-docs' if args.write_docs else ''}` ({seconds / 60:.1f} min), on a run's detector "
        f"(`detector.attribute_loss_weight: {weight}`; val AP@0.5 {metrics.get('ap50')}, attribute recall "
        f"{metrics.get('attribute_recall')}, {metrics.get('steps')} steps, {metrics.get('train_seconds')} s of "
        "training) and its CC RoIs. "
        f"Linear probes on the frozen RoI features ({probes['samples']} CC images, {PROBE_TRAIN_FRACTION:.0%} to "
        "fit, the rest to test): does the caption name this word? Held-out accuracy of a logistic regression / "
        "majority-class rate.",
        "",
    ]
    lines += probe_table(probes)
    colours = [probes["rows"][w] for w in COLOUR_NAMES]
    mean = {k: (sum(r[k][0] for r in colours) / len(colours), sum(r[k][1] for r in colours) / len(colours))
            for k in ("box0", "objects")}
    lines += ["", f"Colour words, mean: box 0 {mean['box0'][0]:.2f} / {mean['box0'][1]:.2f}, object boxes "
              f"{mean['objects'][0]:.2f} / {mean['objects'][1]:.2f}.", ""]
    lines += box_probe_table(box_probes)
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", type=Path, default=Path("."), help="a checkout with a finished run's results/")
    parser.add_argument("--settings", nargs="+", default=["a", "b", "c", "d", "full"])
    parser.add_argument("--steps", type=int, default=300, help="steps of the diagnostic objective")
    parser.add_argument("--lr", type=float, default=4e-4, help="its learning rate (constant)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--probes-only", action="store_true",
                        help=f"measurement 1 only (no pre-trained checkpoints needed), docs section '{PROBES_SECTION}'")
    parser.add_argument("--write-docs", action="store_true", help=f"replace '{SECTION}' in docs/benchmarks.md")
    args = parser.parse_args(argv)
    setup_compute(args.threads)
    started = time.time()
    run = Run(args.run.resolve())
    if args.probes_only:
        body = probes_report(run, run_probes(run), run_box_probes(run), args, time.time() - started)
        print(body)
        if args.write_docs:
            replace_section(PROBES_SECTION, body)
        return 0
    held_out = run.captions(run.stream_cfg.held_out_per_shard)
    probes = run_probes(run)
    kinds = {}
    for setting in args.settings:
        module = load_pretrained(run, setting)
        if module is None:
            print(f"skipping setting {setting}: no {run.root}/results/pretrain/{setting}/checkpoint.pt", file=sys.stderr)
            continue
        kinds[setting] = word_kind_accuracy(run, module, held_out)
    if not kinds:
        raise FileNotFoundError(f"{run.root}/results/pretrain: no checkpoint.pt of settings {args.settings}")
    diagnostic = {"result": shape_word_accuracy(run, train_on_shape_words(run, args.steps, args.lr), held_out)}
    body = report(run, probes, kinds, diagnostic, args, time.time() - started)
    print(body)
    if args.write_docs:
        replace_section(SECTION, body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
