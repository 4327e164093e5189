"""The authors' released ViLBERT (facebookresearch/vilbert-multi-task) -> a ViLBERT model directory of this project
(model.safetensors + config.json + heads.safetensors, what vlbert_core.models.registry.from_pretrained loads).

The input is a plain PyTorch state dict (read with weights_only=True) of one of the authors' two model classes
(CHECKPOINT_LAYOUTS):
- "pretrained": BertForMultiModalPreTraining, `pretrained_model.bin` (pytorch_pretrained_bert naming: `bert.*`
  for the model, `cls.*` for the pre-training heads);
- "vl-tasks": VILBertForVLTasks, the fine-tuned models: `multi_task_model.bin` and the per-task files fine-tuned
  from it. The same `bert.*` and `cls.*`, and every task head (TASK_HEAD_MODULES: vil_prediction,
  vil_prediction_gqa, vil_logit, vil_binary_prediction, vil_tri_prediction, vision_logit, linguisic_logit),
  written to task_heads.safetensors (tasks/modeling/vilbert_released.py ViLBertReleasedHeads), the model's
  task_heads set to "vilbert_released". With task tokens (`bert.embeddings.task_embeddings.weight`, the
  multi-task models' task_specific_tokens) the converted model has them too, its task_id left for the task that
  uses it to set (models/vilbert/config.py task_token_id);
- "vl-tasks-beta": the VILBertForVLTasks of jiasenlu/vilbert_beta, the ViLBERT paper's single-task fine-tuned
  files: the same body (no task tokens) and `cls.*`, and four heads, vil_prediction of its own (weight-normed
  Linear, ReLU, Dropout(0.5), weight-normed Linear; each weight is folded, W = g v / ||v||), vil_logit,
  vision_logit, linguisic_logit (task_heads "vilbert_beta_released"). Sizes are read
off the tensors' shapes; what shapes cannot tell (attention heads, which layers the co-attention layers follow,
activations, dropouts) comes from the released config/bert_base_6layer_6conect.json (RELEASED_CONFIG) or from
`--config`, a config file of the authors' format. Every tensor is mapped or dropped with a reason
(conversion_report.json beside the weights); a tensor the mapping expects and the file lacks is an error.

The released ViLBERT holds no visual network: its region features were precomputed by a detector (for the
multi-task release, vqa-maskrcnn-benchmark's detectron_model.pth, data/README.md; script/extract_features.py reads
its fc6 layer, an MLP box head that this project's ResNet-C4 network does not express). As `convert vl-bert` does
for its "prec" checkpoints, the visual network comes from a file named
on the command line: `--detector`, a detector checkpoint of this project (e.g. what `convert bottom-up` writes
from bottom-up attention's ResNet-101, whose 2048-d features the original ViLBERT was trained on). Its RoI
feature width must be the checkpoint's v_feature_size and its classes + background the region head's
v_target_size. Without one the conversion stops: a ViLBERT model here always computes its own RoI features.

Also here: `write_stand_in`, a random-valued checkpoint with the released key layout at any size (tests, the
reference check in convert/vilbert/reference.py), on the command line
    python -m vlbert_core.convert.vilbert stand-in OUT [--config JSON] [--seed S]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import torch

from vlbert_core.models.common.encoder import BERT_LAYER_TENSORS
from vlbert_core.models.common.heads import save_pretraining_heads
from vlbert_core.models.vilbert.config import TASK_TOKEN_COUNT, ViLBertConfig, task_token_id
from vlbert_core.models.vilbert.heads import ViLBertPretrainingHeads
from vlbert_core.models.vilbert.model import ViLBertModel
from vlbert_core.tasks.modeling.vilbert_released import (ENTAILMENT_CLASSES, GQA_ANSWERS, VQA_ANSWERS,
                                                        VQA_OUTPUT_KEY, ViLBertReleasedHeads, save_released_heads)

from ..accounting import (REPORT_FILE, ConversionError, ConversionReport, Drop, Rule, check_aliases, convert_state_dict,
                          strip_module_prefix)
from ..manifest import read_published
from ..released_heads import VILBERT_TASK_HEADS, vocabulary_option

PUBLISHED_FILE = "pretrained_model.bin"
# config/bert_base_6layer_6conect.json of facebookresearch/vilbert-multi-task, the config of pretrained_model.bin
RELEASED_CONFIG: dict[str, Any] = {
    "attention_probs_dropout_prob": 0.1, "hidden_act": "gelu", "hidden_dropout_prob": 0.1, "hidden_size": 768,
    "initializer_range": 0.02, "intermediate_size": 3072, "max_position_embeddings": 512, "num_attention_heads": 12,
    "num_hidden_layers": 12, "type_vocab_size": 2, "vocab_size": 30522, "v_feature_size": 2048,
    "v_target_size": 1601, "v_hidden_size": 1024, "v_num_hidden_layers": 6, "v_num_attention_heads": 8,
    "v_intermediate_size": 1024, "bi_hidden_size": 1024, "bi_num_attention_heads": 8, "bi_intermediate_size": 1024,
    "bi_attention_type": 1, "v_attention_probs_dropout_prob": 0.1, "v_hidden_act": "gelu",
    "v_hidden_dropout_prob": 0.1, "v_initializer_range": 0.02, "v_biattention_id": [0, 1, 2, 3, 4, 5],
    "t_biattention_id": [6, 7, 8, 9, 10, 11], "pooling_method": "mul",
}
# the authors' config keys that are ViLBertConfig fields of the same name
SHARED_KEYS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
               "hidden_act", "hidden_dropout_prob", "attention_probs_dropout_prob", "max_position_embeddings",
               "type_vocab_size", "v_hidden_size", "v_num_hidden_layers", "v_num_attention_heads",
               "v_intermediate_size", "v_hidden_act", "v_hidden_dropout_prob", "v_attention_probs_dropout_prob",
               "bi_hidden_size", "bi_num_attention_heads", "v_biattention_id", "t_biattention_id", "with_coattention",
               "fusion_method", "task_specific_tokens")
# ... and the two that are named after this project's visual network
RENAMED_KEYS = {"v_feature_size": "appearance_dim", "v_target_size": "num_object_classes"}
# keys the authors' BertModel forward never reads (or reads only in training), with why they change nothing here
IGNORED_KEYS = {
    "initializer_range": "initialisation only", "v_initializer_range": "initialisation only",
    "bi_intermediate_size": "read by no module (the co-attention FFNs use intermediate_size and v_intermediate_size)",
    "bi_attention_type": "read by no module", "pooling_method": "read by no module (fusion_method decides)",
    "visual_target": "the region loss only", "objective": "the data and losses only",
    "num_negative": "the region loss only", "fixed_t_layer": "training only (no gradient in the first layers)",
    "fixed_v_layer": "training only (no gradient in the first layers)", "visualization": "attention maps only",
}
# options whose non-default values change the forward in ways this model does not implement: (default, why)
REFUSED_VALUES = {
    "dynamic_attention": (False, "text-gated visual attention (dyLinear_q/k)"),
    "in_batch_pairs": (False, "every caption paired with every image of the batch"),
    "fast_mode": (False, "one text expanded over the batch's images"),
    "model": ("bert", "RoBERTa embeddings"),
}
LAYER_NORM_EPS = 1e-12   # the authors' BertLayerNorm eps, fixed in every module
HEADS_PREFIX = "heads."              # our keys of the pre-training heads (heads.safetensors)
TASK_HEADS_PREFIX = "task_heads."    # ... and of the released task heads (task_heads.safetensors)
TASK_EMBEDDINGS = "bert.embeddings.task_embeddings.weight"
PRETRAINED_LAYOUT, VL_TASKS_LAYOUT, BETA_LAYOUT = "pretrained", "vl-tasks", "vl-tasks-beta"
# the authors' model class of each layout, and the files of it they released
CHECKPOINT_LAYOUTS = {
    PRETRAINED_LAYOUT: ("BertForMultiModalPreTraining", "pretrained_model.bin"),
    VL_TASKS_LAYOUT: ("VILBertForVLTasks", "multi_task_model.bin and the per-task fine-tuned files"),
    BETA_LAYOUT: ("VILBertForVLTasks of jiasenlu/vilbert_beta", "the ViLBERT paper's single-task fine-tuned files"),
}
# the head layout (model.task_heads) of a converted checkpoint of each layout
HEAD_LAYOUT_OF = {PRETRAINED_LAYOUT: "project", VL_TASKS_LAYOUT: "vilbert_released",
                  BETA_LAYOUT: "vilbert_beta_released"}
# VILBertForVLTasks' task heads: (their module, our module in ViLBertReleasedHeads, [(their sub-module, ours)])
# with .weight and .bias each; SimpleClassifier's logit_fc is Linear (0), GeLU (1), LayerNorm (2), Linear (3)
_SIMPLE_CLASSIFIER = (("logit_fc.0", "dense"), ("logit_fc.2", "layer_norm"), ("logit_fc.3", "linear"))
TASK_HEAD_MODULES = (
    ("vil_prediction", "vqa.classifier.mlp", _SIMPLE_CLASSIFIER),
    ("vil_prediction_gqa", "gqa.mlp", _SIMPLE_CLASSIFIER),
    ("vil_binary_prediction", "nlvr2.mlp", _SIMPLE_CLASSIFIER),
    ("vil_logit", "pair_score.classifier", (("", ""),)),
    ("vil_tri_prediction", "entailment.linear", (("", ""),)),
    ("vision_logit", "region_score.mlp.linear", (("", ""),)),
    ("linguisic_logit", "word_score.linear", (("", ""),)),
)
# the authors' answer vocabularies of the released heads (vilbert.py builds them at these sizes)
RELEASED_ANSWERS = {"vil_prediction": VQA_ANSWERS, "vil_prediction_gqa": GQA_ANSWERS}
# vilbert_beta's vil_prediction: its weight-normed Linears (main.0, main.3; ReLU and Dropout between) -> ours; its
# vil_logit, vision_logit and linguisic_logit are vilbert-multi-task's (TASK_HEAD_MODULES' rules)
BETA_PREDICTION = (("main.0", "dense"), ("main.3", "linear"))
BETA_MARK = "vil_prediction.main.0.weight_v"   # a key only vilbert_beta's layout has


def checkpoint_layout(source: Mapping[str, torch.Tensor]) -> str:
    """BETA_LAYOUT when the state dict holds vilbert_beta's weight-normed vil_prediction, VL_TASKS_LAYOUT when it
    holds any other key of a task head, else PRETRAINED_LAYOUT (a key of a head present alone makes the others
    missing, each named)."""
    if BETA_MARK in source:
        return BETA_LAYOUT
    heads = tuple(f"{module}." for module, _, _ in TASK_HEAD_MODULES)
    return VL_TASKS_LAYOUT if any(key.startswith(heads) for key in source) else PRETRAINED_LAYOUT


_BERT = re.escape("bert.")


# ---- the authors' config -------------------------------------------------------------------------------------

def read_authors_config(path: str | os.PathLike) -> dict[str, Any]:
    """An authors'-format config file (e.g. config/bert_base_6layer_6conect.json), checked key by key."""
    path = Path(path)
    try:
        config = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ConversionError(f"{path}: not a readable JSON config: {exc}") from exc
    if not isinstance(config, dict):
        raise ConversionError(f"{path}: expected a JSON object")
    check_authors_config(config, str(path))
    return config


