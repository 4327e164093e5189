"""The authors' VL-BERT checkpoints -> this project's model directories.

Inputs (jackroos/VL-BERT, torch.save({'state_dict': <DataParallel state dict, 'module.' keys>, ...})):
- pre-trained `vl-bert-{base,large}-{e2e,prec}.model` -> a VLBertModel directory (model.safetensors +
  config.json, as pre-training writes it; `pretrain.init_from` and fine-tuning read it);
- fine-tuned checkpoints of a registered task that knows its released head (VQA, RefCOCO+, VCR:
  convert/released_heads.py) -> a fine-tuned model directory (as tasks.finetune's `save_finetuned`
  writes it), with the task head in the released layout (`task_heads: released`).
Every source tensor is mapped or dropped with a reason (conversion_report.json beside the weights);
tensors the source registers twice are checked to be equal. The "prec" checkpoints and the VQA one hold no
visual network (their RoI features were precomputed): its weights then come from `visual_weights`, the
ResNet-101 file those features' detector backbone came from (resnet101-pt-vgbua-0000.model), with that
detector's Caffe stem pooling.
"""

from __future__ import annotations

import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from vlbert_core.models.common.encoder import BERT_LAYER_TENSORS
from vlbert_core.models.common.heads import save_pretraining_heads
from vlbert_core.models.vlbert.config import VLBertConfig
from vlbert_core.models.vlbert.heads import PretrainingHeads
from vlbert_core.models.vlbert.model import VLBertModel
from vlbert_core.tasks.registry import get_task

from ..accounting import (REPORT_FILE, ConversionError, ConversionReport, Drop, Rule, check_aliases, convert_state_dict,
                          strip_module_prefix)
from ..manifest import read_published
from ..released_heads import RELEASED_HEADS, ReleasedHead, vocabulary_option
from ..resnet import BN_COUNTER, convert_resnet_state, resnet_layout

CHECKPOINT_WRAP = ("state_dict",)
# Top-level entries of the authors' checkpoints besides 'state_dict' (common/callbacks/epoch_end_callbacks/
# checkpoint.py): training state, not model weights.
OUTSIDE_REASONS = {"optimizer": "optimizer state: resumes the authors' training, not part of the model",
                   "validation_monitor": "the authors' best-validation bookkeeping",
                   "epoch": "training bookkeeping"}
OUTSIDE_OTHER = "not model weights: only 'state_dict' holds the model's tensors"

# The released VLBERT config (cfgs/*/base_*.yaml, large_*.yaml): what the checkpoint's shapes do not say.
BERT_HEAD_DIM = 64                  # BERT-BASE 768 / 12 heads, BERT-LARGE 1024 / 16 heads
RELEASED_BERT = {"hidden_act": "gelu", "hidden_dropout_prob": 0.1, "attention_probs_dropout_prob": 0.1,
                 "layer_norm_eps": 1e-12}
RELEASED_OPTIONS = {"geometry_encoding": "centre_size", "end_visual_term": False, "text_only_visual_norm": True,
                    "text_only_layout": "released",
                    "roi_sampling_ratio": 1, "roi_cls_layer_norm": False, "task_heads": "released",
                    "roi_align_size": 14, "frozen_stages": 2, "freeze_bn": True, "standardise_appearance": False}
VISUAL_REGION_CLASSES_KEY = "vlbert.mvrc_head.region_cls_pred.weight"
GEOMETRY_DIM = 2048                 # common/fast_rcnn.py: coordinate_embeddings(..., 256) -> 4 x 2 x 256


@dataclass(frozen=True)
class SourceLayout:
    """What a checkpoint is, read off its keys (after the 'module.' prefix is taken off)."""
    kind: str                 # "pretrained", or the dataset of the fine-tuned checkpoint's task ("vqa", "vcr")
    vlbert_prefix: str        # "vlbert." or, inside VCR's TimeDistributed, "vlbert._module."
    end_to_end: bool          # holds the visual network (e2e) or not (precomputed features)
    tasks: tuple[str, ...] = ()  # the registered tasks whose released head the checkpoint holds


