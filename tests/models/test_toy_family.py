"""A third model family, defined in this file only: the recipe of docs/models.md "Adding a third family".

A family is its package (here: the classes below) plus one `Family` record registered with
`vlbert_core.models.registry.register_family`. The toy is a tiny single-stream model built from
`vlbert_core.models.common` alone (the visual network, the BERT encoder layer, `PretrainedModel`, the BERT
initialisation, the output types and the MLM head); it imports nothing of `vlbert_core.models.vlbert` or
`.vilbert` and subclasses nothing of theirs. Registered, it runs through the library's own entries with no edit
under vlbert_core/: pre-training (`vlbert_core.pretrain.pretrain`, on the ci world of tests/conftest.py), a VQA
fine-tune (`vlbert_core.tasks.finetune.finetune`) and predict (`vlbert_core.predict.Predictor`).

What the family gives:
- a config: BertFieldsConfig (the BERT fields) plus what the visual network and the task heads read;
- a config builder: (model_cfg, detector_meta, *, tune_frcnn) -> its config, how a pre-training run builds one;
- a model class: PretrainedModel + nn.Module with `model_type`, `config_class`, `visual_network`,
  `load_bert_weights`, `visual_features`, `encode(batch, roi_features=None, rows_per_image=1) -> EncoderOutput`
  and `head_spec() -> HeadSpec`;
- a pre-training module: (model, setting) -> nn.Module with `model`, `setting`, `heads` (with `mlm` and
  `load_from_bert`), `load_heads(directory)` and forward(batch, normalisers=None, roi_features=None) -> losses;
- an alignment readout: where its caption-image head lives (zero-shot retrieval reads it);
- pre-training settings that name its model_type (vlbert_core/pretrain/settings.py; here one added for the test).
"""

from __future__ import annotations

import ast
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import pytest
import torch
import torch.nn.functional as F
from test_tasks import BOXES, DETECTED, HPARAMS, MODEL_CFG, _scene, _vqa_files, _write_rois
from torch import nn

from vlbert_core.detector.resnet_c4 import ROI_OUTPUT_SIZE, ROI_SAMPLING_RATIO
from vlbert_core.models.common.batch import ModelBatch
from vlbert_core.models.common.bert_init import load_bert_mlm_head_state, read_bert_config
from vlbert_core.models.common.config import (BertFieldsConfig, ModelBuildKeys, bert_fields_from_hf_config,
                                              visual_backbone)
from vlbert_core.models.common.encoder import EncoderLayer, bert_encoder_key_map
from vlbert_core.models.common.heads import AlignmentReadout, MLMHead, load_pretraining_heads
from vlbert_core.models.common.initialization import copy_tensors, init_new_parameters
from vlbert_core.models.common.inputs import IGNORE_INDEX, IMG, TEXT
from vlbert_core.models.common.output import EncoderOutput, HeadSpec
from vlbert_core.models.common.pretrained import PretrainedModel
from vlbert_core.models.common.visual import FastRCNNVisualNetwork, features_per_shared_image
from vlbert_core.models.registry import Family, families, family, register_family, unregister_family
from vlbert_core.pretrain.objectives import TaskLosses, target_counts
from vlbert_core.pretrain.settings import SETTINGS, PretrainSetting

torch.set_num_threads(1)


# ---- the family: its config, config builder, model, pre-training module and alignment readout ------------------

@dataclass
class ToyConfig(BertFieldsConfig):
    model_type: ClassVar[str] = "toy"
    family_name: ClassVar[str] = "Toy"

    # what the visual network reads (models/common/visual.py FastRCNNVisualNetwork)
    visual_backbone: dict = field(default_factory=dict)
    appearance_dim: int = 16
    roi_align_size: int = ROI_OUTPUT_SIZE
    roi_sampling_ratio: int = ROI_SAMPLING_RATIO
    tune_frcnn: bool = False
    frozen_stages: int = 2
    freeze_bn: bool = True
    num_object_classes: int = 1      # detector classes incl. background (the pre-training streams' RoI labels)
    task_heads: str = "project"      # HeadSpec.layout
    bert_path: str = ""