def check_authors_config(config: Mapping[str, Any], where: str) -> None:
    known = set(SHARED_KEYS) | set(RENAMED_KEYS) | set(IGNORED_KEYS) | set(REFUSED_VALUES)
    unknown = sorted(set(config) - known)
    if unknown:
        raise ConversionError(f"{where}: unknown ViLBERT config keys {unknown}")
    for key, (default, what) in REFUSED_VALUES.items():
        if config.get(key, default) != default:
            raise ConversionError(f"{where}: {key}={config[key]!r} ({what}) is not implemented by this project's "
                                  f"ViLBERT; only {key}={default!r} converts")


def released_key_shapes(config: Mapping[str, Any], layout: str = PRETRAINED_LAYOUT,
                        beta_labels: int = VQA_ANSWERS) -> dict[str, tuple[int, ...]]:
    """Every tensor of the authors' state dict of `layout` (CHECKPOINT_LAYOUTS: BertForMultiModalPreTraining or
    either VILBertForVLTasks) built from `config` (their keys), with its shape, in their module order. Both names
    of the tied MLM decoder are listed (state_dict saves it under both). `beta_labels`: vilbert_beta's
    vil_prediction rows (its task's num_labels)."""
    if layout not in CHECKPOINT_LAYOUTS:
        raise ValueError(f"unknown ViLBERT checkpoint layout {layout!r}; expected one of {list(CHECKPOINT_LAYOUTS)}")
    c = {**RELEASED_CONFIG, **config}
    h, v, bi = c["hidden_size"], c["v_hidden_size"], c["bi_hidden_size"]
    shapes: dict[str, tuple[int, ...]] = {}

    def linear(name: str, n_in: int, n_out: int) -> None:
        shapes[f"{name}.weight"], shapes[f"{name}.bias"] = (n_out, n_in), (n_out,)

    def norm(name: str, width: int) -> None:
        shapes[f"{name}.weight"], shapes[f"{name}.bias"] = (width,), (width,)

    def bert_layer(prefix: str, width: int, inner: int) -> None:
        for proj in ("query", "key", "value"):
            linear(f"{prefix}.attention.self.{proj}", width, width)
        linear(f"{prefix}.attention.output.dense", width, width)
        norm(f"{prefix}.attention.output.LayerNorm", width)
        linear(f"{prefix}.intermediate.dense", width, inner)
        linear(f"{prefix}.output.dense", inner, width)
        norm(f"{prefix}.output.LayerNorm", width)

    shapes["bert.embeddings.word_embeddings.weight"] = (c["vocab_size"], h)
    shapes["bert.embeddings.position_embeddings.weight"] = (c["max_position_embeddings"], h)
    shapes["bert.embeddings.token_type_embeddings.weight"] = (c["type_vocab_size"], h)
    norm("bert.embeddings.LayerNorm", h)
    if c.get("task_specific_tokens", False):
        shapes[TASK_EMBEDDINGS] = (TASK_TOKEN_COUNT, h)
    linear("bert.v_embeddings.image_embeddings", c["v_feature_size"], v)
    linear("bert.v_embeddings.image_location_embeddings", 5, v)
    norm("bert.v_embeddings.LayerNorm", v)
    for i in range(c["num_hidden_layers"]):
        bert_layer(f"bert.encoder.layer.{i}", h, c["intermediate_size"])
    for i in range(c["v_num_hidden_layers"]):
        bert_layer(f"bert.encoder.v_layer.{i}", v, c["v_intermediate_size"])
    for i in range(len(c["v_biattention_id"])):
        p = f"bert.encoder.c_layer.{i}"
        for proj in ("query1", "key1", "value1"):
            linear(f"{p}.biattention.{proj}", v, bi)
        for proj in ("query2", "key2", "value2"):
            linear(f"{p}.biattention.{proj}", h, bi)
        linear(f"{p}.biOutput.dense1", bi, v)
        norm(f"{p}.biOutput.LayerNorm1", v)
        linear(f"{p}.biOutput.q_dense1", bi, v)
        linear(f"{p}.biOutput.dense2", bi, h)
        norm(f"{p}.biOutput.LayerNorm2", h)
        linear(f"{p}.biOutput.q_dense2", bi, h)
        linear(f"{p}.v_intermediate.dense", v, c["v_intermediate_size"])
        linear(f"{p}.v_output.dense", c["v_intermediate_size"], v)
        norm(f"{p}.v_output.LayerNorm", v)
        linear(f"{p}.t_intermediate.dense", h, c["intermediate_size"])
        linear(f"{p}.t_output.dense", c["intermediate_size"], h)
        norm(f"{p}.t_output.LayerNorm", h)
    linear("bert.t_pooler.dense", h, bi)
    linear("bert.v_pooler.dense", v, bi)
    shapes["cls.predictions.bias"] = (c["vocab_size"],)
    linear("cls.predictions.transform.dense", h, h)
    norm("cls.predictions.transform.LayerNorm", h)
    shapes["cls.predictions.decoder.weight"] = (c["vocab_size"], h)
    linear("cls.bi_seq_relationship", bi, 2)
    linear("cls.imagePredictions.transform.dense", v, v)
    norm("cls.imagePredictions.transform.LayerNorm", v)
    linear("cls.imagePredictions.decoder", v, c["v_target_size"])
    if layout == VL_TASKS_LAYOUT:
        for name in ("vil_prediction", "vil_prediction_gqa", "vil_binary_prediction"):
            width = 2 * bi if name == "vil_binary_prediction" else bi
            out = 2 if name == "vil_binary_prediction" else RELEASED_ANSWERS[name]
            linear(f"{name}.logit_fc.0", width, 2 * bi)
            norm(f"{name}.logit_fc.2", 2 * bi)
            linear(f"{name}.logit_fc.3", 2 * bi, out)
        linear("vil_logit", bi, 1)
        linear("vil_tri_prediction", bi, ENTAILMENT_CLASSES)
        linear("vision_logit", v, 1)
        linear("linguisic_logit", h, 1)
    if layout == BETA_LAYOUT:
        for name, n_in, n_out in (("main.0", bi, 2 * bi), ("main.3", 2 * bi, beta_labels)):
            shapes[f"vil_prediction.{name}.bias"] = (n_out,)
            shapes[f"vil_prediction.{name}.weight_g"] = ()   # weight_norm(dim=None): one scale per matrix
            shapes[f"vil_prediction.{name}.weight_v"] = (n_out, n_in)
        linear("vil_logit", bi, 1)
        linear("vision_logit", v, 1)
        linear("linguisic_logit", h, 1)
    return shapes