def detect_layout(keys: list[str], source_name: str) -> SourceLayout:
    keyset = set(keys)
    prefix = "vlbert._module." if any(k.startswith("vlbert._module.") for k in keys) else "vlbert."
    if f"{prefix}word_embeddings.weight" not in keyset:
        raise ConversionError(f"{source_name}: no '{prefix}word_embeddings.weight': not a VL-BERT checkpoint "
                              f"(first keys: {sorted(keys)[:5]})")
    end_to_end = "image_feature_extractor.backbone.conv1.weight" in keyset
    if "vlbert.mlm_head.predictions.bias" in keyset:
        return SourceLayout(kind="pretrained", vlbert_prefix=prefix, end_to_end=end_to_end)
    body = SourceLayout(kind="", vlbert_prefix=prefix, end_to_end=end_to_end)
    rules, drops, _ = body_rules(body, "vlbert.")
    body_patterns = [re.compile(r.pattern) for r in [*rules, *drops]]
    head_keys = sorted(k for k in keys if not any(p.fullmatch(k) for p in body_patterns))
    tasks = [name for name, head in RELEASED_HEADS.items() if _holds_released_head(head, head_keys, prefix)]
    if not tasks:
        raise ConversionError(f"{source_name}: neither pre-training heads (vlbert.mlm_head.*) nor the released "
                              f"head of a task ({list(RELEASED_HEADS)}) found; the tensors outside VL-BERT's body "
                              f"are {head_keys[:8]}")
    datasets = sorted({get_task(name).dataset for name in tasks})
    if len(datasets) > 1:
        raise ConversionError(f"{source_name}: the head fits the released heads of tasks {tasks} of several "
                              f"datasets {datasets}")
    return SourceLayout(kind=datasets[0], vlbert_prefix=prefix, end_to_end=end_to_end, tasks=tuple(tasks))


def _holds_released_head(head: ReleasedHead, head_keys: list[str], vlbert_prefix: str) -> bool:
    """The head's rules each match a key, and together cover every key outside the body."""
    patterns = [re.compile(pattern) for pattern, _ in head.rules(re.escape(vlbert_prefix))]
    return bool(patterns) and all(any(p.fullmatch(k) for k in head_keys) for p in patterns) and \
        all(any(p.fullmatch(k) for p in patterns) for k in head_keys)


def _first_row(t: torch.Tensor) -> torch.Tensor:
    """nn.Embedding(1, H).weight -> the [H] vector our model keeps as a parameter."""
    return t[0]


def body_rules(layout: SourceLayout, target_prefix: str) -> tuple[list[Rule], list[Drop], list[tuple[str, str]]]:
    """Rules for everything but the task head: visual network, embeddings, encoder. Also the aliases:
    (regex of a key registered twice, template of the name it is checked equal to)."""
    v = re.escape(layout.vlbert_prefix)
    t = target_prefix
    fe = r"image_feature_extractor\."
    rules = [
        Rule(fe + r"backbone\.(conv1|bn1|layer[1-3])\.(.+)", t + r"visual_network.body.\1.\2"),
        Rule(fe + r"roi_head_feature_extractor\.(.+)", t + r"visual_network.head.layer4.\1"),
        Rule(fe + r"obj_downsample\.1\.(weight|bias)", t + r"embeddings.visual_feature.linear.\1"),
        Rule(r"object_linguistic_embeddings\.weight", t + "embeddings.img_token", _first_row),
        Rule(r"object_mask_word_embedding\.weight", t + "embeddings.masked_roi_token", _first_row),
        Rule(r"aux_text_visual_embedding\.weight", t + "embeddings.text_only_visual", _first_row),
        # 'prec' models: a masked RoI's precomputed feature is replaced by this vector (masked_roi_input: feature)
        Rule(r"object_mask_visual_embedding\.weight", t + "embeddings.visual_feature.masked_appearance", _first_row),
        Rule(v + r"word_embeddings\.weight", t + "embeddings.word_embeddings.weight"),
        Rule(v + r"end_embedding\.weight", t + "embeddings.end_token", _first_row),
        Rule(v + r"position_embeddings\.weight", t + "embeddings.position_embeddings.weight"),
        Rule(v + r"token_type_embeddings\.weight", t + "embeddings.segment_embeddings.weight"),
        Rule(v + r"embedding_LayerNorm\.(weight|bias)", t + r"embeddings.layer_norm.\1"),
        Rule(v + r"visual_ln_text\.(weight|bias)", t + r"embeddings.visual_norm_text.\1"),
        Rule(v + r"visual_ln_object\.(weight|bias)", t + r"embeddings.visual_norm_object.\1"),
    ]
    layer = v + r"encoder\.layer\.(\d+)\."
    for src, dst in BERT_LAYER_TENSORS:
        rules.append(Rule(layer + re.escape(src) + r"\.(weight|bias)", t + r"encoder.layers.\1." + dst + r".\2"))
    drops = [
        Drop(fe + r"head\.0\..+", "the same stage-5 module registered a second time (released FastRCNN.head = "
                                  "Sequential(roi_head_feature_extractor, AvgPool2d, Flattener)); checked equal to "
                                  "roi_head_feature_extractor.*"),
        Drop(v + r"mlm_head\.predictions\.decoder\.weight",
             "the MLM decoder is tied to the word embeddings; checked equal to vlbert.word_embeddings.weight"),
    ]
    aliases = [(fe + r"head\.0\.(.+)", r"image_feature_extractor.roi_head_feature_extractor.\1"),
               (v + r"mlm_head\.predictions\.decoder\.weight", layout.vlbert_prefix + "word_embeddings.weight")]
    return rules, drops, aliases