def build_toy_config(model_cfg, detector_meta, *, tune_frcnn: bool) -> ToyConfig:
    keys = ModelBuildKeys.from_config(model_cfg)
    backbone, appearance_dim = visual_backbone(model_cfg, detector_meta)
    return ToyConfig(
        **bert_fields_from_hf_config(read_bert_config(keys.bert_path), keys.num_hidden_layers),
        visual_backbone=backbone, appearance_dim=appearance_dim, tune_frcnn=tune_frcnn,
        frozen_stages=keys.frozen_stages, freeze_bn=keys.freeze_bn,
        num_object_classes=int(detector_meta["num_classes"]) + 1, bert_path=keys.bert_path)


class ToyEmbeddings(nn.Module):
    """word + position + element-kind embeddings; an [IMG] element adds a projection of its RoI's feature."""

    def __init__(self, config: ToyConfig):
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.kind_embeddings = nn.Embedding(3, config.hidden_size)   # TEXT / IMG / END
        self.visual = nn.Linear(config.appearance_dim, config.hidden_size)
        self.layer_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, batch: ModelBatch, roi_features: torch.Tensor | None) -> torch.Tensor:
        x = (self.word_embeddings(batch.input_ids) + self.position_embeddings(batch.position_ids)
             + self.kind_embeddings(batch.element_kind))
        if roi_features is not None:
            index = batch.roi_index[..., None].expand(-1, -1, roi_features.shape[-1])
            visual = self.visual(torch.gather(roi_features, 1, index))
            x = x + visual * (batch.element_kind == IMG)[..., None].to(visual.dtype)
        return self.dropout(self.layer_norm(x))


class ToyEncoder(nn.Module):
    def __init__(self, config: ToyConfig):
        super().__init__()
        self.layers = nn.ModuleList(EncoderLayer(config) for _ in range(config.num_hidden_layers))

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        attend = attention_mask[:, None, None, :]
        for layer in self.layers:
            x = layer(x, attend)
        return x


class ToyModel(PretrainedModel, nn.Module):
    """One stream over VL-BERT's input layout ([CLS] text [SEP] [IMG]... [END]); `pooled` is the [CLS] state."""

    model_type: ClassVar[str] = "toy"
    config_class: ClassVar[type] = ToyConfig

    def __init__(self, config: ToyConfig):
        super().__init__()
        self.config = config
        self.embeddings = ToyEmbeddings(config)
        self.visual_network = FastRCNNVisualNetwork(config)
        self.encoder = ToyEncoder(config)
        init_new_parameters(self.embeddings)
        init_new_parameters(self.encoder)

    def word_embeddings(self) -> nn.Embedding:
        return self.embeddings.word_embeddings

    def load_bert_weights(self, bert_state: dict) -> None:
        mapping = {"embeddings.word_embeddings.weight": "embeddings.word_embeddings.weight",
                   "embeddings.position_embeddings.weight": "embeddings.position_embeddings.weight",
                   "embeddings.LayerNorm.weight": "embeddings.layer_norm.weight",
                   "embeddings.LayerNorm.bias": "embeddings.layer_norm.bias",
                   **bert_encoder_key_map(self.config.num_hidden_layers)}
        copy_tensors(self, bert_state, mapping, where=f"BERT checkpoint {self.config.bert_path!r}")

    def visual_features(self, batch: ModelBatch, rows_per_image: int = 1) -> torch.Tensor | None:
        if batch.images is None:
            return None
        if not bool(batch.has_image.all()):
            raise ValueError("ToyModel: every row needs an image")
        return features_per_shared_image(self.visual_network, batch, rows_per_image, batch.roi_masked)

    def encode(self, batch: ModelBatch, roi_features: torch.Tensor | None = None,
               rows_per_image: int = 1) -> EncoderOutput:
        if roi_features is None:
            roi_features = self.visual_features(batch, rows_per_image)
        states = self.encoder(self.embeddings(batch, roi_features), batch.attention_mask)
        num_boxes = 0 if batch.boxes is None else batch.boxes.shape[1]
        visual = states.new_zeros(batch.batch_size, num_boxes, states.shape[-1])
        if num_boxes:
            row, position = (batch.element_kind == IMG).nonzero(as_tuple=True)
            visual = visual.index_put((row, batch.roi_index[row, position]), states[row, position])
        visual_mask = (batch.box_valid if batch.box_valid is not None
                       else states.new_zeros(batch.batch_size, 0, dtype=torch.bool))
        return EncoderOutput(text_states=states, text_mask=(batch.element_kind == TEXT) & batch.attention_mask,
                             visual_states=visual, visual_mask=visual_mask, pooled=states[:, 0],
                             roi_features=roi_features)

    def forward(self, batch: ModelBatch, roi_features: torch.Tensor | None = None,
                rows_per_image: int = 1) -> EncoderOutput:
        return self.encode(batch, roi_features, rows_per_image)

    def head_spec(self) -> HeadSpec:
        c = self.config
        return HeadSpec(text_width=c.hidden_size, visual_width=c.hidden_size, pooled_width=c.hidden_size,
                        dropout=c.hidden_dropout_prob, hidden_act=c.hidden_act, layer_norm_eps=c.layer_norm_eps,
                        layout=c.task_heads, answer_readout="pooled")