def _count_layers(source: Mapping[str, torch.Tensor], kind: str) -> int:
    """How many `bert.encoder.<kind>.<i>.` layers the checkpoint holds (numbered 0..n-1)."""
    found = {int(m.group(1)) for k in source if (m := re.match(rf"bert\.encoder\.{kind}\.(\d+)\.", k))}
    if found != set(range(len(found))):
        raise ConversionError(f"bert.encoder.{kind} layers are not numbered 0..n-1: {sorted(found)}")
    return len(found)


def sizes_from_shapes(source: Mapping[str, torch.Tensor], source_name: str) -> dict[str, Any]:
    """The authors' size keys, read off the checkpoint's tensors, and task_specific_tokens: whether it holds the
    task embeddings (their training scripts set it on the command line, no config file says it)."""
    def shape(key: str) -> tuple[int, ...]:
        if key not in source:
            raise ConversionError(f"{source_name}: {key!r} is missing; the model's sizes are read from it")
        return tuple(source[key].shape)

    vocab, hidden = shape("bert.embeddings.word_embeddings.weight")
    v_hidden, v_feature = shape("bert.v_embeddings.image_embeddings.weight")
    task_tokens = TASK_EMBEDDINGS in source
    if task_tokens and shape(TASK_EMBEDDINGS) != (TASK_TOKEN_COUNT, hidden):
        raise ConversionError(f"{source_name}: {TASK_EMBEDDINGS!r} has shape {shape(TASK_EMBEDDINGS)}; the authors' "
                              f"task embeddings are ({TASK_TOKEN_COUNT}, hidden_size {hidden})")
    return {"task_specific_tokens": task_tokens, "vocab_size": vocab, "hidden_size": hidden,
            "max_position_embeddings": shape("bert.embeddings.position_embeddings.weight")[0],
            "type_vocab_size": shape("bert.embeddings.token_type_embeddings.weight")[0],
            "num_hidden_layers": _count_layers(source, "layer"),
            "intermediate_size": shape("bert.encoder.layer.0.intermediate.dense.weight")[0],
            "v_feature_size": v_feature, "v_hidden_size": v_hidden,
            "v_num_hidden_layers": _count_layers(source, "v_layer"),
            "v_intermediate_size": shape("bert.encoder.v_layer.0.intermediate.dense.weight")[0],
            "bi_hidden_size": shape("bert.encoder.c_layer.0.biattention.query1.weight")[0],
            "v_target_size": shape("cls.imagePredictions.decoder.weight")[0]}