# The pre-training heads of a pre-trained checkpoint -> PretrainingHeads' keys (models/vlbert/heads.py), kept in the
# model directory's heads.safetensors: continued pre-training starts from them, and the MLM accuracy of the
# released model is measured with them.
HEADS_PREFIX = "heads."


def pretraining_head_rules(layout: SourceLayout, relationship: bool) -> tuple[list[Rule], list[Drop]]:
    """Rules for the pre-training heads; `relationship`: the checkpoint has the relationship head (which
    reads the pooler; without it a pooler is dropped)."""
    v = re.escape(layout.vlbert_prefix)
    h = HEADS_PREFIX
    rules = [
        Rule(v + r"mlm_head\.predictions\.transform\.dense\.(weight|bias)", h + r"mlm.transform.dense.\1"),
        Rule(v + r"mlm_head\.predictions\.transform\.LayerNorm\.(weight|bias)", h + r"mlm.transform.layer_norm.\1"),
        Rule(v + r"mlm_head\.predictions\.bias", h + "mlm.bias"),
        Rule(v + r"mvrc_head\.transform\.dense\.(weight|bias)", h + r"roi_cls.transform.dense.\1"),
        Rule(v + r"mvrc_head\.region_cls_pred\.(weight|bias)", h + r"roi_cls.classifier.\1"),
    ]
    if not relationship:
        return rules, [Drop(v + r"pooler\..+", "a pooler without the relationship head that reads it: nothing uses it")]
    # sentence-image relationship (WITH_REL_LOSS): a linear layer on the pooler (dense + tanh on [CLS])
    return rules + [
        Rule(v + r"relationsip_head\.caption_image_relationship\.(weight|bias)", h + r"relationship.classifier.\1"),
        Rule(v + r"pooler\.dense\.(weight|bias)", h + r"relationship.pooler.\1")], []


def head_rules(layout: SourceLayout, task: str) -> list[Rule]:
    """The head of a fine-tuned checkpoint -> FinetuneModel's `head.*` / `roi_classifier.*` (released layout),
    as convert/released_heads.py says."""
    return [Rule(pattern, target) for pattern, target in
            RELEASED_HEADS[task].rules(re.escape(layout.vlbert_prefix))]