HEAD_NAMES = ("mlm", "relationship")


def relationship_head(config: ToyConfig) -> nn.Module:
    return nn.Linear(config.hidden_size, 2)   # logit 1: the caption describes the image


class ToyPretrainingHeads(nn.Module):
    def __init__(self, config: ToyConfig, word_embeddings: nn.Embedding, relationship: bool):
        super().__init__()
        self.mlm = MLMHead(config, word_embeddings)
        self.relationship = relationship_head(config) if relationship else None
        init_new_parameters(self)

    def load_from_bert(self, spec: str) -> bool:
        state = load_bert_mlm_head_state(spec)
        if state:
            self.mlm.load_bert_state(state)
        return bool(state)


class ToyForPretraining(nn.Module):
    """Masked words on the captions and caption-image matching from `pooled`; no RoI task, no text corpus."""

    def __init__(self, model: ToyModel, setting: PretrainSetting):
        super().__init__()
        if setting.masked_roi_cls or setting.text_corpus:
            raise ValueError(f"pre-training setting {setting.name!r}: the toy family trains masked words and "
                             "caption-image matching only")
        self.model, self.setting = model, setting
        self.heads = ToyPretrainingHeads(model.config, model.word_embeddings(), setting.relationship)

    def load_heads(self, directory) -> dict[str, bool]:
        return load_pretraining_heads(self.heads, directory, HEAD_NAMES)

    def forward(self, batch, normalisers: torch.Tensor | None = None,
                roi_features: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        output = self.model.encode(batch.inputs, roi_features=roi_features)
        book = TaskLosses(target_counts(batch) if normalisers is None else normalisers)
        if self.setting.mlm_visual:
            words = batch.mlm_labels != IGNORE_INDEX
            logits = self.heads.mlm(output.text_states[words]).float()
            labels = batch.mlm_labels[words]
            book.add("mlm", F.cross_entropy(logits, labels, reduction="none"), logits.argmax(-1) == labels)
        if self.heads.relationship is not None:
            labelled = batch.relationship_labels != IGNORE_INDEX
            logits = self.heads.relationship(output.pooled[labelled]).float()
            labels = batch.relationship_labels[labelled]
            book.add("rel", F.cross_entropy(logits, labels, reduction="none"), logits.argmax(-1) == labels)
        return book.result()


ALIGNMENT_READOUT = AlignmentReadout("relationship", HEAD_NAMES, relationship_head, lambda output: output.pooled,
                                     matched_index=1)

TOY = Family(model_type="toy", display_name="Toy", model_class=ToyModel, config_builder=build_toy_config,
             pretraining_module=ToyForPretraining, alignment_readout=ALIGNMENT_READOUT)
# a pre-training setting names the family it trains (vlbert_core/pretrain/settings.py)
TOY_SETTING = PretrainSetting("toy", mlm_visual=True, masked_roi_cls=False, relationship=True, text_corpus=False,
                              tune_frcnn=False, model_type="toy")


@pytest.fixture(scope="module")
def toy_family():
    """The record and its setting, registered for this module only."""
    register_family(TOY)
    SETTINGS[TOY_SETTING.name] = TOY_SETTING
    try:
        yield TOY
    finally:
        del SETTINGS[TOY_SETTING.name]
        unregister_family(TOY.model_type)


# ---- the runs ---------------------------------------------------------------------------------------------------

PRETRAIN_CFG = {"steps": 4, "cc_batch_size": 2, "text_batch_size": 2, "lr_per_sample": 1e-4, "weight_decay": 0.01,
                "warmup_steps": 1, "clip_grad": 1.0, "max_text_len": 16, "max_caption_len": 12, "checkpoint_every": 2,
                "streams_per_rank": 1, "stream_workers": False, "held_out_per_shard": 1}
SELECT = {"score_threshold": 0.5, "min_boxes": 3, "max_boxes": 6, "nms_iou": 0.3, "batch_size": 2, "num_workers": 0}


@pytest.fixture(scope="module")
def pretrained(toy_family, world, module_tmp_path) -> Path:
    """The toy pre-trained on the ci world's CC shards and RoIs (4 steps), through the library's entry."""
    from vlbert_core.pretrain import pretrain

    out = module_tmp_path / "pretrained"
    model_cfg = {"bert_path": world["bert"], "num_hidden_layers": 1, "geometry_dim": 16, "max_rois": 4,
                 "image_max_side": 48, "frozen_stages": 2, "freeze_bn": True}
    pretrain(TOY_SETTING.name, world["cc"], world["rois"], world["text"], world["detector"], model_cfg, PRETRAIN_CFG,
             str(out), seed=7, device="cpu")
    return out


@pytest.fixture(scope="module")
def vqa_sources(module_tmp_path) -> dict:
    """VQA's files for a train and a val split (3 questions on 2 images each) and the train split's RoIs."""
    root = module_tmp_path / "vqa_world"
    sources = {"questions": str(root / "vqa/v2_OpenEnded_mscoco_{split}2014_questions.json"),
               "annotations": str(root / "vqa/v2_mscoco_{split}2014_annotations.json"),
               "images": str(root / "coco/{split}2014")}
    (root / "vqa").mkdir(parents=True)
    for split, first_image in (("train", 1), ("val", 10)):
        _, _, questions, annotations = _vqa_files(root / "vqa", split)
        for q, a in zip(questions["questions"], annotations["annotations"]):
            q["image_id"] = a["image_id"] = q["image_id"] - 1 + first_image
        Path(sources["questions"].format(split=split)).write_text(json.dumps(questions))
        Path(sources["annotations"].format(split=split)).write_text(json.dumps(annotations))
        keys = {}
        for image_id in (first_image, first_image + 1):
            key = f"COCO_{split}2014_{image_id:012d}"
            _scene(Path(sources["images"].format(split=split)) / f"{key}.jpg", BOXES, image_id)
            keys[key] = DETECTED
        _write_rois(root / f"rois/vqa/{split}.parquet", keys)
    return {**sources, "train_rois": str(root / "rois/vqa/train.parquet")}


def test_the_toy_family_is_built_from_the_common_pieces_only():
    imported = set()
    for node in ast.walk(ast.parse(Path(__file__).read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module)
        elif isinstance(node, ast.Import):
            imported.update(alias.name for alias in node.names)
    family_packages = [m for m in imported if m.startswith(("vlbert_core.models.vlbert", "vlbert_core.models.vilbert"))]
    assert family_packages == []
    assert {m for m in imported if m.startswith("vlbert_core.models.")} <= {
        "vlbert_core.models.registry", *(m for m in imported if m.startswith("vlbert_core.models.common."))}


def test_a_family_is_one_record_and_unregisters(toy_family):
    assert family("toy") is TOY and [f.display_name for f in families()] == ["VL-BERT", "ViLBERT", "Toy"]
    assert TOY.config_class is ToyConfig and TOY.load("alignment_readout") is ALIGNMENT_READOUT
    other = register_family(Family(model_type="toy2", display_name="Toy 2", model_class=ToyModel,
                                   config_builder=build_toy_config, pretraining_module=ToyForPretraining,
                                   alignment_readout=ALIGNMENT_READOUT))
    assert unregister_family("toy2") is other and "toy2" not in [f.model_type for f in families()]
    with pytest.raises(ValueError, match="unknown model type 'toy2'"):
        unregister_family("toy2")


def test_the_toy_family_pretrains_through_the_library(pretrained):
    from vlbert_core.models.registry import from_pretrained
    from vlbert_core.utils import load_safetensors

    model = from_pretrained(pretrained)
    assert type(model) is ToyModel and model.config.num_hidden_layers == 1
    assert json.loads((pretrained / "config.json").read_text())["model_type"] == "toy"
    rows = [json.loads(line) for line in (pretrained / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert all({"mlm_loss", "rel_loss"} <= set(r) and "roi_loss" not in r for r in rows)
    assert {key.split(".")[0] for key in load_safetensors(pretrained / "heads.safetensors")} == set(HEAD_NAMES)
    clue = json.loads((pretrained / "visual_clue.json").read_text())
    assert clue["setting"] == "toy" and clue["with_image"]["masked_tokens"] > 0


def test_the_toy_family_fine_tunes_and_predicts(pretrained, vqa_sources, world, tmp_path):
    from vlbert_core.predict import Predictor
    from vlbert_core.tasks import vqa as vqa_lib
    from vlbert_core.tasks.finetune import finetune, load_finetuned

    sources = {k: v for k, v in vqa_sources.items() if k != "train_rois"}
    meta = finetune("vqa", pretrained, tmp_path / "vqa", setting=TOY_SETTING.name, schedule="half",
                    schedule_factor=1.0, hparams={**HPARAMS, "lr": 1e-2}, tune_frcnn=False, model_cfg=MODEL_CFG,
                    sources=sources, rois_paths=[vqa_sources["train_rois"]], seed=0)
    assert meta["num_train_examples"] == 3
    rows = [json.loads(line) for line in (tmp_path / "vqa/metrics.jsonl").read_text().splitlines()]
    assert rows and all(r["loss"] == r["loss"] for r in rows)
    model, _ = load_finetuned(tmp_path / "vqa")
    assert type(model.encoder) is ToyModel

    questions = vqa_lib.load_vqa(sources["questions"].format(split="val"))
    images = Path(sources["images"].format(split="val"))
    queries = [{"image": str(images / f"{q.image_key}.jpg"), "text": q.question} for q in questions]
    predictor = Predictor(tmp_path / "vqa", task="vqa", detector=world["detector"], select=SELECT)
    assert type(predictor.model.encoder) is ToyModel
    results = predictor.predict(queries, top_k=2)
    vocabulary = set(meta["answers"])
    assert len(results) == len(queries) == 3
    for result, query in zip(results, queries):
        assert (result["image"], result["text"]) == (query["image"], query["text"])
        scores = [a["score"] for a in result["answers"]]
        assert {a["answer"] for a in result["answers"]} <= vocabulary
        assert len(scores) == 2 and scores == sorted(scores, reverse=True) and all(0 < s < 1 for s in scores)