def authors_config_of(source: Mapping[str, torch.Tensor], given: Mapping[str, Any] | None,
                      source_name: str) -> dict[str, Any]:
    """The checkpoint's config in the authors' keys: sizes from its shapes, the rest from `given` (a --config)
    or else the released config. A size `given` states must be the checkpoint's."""
    given = dict(given or {})
    check_authors_config(given, "--config")
    sizes = sizes_from_shapes(source, source_name)
    wrong = {k: (given[k], n) for k, n in sizes.items() if k in given and given[k] != n}
    if wrong:
        raise ConversionError(f"{source_name}: the config says {', '.join(f'{k}={a}' for k, (a, _) in wrong.items())}, "
                              f"the checkpoint's tensors {', '.join(f'{k}={n}' for k, (_, n) in wrong.items())}")
    num_coattention = _count_layers(source, "c_layer")
    config = {**RELEASED_CONFIG, **given, **sizes}
    for key in ("v_biattention_id", "t_biattention_id"):
        if len(config[key]) != num_coattention:
            raise ConversionError(f"{source_name}: {num_coattention} co-attention layers (bert.encoder.c_layer.*) but "
                                  f"{key} {config[key]} names {len(config[key])}: pass the checkpoint's config "
                                  "(--config, e.g. config/bert_base_4layer_4conect.json)")
    return config


def vilbert_config(authors: Mapping[str, Any], *, visual_backbone: dict, bert_path: str = "",
                   where: str = "", layout: str = PRETRAINED_LAYOUT) -> ViLBertConfig:
    """Our ViLBertConfig of an authors'-format config (their keys) and the visual network's backbone; a
    fine-tuned checkpoint (VL_TASKS_LAYOUT) has its task heads in the layout of theirs."""
    fields: dict[str, Any] = {k: authors[k] for k in SHARED_KEYS if k in authors}
    fields.update({ours: authors[theirs] for theirs, ours in RENAMED_KEYS.items()})
    try:
        # the released models were trained with region 0 the mean of the detections at (0, 0, 1, 1, 1)
        # (vilbert/datasets/_image_features_reader.py), so a converted one is fed that
        return ViLBertConfig(**fields, layer_norm_eps=LAYER_NORM_EPS, visual_backbone=dict(visual_backbone),
                             tune_frcnn=False, bert_path=bert_path, global_region="mean_of_regions",
                             task_heads=HEAD_LAYOUT_OF[layout])
    except (TypeError, ValueError) as exc:
        raise ConversionError(f"{where}: {exc}; pass the checkpoint's config (--config)") from exc