def build_config(source: dict[str, torch.Tensor], layout: SourceLayout, visual_backbone: dict, bert_path: str,
                 source_name: str) -> VLBertConfig:
    """Our VLBertConfig of the released model, from the checkpoint's shapes and the released config.

    A checkpoint holding `object_mask_visual_embedding` was pre-trained on precomputed features, a masked RoI's
    feature replaced by that vector ("prec"): masked_roi_input "feature". The e2e ones zero the RoI's pixels."""
    v = layout.vlbert_prefix

    def shape_of(key: str) -> tuple[int, ...]:
        if key not in source:
            raise ConversionError(f"{source_name}: {key!r} is missing; the model's sizes are read from it")
        return tuple(source[key].shape)

    vocab, hidden = shape_of(f"{v}word_embeddings.weight")
    layers = {int(m.group(1)) for k in source if (m := re.match(rf"{re.escape(v)}encoder\.layer\.(\d+)\.", k))}
    if not layers or layers != set(range(max(layers) + 1)):
        raise ConversionError(f"{source_name}: encoder layers are not numbered 0..n-1: {sorted(layers)}")
    intermediate = shape_of(f"{v}encoder.layer.0.intermediate.dense.weight")[0]
    positions = shape_of(f"{v}position_embeddings.weight")[0]
    region_classes = source.get(VISUAL_REGION_CLASSES_KEY)
    if bert_path:
        from vlbert_core.models.common.bert_init import read_bert_config

        bert_vocab = read_bert_config(bert_path)["vocab_size"]
        if bert_vocab != vocab:
            raise ConversionError(f"bert_path {bert_path!r} has vocab_size {bert_vocab}, the checkpoint's word "
                                  f"embeddings {vocab} rows: its tokenizer would index another table")
    return VLBertConfig(
        vocab_size=int(vocab), hidden_size=int(hidden), num_hidden_layers=len(layers),
        num_attention_heads=max(1, int(hidden) // BERT_HEAD_DIM), intermediate_size=int(intermediate),
        max_position_embeddings=int(positions), **RELEASED_BERT,
        visual_backbone=visual_backbone, appearance_dim=2048, geometry_dim=GEOMETRY_DIM,
        num_object_classes=int(region_classes.shape[0]) if region_classes is not None else 1601,
        tune_frcnn=False, bert_path=bert_path,
        masked_roi_input="feature" if "object_mask_visual_embedding.weight" in source else "pixels",
        **RELEASED_OPTIONS)


def _visual_from_resnet(visual: dict[str, torch.Tensor] | None, visual_name: str,
                        source_name: str) -> tuple[dict, dict, str]:
    """(our visual_network.* tensors, backbone config, where from) for a checkpoint without a visual network."""
    if visual is None:
        raise ConversionError(f"{source_name}: the checkpoint holds no visual network (its RoI features were "
                              "precomputed); pass the ResNet-101 its detector used, resnet101-pt-vgbua-0000.model "
                              "(--visual-weights)")
    if "conv1.weight" not in visual:  # a file already converted with `resnet101-pt-vgbua` is read the same way
        raise ConversionError(f"{visual_name}: no 'conv1.weight': not a torchvision-layout ResNet state dict")
    state, _, backbone = convert_resnet_state(visual, source_name=visual_name)
    # the precomputed features came from bottom-up attention's Caffe detector: its stage 5 is dilated like
    # VL-BERT's (docs/bottom-up-detector.md), and its stem max-pools the Caffe way
    backbone = {**backbone, "stem_pool": "caffe"}
    tensors = {("visual_network.head." if k.startswith("layer4.") else "visual_network.body.") + k: v
               for k, v in state.items()}
    return tensors, backbone, f"from {visual_name} (the checkpoint's features were precomputed)"


@dataclass
class Converted:
    config: VLBertConfig
    layout: SourceLayout
    state: dict[str, torch.Tensor]      # our keys (prefixed 'encoder.' for a fine-tuned model)
    report: ConversionReport
    # a pre-trained checkpoint's pre-training heads, PretrainingHeads keys (mlm.*, roi_cls.*, relationship.*)
    heads: dict[str, torch.Tensor] = field(default_factory=dict)

    def heads_present(self) -> dict[str, bool]:
        """Which optional heads the checkpoint has: PretrainingHeads' `masked_roi_cls` and `relationship`."""
        return {"masked_roi_cls": any(k.startswith("roi_cls.") for k in self.heads),
                "relationship": any(k.startswith("relationship.") for k in self.heads)}


def convert_vlbert_state(source: dict[str, torch.Tensor], *, source_name: str, bert_path: str = "",
                         visual: dict[str, torch.Tensor] | None = None, visual_name: str = "",
                         task_meta: dict[str, Any] | None = None) -> Converted:
    """Convert a released state dict (with or without 'module.'). `visual`: the resnet101-pt-vgbua state
    dict (named `visual_name`) for checkpoints without a visual network; `task_meta`: a fine-tuned model's
    meta."""
    from vlbert_core.tasks.finetune import FinetuneModel

    source = strip_module_prefix(source)
    layout = detect_layout(list(source), source_name)
    visual_fill: dict[str, torch.Tensor] = {}
    if layout.end_to_end:
        backbone = resnet_layout([k[len("image_feature_extractor.backbone."):] for k in source
                                  if k.startswith("image_feature_extractor.backbone.")] +
                                 [k.replace("image_feature_extractor.roi_head_feature_extractor.", "layer4.")
                                  for k in source if k.startswith("image_feature_extractor.roi_head_feature_extractor.")])
        visual_reason = ""
    else:
        visual_fill, backbone, visual_reason = _visual_from_resnet(visual, visual_name, source_name)
    config = build_config(source, layout, backbone, bert_path, source_name)

    prefix = "" if layout.kind == "pretrained" else "encoder."
    rules, drops, aliases = body_rules(layout, prefix)
    task_rules: list[Rule] = []
    if layout.kind != "pretrained":
        if task_meta is None:
            raise ConversionError(f"{source_name}: a fine-tuned {layout.kind} checkpoint needs the task meta")
        if task_meta["name"] not in layout.tasks:
            raise ConversionError(f"{source_name}: the checkpoint holds the released head of {list(layout.tasks)}, "
                                  f"not of task {task_meta['name']!r}")
        task_rules = head_rules(layout, task_meta["name"])
    check_aliases(source, aliases, source_name)

    with torch.device("meta"):
        if layout.kind == "pretrained":
            target_model = VLBertModel(config)
            relationship = any(k.startswith(f"{layout.vlbert_prefix}relationsip_head.") for k in source)
            heads = PretrainingHeads(
                config, target_model.word_embeddings(),
                masked_roi_cls=any(k.startswith(f"{layout.vlbert_prefix}mvrc_head.") for k in source),
                relationship=relationship)
            head_shapes = {HEADS_PREFIX + k: tuple(v.shape) for k, v in heads.state_dict().items()}
            task_rules, head_drops = pretraining_head_rules(layout, relationship)
            drops = [*drops, *head_drops]
        else:
            target_model = FinetuneModel(task_meta["name"], VLBertModel(config), task_meta)
            head_shapes = {}
    target_shapes = {k: tuple(v.shape) for k, v in target_model.state_dict().items()}
    target_shapes.update(head_shapes)
    fill = {prefix + "embeddings.visual_feature.appearance_mean": "z-scoring off (standardise_appearance: false)",
            prefix + "embeddings.visual_feature.appearance_std": "z-scoring off (standardise_appearance: false)"}
    fill.update({prefix + k: visual_reason for k in visual_fill})
    unused = {}
    if layout.kind != "pretrained":
        # fine-tuned models never mask a RoI nor see a text-only sample; these keep zeros
        unused = {prefix + "embeddings.masked_roi_token": "pre-training only (masked RoIs); zeros, unused by the task",
                  prefix + "embeddings.text_only_visual": "pre-training only (text-only samples); zeros, unused by "
                                                          "the task"}
    fill.update(unused)
    counters = {k: "BatchNorm step counter, not in the checkpoint; kept at 0 (the BatchNorm is frozen)"
                for k in target_shapes if k.endswith(BN_COUNTER) and k not in fill}
    fill.update(counters)
    state, report = convert_state_dict(source, rules + task_rules, drops, target_shapes,
                                       source_name=source_name, fill=fill)
    for key in report.filled:
        if key in counters:
            state[key] = torch.zeros((), dtype=torch.long)
    state[prefix + "embeddings.visual_feature.appearance_mean"] = torch.zeros(config.appearance_dim)
    state[prefix + "embeddings.visual_feature.appearance_std"] = torch.ones(config.appearance_dim)
    for key in unused:
        state[key] = torch.zeros(config.hidden_size)
    for key, value in visual_fill.items():
        state[prefix + key] = value
    heads_state = {k[len(HEADS_PREFIX):]: state.pop(k) for k in list(state) if k.startswith(HEADS_PREFIX)}
    return Converted(config=config, layout=layout, state=state, report=report, heads=heads_state)


def task_meta_for(layout: SourceLayout, task: str | None, *, bert_path: str, vocabularies: dict[str, list[str]],
                  source_name: str) -> dict[str, Any]:
    """The fine-tuned model's meta (tasks.finetune) for a released task checkpoint; `vocabularies`: the
    lists read from the `released_vocabularies` files given ({meta key: lines})."""
    from vlbert_core.models.common.bert_init import load_tokenizer

    tasks = list(layout.tasks)
    task = task or tasks[0]
    if task not in tasks:
        raise ConversionError(f"{source_name}: a {layout.kind} checkpoint converts to task {tasks}, not {task!r}")
    if not bert_path:
        raise ConversionError(f"{source_name}: a fine-tuned checkpoint needs --bert-path (its tokenizer gives [MASK])")
    meta: dict[str, Any] = {"name": task, "setting": "released", "schedule": "released", "schedule_factor": 1.0,
                            "seed": 0, "pretrained": source_name, "tune_frcnn": False, "max_rois": 101,
                            "image_max_side": 1000, "image_min_side": 600, "instance_mask_size": 14,
                            "max_text_len": 64, "batch_size": 64,
                            "mask_id": int(load_tokenizer(bert_path).mask_token_id)}
    head = RELEASED_HEADS[task]
    for key, what in head.vocabularies:
        if not vocabularies.get(key):
            raise ConversionError(f"{source_name}: a {task} checkpoint needs {what} ({vocabulary_option(key)}, "
                                  "one a line)")
    meta.update(head.task_meta(vocabularies))
    return meta


def _read_lines(path: str | os.PathLike | None) -> list[str] | None:
    if path is None:
        return None
    lines = [line.strip() for line in Path(path).read_text().splitlines()]
    return [line for line in lines if line]


def convert_vlbert(in_path: str | os.PathLike, out_dir: str | os.PathLike, *, bert_path: str = "",
                   visual_weights: str | os.PathLike | None = None, task: str | None = None,
                   vocabulary_files: dict[str, str | os.PathLike | None] | None = None) -> Converted:
    """Convert one released checkpoint file into the directory `out_dir` (written whole, then renamed).
    `vocabulary_files`: {meta key of a task's `released_vocabularies`: its file, one entry a line}."""
    from vlbert_core.tasks.finetune import FinetuneModel, save_finetuned

    out_dir = Path(out_dir)
    if out_dir.exists() and any(out_dir.iterdir()):
        raise FileExistsError(f"{out_dir} exists and is not empty; remove it or choose another directory")
    source_name = str(in_path)
    outside: list[str] = []
    source = read_published(in_path, CHECKPOINT_WRAP, outside)
    layout = detect_layout(list(strip_module_prefix(source)), source_name)
    meta = None
    if layout.kind != "pretrained":
        vocabularies = {key: _read_lines(path) for key, path in (vocabulary_files or {}).items() if path}
        meta = task_meta_for(layout, task, bert_path=bert_path, vocabularies=vocabularies, source_name=source_name)
    visual = None if visual_weights is None else read_published(visual_weights, ())
    converted = convert_vlbert_state(source, source_name=source_name, bert_path=bert_path, visual=visual,
                                     visual_name=str(visual_weights), task_meta=meta)
    for entry in outside:
        converted.report.dropped[f"<checkpoint entry> {entry}"] = OUTSIDE_REASONS.get(entry, OUTSIDE_OTHER)
    tmp = out_dir.with_name(f".tmp-{os.getpid()}-{out_dir.name}")
    if tmp.exists():
        shutil.rmtree(tmp)
    try:
        model = VLBertModel(converted.config)
        if meta is None:
            model.load_state_dict(converted.state, strict=True)
            model.save_pretrained(tmp)
            heads = PretrainingHeads(converted.config, model.word_embeddings(), **converted.heads_present())
            heads.load_state_dict(converted.heads, strict=True)
            save_pretraining_heads(heads, tmp)
        else:
            finetuned = FinetuneModel(meta["name"], model, meta)
            finetuned.load_state_dict(converted.state, strict=True)
            tmp.mkdir(parents=True)
            save_finetuned(finetuned, meta, tmp)
        converted.report.write(tmp / REPORT_FILE)
        if out_dir.exists():
            out_dir.rmdir()
        os.replace(tmp, out_dir)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return converted