# ---- the mapping -----------------------------------------------------------------------------------------------

# (the authors' name inside a c_layer, ours inside a CoAttentionLayer), each with .weight and .bias
COATTENTION_TENSORS = (
    ("biattention.query1", "attention.visual_query"), ("biattention.key1", "attention.visual_key"),
    ("biattention.value1", "attention.visual_value"), ("biattention.query2", "attention.text_query"),
    ("biattention.key2", "attention.text_key"), ("biattention.value2", "attention.text_value"),
    ("biOutput.dense1", "visual_attention_output"), ("biOutput.LayerNorm1", "visual_attention_norm"),
    ("biOutput.dense2", "text_attention_output"), ("biOutput.LayerNorm2", "text_attention_norm"),
    ("v_intermediate.dense", "visual_feed_forward.intermediate"), ("v_output.dense", "visual_feed_forward.output"),
    ("v_output.LayerNorm", "visual_feed_forward.norm"), ("t_intermediate.dense", "text_feed_forward.intermediate"),
    ("t_output.dense", "text_feed_forward.output"), ("t_output.LayerNorm", "text_feed_forward.norm"),
)
# the authors' module (with .weight and .bias) -> ours, outside the layers
MODULE_TENSORS = (
    ("bert.embeddings.LayerNorm", "embeddings.layer_norm"),
    ("bert.v_embeddings.image_embeddings", "image_embeddings.feature"),
    ("bert.v_embeddings.image_location_embeddings", "image_embeddings.location"),
    ("bert.v_embeddings.LayerNorm", "image_embeddings.layer_norm"),
    ("bert.t_pooler.dense", "text_pooler.dense"), ("bert.v_pooler.dense", "visual_pooler.dense"),
    ("cls.predictions.transform.dense", HEADS_PREFIX + "mlm.transform.dense"),
    ("cls.predictions.transform.LayerNorm", HEADS_PREFIX + "mlm.transform.layer_norm"),
    ("cls.imagePredictions.transform.dense", HEADS_PREFIX + "region.transform.dense"),
    ("cls.imagePredictions.transform.LayerNorm", HEADS_PREFIX + "region.transform.layer_norm"),
    ("cls.imagePredictions.decoder", HEADS_PREFIX + "region.decoder"),
    ("cls.bi_seq_relationship", HEADS_PREFIX + "alignment.classifier"),
)
TIED_DECODER = ("cls.predictions.decoder.weight", "bert.embeddings.word_embeddings.weight")


def mapping_rules(source: Mapping[str, torch.Tensor] | None = None) -> tuple[list[Rule], list[Drop]]:
    """Rules for every tensor of the authors' state dict of any layout: model keys, HEADS_PREFIX + the
    pre-training heads', or TASK_HEADS_PREFIX + the released task heads' (ViLBertReleasedHeads). The target
    model decides which are expected: a rule whose key the checkpoint lacks produces nothing. `source`: the
    state dict itself, whose weight-norm scales (vilbert_beta) the folding rules read."""
    rules = [Rule(r"bert\.embeddings\.(word_embeddings|position_embeddings|token_type_embeddings|task_embeddings)"
                  r"\.weight", r"embeddings.\1.weight"),
             Rule(r"cls\.predictions\.bias", HEADS_PREFIX + "mlm.bias")]
    rules += [Rule(re.escape(theirs) + r"\.(weight|bias)", ours + r".\1") for theirs, ours in MODULE_TENSORS]
    for kind, ours_list in (("layer", "text_layers"), ("v_layer", "visual_layers")):
        for theirs, ours in BERT_LAYER_TENSORS:
            rules.append(Rule(rf"bert\.encoder\.{kind}\.(\d+)\." + re.escape(theirs) + r"\.(weight|bias)",
                              rf"encoder.{ours_list}.\1.{ours}.\2"))
    for theirs, ours in COATTENTION_TENSORS:
        rules.append(Rule(r"bert\.encoder\.c_layer\.(\d+)\." + re.escape(theirs) + r"\.(weight|bias)",
                          rf"encoder.coattention_layers.\1.{ours}.\2"))
    for theirs, ours, parts in TASK_HEAD_MODULES:
        for their_part, our_part in parts:
            their_name = ".".join(filter(None, (theirs, their_part)))
            our_name = ".".join(filter(None, (ours, our_part)))
            rules.append(Rule(re.escape(their_name) + r"\.(weight|bias)", TASK_HEADS_PREFIX + our_name + r".\1"))
    if source is not None and BETA_MARK in source:
        for theirs, ours in BETA_PREDICTION:
            key = f"vil_prediction.{theirs}"
            rules.append(Rule(re.escape(key) + r"\.bias", f"{TASK_HEADS_PREFIX}vqa.classifier.{ours}.bias"))
            scale = source.get(f"{key}.weight_g")
            rules.append(Rule(re.escape(key) + r"\.weight_v", f"{TASK_HEADS_PREFIX}vqa.classifier.{ours}.weight",
                              transform=lambda v, g=scale, key=key: fold_weight_norm(v, g, key)))
    drops = [
        Drop(r"vil_prediction\.main\.[03]\.weight_g", "folded into the weight: weight_norm(dim=None), W = g v / ||v||"),
        Drop(r"bert\.encoder\.c_layer\.\d+\.biOutput\.q_dense[12]\.(weight|bias)",
             "BertBiOutput defines q_dense1/q_dense2 but its forward never uses them"),
        Drop(re.escape(TIED_DECODER[0]), "the MLM decoder is tied to the word embeddings; checked equal to "
                                         f"{TIED_DECODER[1]}"),
    ]
    return rules, drops


def fold_weight_norm(direction: torch.Tensor, scale: torch.Tensor | None, key: str) -> torch.Tensor:
    """The weight torch.nn.utils.weight_norm(dim=None) computes: scale * direction / ||direction|| (Frobenius)."""
    if scale is None or scale.dim() != 0:
        raise ConversionError(f"{key}.weight_v has no scalar {key}.weight_g (weight_norm with dim=None) to fold "
                              "into its weight")
    return direction * (scale / direction.norm())


# ---- the visual network from a detector ------------------------------------------------------------------------

def detector_visual(detector_path: str | os.PathLike | None, authors: Mapping[str, Any],
                    source_name: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """(backbone config, detector state dict) of the detector checkpoint that gives the converted model its visual
    network, checked against the checkpoint's feature width and region classes."""
    from vlbert_core.detector.resnet_c4 import build_resnet_c4
    from vlbert_core.detector.train import load_detector

    if detector_path is None:
        raise ConversionError(f"{source_name}: the released ViLBERT holds no visual network (its region features "
                              "were precomputed); pass a detector checkpoint of this project (--detector), e.g. "
                              "bottom-up attention's converted with `python -m vlbert_core.convert bottom-up`")
    detector, meta = load_detector(detector_path)
    backbone = dict(meta["config"]["backbone"])   # load_detector took init_weights out
    _, _, _, feature_width = build_resnet_c4(backbone)
    if feature_width != authors["v_feature_size"]:
        raise ConversionError(f"{detector_path}: RoI features of {feature_width} dimensions, the checkpoint's image "
                              f"embedding reads v_feature_size {authors['v_feature_size']}")
    if int(meta["num_classes"]) + 1 != authors["v_target_size"]:
        raise ConversionError(f"{detector_path}: {meta['num_classes']} classes + background, the checkpoint's region "
                              f"head predicts v_target_size {authors['v_target_size']} classes (the detector's "
                              "classes are the region head's targets)")
    return backbone, detector.state_dict()


# ---- converting --------------------------------------------------------------------------------------------------

@dataclass
class ConvertedViLBert:
    config: ViLBertConfig
    state: dict[str, torch.Tensor]                 # ViLBertModel keys, the visual network's excepted
    heads: dict[str, torch.Tensor]                 # ViLBertPretrainingHeads keys
    report: ConversionReport
    layout: str = PRETRAINED_LAYOUT                # CHECKPOINT_LAYOUTS
    task_heads: dict[str, torch.Tensor] = field(default_factory=dict)   # ViLBertReleasedHeads keys (vl-tasks)
    authors_config: dict[str, Any] = field(default_factory=dict)


def convert_vilbert_state(source: Mapping[str, torch.Tensor], *, source_name: str, visual_backbone: dict,
                          authors_config: Mapping[str, Any] | None = None, bert_path: str = "",
                          visual_name: str = "the detector") -> ConvertedViLBert:
    """Convert a released state dict. `visual_backbone`: the backbone config of the visual network that will be
    filled from `visual_name`; `authors_config`: a --config (authors' keys), else the released one."""
    source = strip_module_prefix(dict(source))
    if not {"bert.embeddings.word_embeddings.weight", "bert.v_embeddings.image_embeddings.weight"} <= set(source):
        raise ConversionError(f"{source_name}: no 'bert.embeddings.word_embeddings.weight' and "
                              f"'bert.v_embeddings.image_embeddings.weight': not a ViLBERT checkpoint (first keys: "
                              f"{sorted(source)[:5]})")
    layout = checkpoint_layout(source)
    authors = authors_config_of(source, authors_config, source_name)
    config = vilbert_config(authors, visual_backbone=visual_backbone, bert_path=bert_path, where=source_name,
                            layout=layout)
    if bert_path:
        from vlbert_core.models.common.bert_init import read_bert_config

        bert_vocab = read_bert_config(bert_path)["vocab_size"]
        if bert_vocab != config.vocab_size:
            raise ConversionError(f"bert_path {bert_path!r} has vocab_size {bert_vocab}, the checkpoint's word "
                                  f"embeddings {config.vocab_size} rows: its tokenizer would index another table")
    check_aliases(source, [(re.escape(TIED_DECODER[0]), TIED_DECODER[1])], source_name)
    with torch.device("meta"):
        model = ViLBertModel(config)
        heads = ViLBertPretrainingHeads(config, model.word_embeddings())
    target_shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    target_shapes.update({HEADS_PREFIX + k: tuple(v.shape) for k, v in heads.state_dict().items()})
    if layout != PRETRAINED_LAYOUT:
        with torch.device("meta"):
            task_heads = ViLBertReleasedHeads(model.head_spec(), vqa_answers=beta_labels(source, layout))
        target_shapes.update({TASK_HEADS_PREFIX + k: tuple(v.shape) for k, v in task_heads.state_dict().items()})
    fill = {k: f"from {visual_name}: the released ViLBERT holds no visual network (its region features were "
               "precomputed)" for k in target_shapes if k.startswith("visual_network.")}
    rules, drops = mapping_rules(source)
    state, report = convert_state_dict(source, rules, drops, target_shapes, source_name=source_name, fill=fill)
    heads_state = {k[len(HEADS_PREFIX):]: state.pop(k) for k in list(state) if k.startswith(HEADS_PREFIX)}
    task_heads_state = {k[len(TASK_HEADS_PREFIX):]: state.pop(k) for k in list(state)
                        if k.startswith(TASK_HEADS_PREFIX)}
    return ConvertedViLBert(config=config, state=state, heads=heads_state, report=report, authors_config=authors,
                            layout=layout, task_heads=task_heads_state)


def beta_labels(source: Mapping[str, torch.Tensor], layout: str) -> int:
    """The VQA head's rows: VQA's 3,129 answers, or vilbert_beta's vil_prediction rows (its task's num_labels)."""
    if layout != BETA_LAYOUT:
        return VQA_ANSWERS
    return int(source["vil_prediction.main.3.weight_v"].shape[0]) if "vil_prediction.main.3.weight_v" in source \
        else VQA_ANSWERS


def vilbert_task_meta(task: str, *, source_name: str, bert_path: str, answers: list[str] | None,
                      instance_mask_size: int) -> dict[str, Any]:
    """The fine-tuned model's meta (tasks.finetune) of a released ViLBERT used for `task`: the authors' input sizes
    of the task (released_heads.VILBERT_TASK_HEADS) and what the task's head and data read."""
    from vlbert_core.models.common.bert_init import load_tokenizer
    from vlbert_core.tasks.registry import get_task

    head = VILBERT_TASK_HEADS[task]
    if not bert_path:
        raise ConversionError(f"{source_name}: --task {task} needs --bert-path (its tokenizer tokenises the queries)")
    meta: dict[str, Any] = {"name": task, "setting": "released", "schedule": "released", "schedule_factor": 1.0,
                            "seed": 0, "pretrained": source_name, "tune_frcnn": False, "sentence_readout": "pooled",
                            "max_rois": head.max_rois, "image_max_side": 1000, "image_min_side": 600,
                            "instance_mask_size": int(instance_mask_size), "max_text_len": head.max_text_len,
                            "batch_size": 64, "mask_id": int(load_tokenizer(bert_path).mask_token_id)}
    for key, what in head.vocabularies:
        if not answers:
            raise ConversionError(f"{source_name}: --task {task} needs {what} ({vocabulary_option(key)}, one a line)")
        if len(answers) != RELEASED_ANSWERS["vil_prediction"]:
            raise ConversionError(f"{source_name}: --task {task} needs {what}; the file given lists {len(answers)}")
        meta[key] = list(answers)
    if task != "vqa":   # the task's own meta defaults (VQA's prepare reads its training data for the answers)
        get_task(task).prepare(meta, {}, {})
    return meta


def keep_one_task_head(report: ConversionReport, task: str, released_head: str) -> None:
    """A fine-tuned directory of one task keeps that task's head (as `head.*`) and the model: every other head's
    key becomes a dropped one, with the reason."""
    kept = f"{TASK_HEADS_PREFIX}{released_head}."
    for key, target in list(report.mapped.items()):
        if target.startswith(kept):
            report.mapped[key] = "head." + target[len(kept):]
        elif target.startswith((HEADS_PREFIX, TASK_HEADS_PREFIX)):
            del report.mapped[key]
            report.dropped[key] = (f"a head of another task than {task}: a fine-tuned {task} directory keeps its own "
                                   "(convert without --task to keep every head)")


def convert_vilbert(in_path: str | os.PathLike, out_dir: str | os.PathLike, *, detector: str | os.PathLike | None,
                    bert_path: str = "", config_path: str | os.PathLike | None = None, task: str | None = None,
                    answers_path: str | os.PathLike | None = None) -> ConvertedViLBert:
    """Convert `in_path` (pretrained_model.bin, multi_task_model.bin or a per-task fine-tuned file) into the model
    directory `out_dir` (written whole, then renamed): model.safetensors + config.json, heads.safetensors (mlm,
    region, alignment), task_heads.safetensors (a VILBertForVLTasks checkpoint's task heads) and
    conversion_report.json. With `task` (a fine-tuned checkpoint only; released_heads.VILBERT_TASK_HEADS) it is a
    fine-tuned model directory of that task instead (tasks.finetune save_finetuned: what vlbert_core.predict
    answers with), its head the released one the task reads, the model's task token the task's;
    `answers_path`: VQA's answers, one a line. On any error nothing is written."""
    out_dir = Path(out_dir)
    if out_dir.exists() and any(out_dir.iterdir()):
        raise FileExistsError(f"{out_dir} exists and is not empty; remove it or choose another directory")
    source_name = str(in_path)
    source = read_published(in_path, ())
    given = None if config_path is None else read_authors_config(config_path)
    authors = authors_config_of(strip_module_prefix(source), given, source_name)
    backbone, detector_state = detector_visual(detector, authors, source_name)
    converted = convert_vilbert_state(source, source_name=source_name, visual_backbone=backbone,
                                      authors_config=given, bert_path=bert_path, visual_name=str(detector))
    if task is not None:
        if task not in VILBERT_TASK_HEADS:
            raise ConversionError(f"--task {task!r}: a released ViLBERT converts to a fine-tuned directory of "
                                  f"{list(VILBERT_TASK_HEADS)}")
        if converted.layout == PRETRAINED_LAYOUT:
            raise ConversionError(f"{source_name}: a {CHECKPOINT_LAYOUTS[converted.layout][0]} checkpoint has no task "
                                  "heads; --task takes a fine-tuned one (VILBertForVLTasks)")
        if converted.config.task_specific_tokens:
            converted.config.task_id = task_token_id(task)
        keep_one_task_head(converted.report, task, VILBERT_TASK_HEADS[task].released_head)
    tmp = out_dir.with_name(f".tmp-{os.getpid()}-{out_dir.name}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        model = ViLBertModel(converted.config)
        missing, unexpected = model.load_state_dict(converted.state, strict=False)
        if unexpected or any(not k.startswith("visual_network.") for k in missing):
            raise ConversionError(f"{source_name}: converted tensors do not fit the model: missing {missing[:8]}, "
                                  f"unexpected {unexpected[:8]}")
        model.visual_network.load_detector_weights(detector_state)
        task_heads = None
        if converted.layout != PRETRAINED_LAYOUT:
            answers = converted.task_heads[VQA_OUTPUT_KEY[converted.config.task_heads]].shape[0]
            task_heads = ViLBertReleasedHeads(model.head_spec(), vqa_answers=answers)
            task_heads.load_state_dict(converted.task_heads, strict=True)
        if task is None:
            model.save_pretrained(tmp)
            heads = ViLBertPretrainingHeads(converted.config, model.word_embeddings())
            heads.load_state_dict(converted.heads, strict=True)
            save_pretraining_heads(heads, tmp)
            if task_heads is not None:
                save_released_heads(task_heads, tmp)
        else:
            from vlbert_core.tasks.finetune import FinetuneModel, save_finetuned

            meta = vilbert_task_meta(task, source_name=source_name, bert_path=bert_path,
                                     answers=_read_lines(answers_path),
                                     instance_mask_size=model.visual_network.stage5_size())
            finetuned = FinetuneModel(task, model, meta)
            released = getattr(task_heads, VILBERT_TASK_HEADS[task].released_head)
            finetuned.head.load_state_dict(released.state_dict(), strict=True)
            tmp.mkdir(parents=True)
            save_finetuned(finetuned, meta, tmp)
        converted.report.write(tmp / REPORT_FILE)
        if out_dir.exists():
            out_dir.rmdir()
        os.replace(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return converted


def _read_lines(path: str | os.PathLike | None) -> list[str] | None:
    if path is None:
        return None
    try:
        lines = [line.strip() for line in Path(path).read_text().splitlines()]
    except OSError as exc:
        raise ConversionError(f"{path}: not readable: {exc}") from exc
    return [line for line in lines if line]


# ---- stand-ins ---------------------------------------------------------------------------------------------------

STAND_IN_SCALE = 0.05   # the spread of a stand-in's random values, like trained weights'


def stand_in_state(config: Mapping[str, Any], seed: int = 0,
                   layout: str = PRETRAINED_LAYOUT) -> dict[str, torch.Tensor]:
    """Random values (seeded numpy, the same on every machine) in the released `layout` of `config` (authors'
    keys, released_key_shapes; task_specific_tokens in `config` adds the task embeddings): N(0, 0.05)
    everywhere, LayerNorm scales 1 + N(0, 0.05) so every stage carries signal; the tied decoder is the
    word-embedding tensor itself, as the authors' state dict saves it."""
    rng = np.random.default_rng(seed)
    state: dict[str, torch.Tensor] = {}
    for key, shape in released_key_shapes(config, layout).items():
        if key == TIED_DECODER[0]:
            continue
        value = rng.standard_normal(size=shape).astype(np.float32) * STAND_IN_SCALE
        # LayerNorm scales: BertLayerNorm modules, and the one inside SimpleClassifier (logit_fc.2); and
        # vilbert_beta's weight-norm scales (the Frobenius norm of the folded weight, near the direction's)
        if re.search(r"((LayerNorm\d?|logit_fc\.2)\.weight|weight_g)$", key):
            value += 1.0
        state[key] = torch.from_numpy(np.asarray(value, dtype=np.float32))   # 0-d: a weight-norm scale
    state[TIED_DECODER[0]] = state[TIED_DECODER[1]]
    return state


def write_stand_in(path: str | os.PathLike, config: Mapping[str, Any] | None = None,
                   seed: int = 0, layout: str = PRETRAINED_LAYOUT) -> dict[str, torch.Tensor]:
    """A stand-in of pretrained_model.bin (or, `layout` VL_TASKS_LAYOUT, of a VILBertForVLTasks checkpoint; with
    task_specific_tokens in `config`, of multi_task_model.bin) saved as their scripts save it (torch.save of the
    state dict) for `config` (authors' keys over the released config; default: the released sizes, 1 GB).
    Returns the state written."""
    from vlbert_core.utils import atomic_path

    config = {**RELEASED_CONFIG, **dict(config or {})}
    check_authors_config(config, "stand-in config")
    state = stand_in_state(config, seed, layout)
    with atomic_path(Path(path)) as tmp:
        torch.save(state, tmp)
    return state


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vlbert_core.convert.vilbert",
                                     description="Stand-ins of the released ViLBERT (facebookresearch/"
                                                 f"vilbert-multi-task {PUBLISHED_FILE}): random values, the released "
                                                 "key layout.")
    sub = parser.add_subparsers(dest="command", required=True)
    stand_in = sub.add_parser("stand-in", help=f"write a random-valued {PUBLISHED_FILE}")
    stand_in.add_argument("out", help="file to write")
    stand_in.add_argument("--config", default=None,
                          help="an authors'-format config (default: config/bert_base_6layer_6conect.json's values)")
    stand_in.add_argument("--seed", type=int, default=0)
    stand_in.add_argument("--layout", choices=list(CHECKPOINT_LAYOUTS), default=PRETRAINED_LAYOUT,
                          help="the authors' model class (pretrained: BertForMultiModalPreTraining; vl-tasks: "
                               "VILBertForVLTasks, every task head)")
    stand_in.add_argument("--task-tokens", action="store_true",
                          help="with task embeddings (task_specific_tokens, as multi_task_model.bin)")
    args = parser.parse_args(argv)
    config = {} if args.config is None else read_authors_config(args.config)
    if args.task_tokens:
        config["task_specific_tokens"] = True
    state = write_stand_in(args.out, config, args.seed, args.layout)
    print(f"{args.out}: stand-in of a {CHECKPOINT_LAYOUTS[args.layout][0]} checkpoint, {len(state)} tensors, "
          f"{sum(v.numel() for k, v in state.items() if k != TIED_DECODER[0]) / 1e6:.1f}M values")
    return 0


if __name__ == "__main__":
    import sys

    from vlbert_core.cli import run_command

    sys.exit(run_command(main, "python -m vlbert_core.convert.vilbert"))
