"""The ViLBERT configuration: a BERT text stream, a visual stream, the co-attention layers that join them, and the
visual network (the same Fast R-CNN network and config fields as VL-BERT's, so both families see the same RoI
features).

Field names follow the authors' BertConfig (facebookresearch/vilbert-multi-task, vilbert/vilbert.py) where they
have one; the defaults of the two-stream part are the released config/bert_base_6layer_6conect.json.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Mapping

from vlbert_core.detector.resnet_c4 import ROI_OUTPUT_SIZE, ROI_SAMPLING_RATIO

from ..common.bert_init import read_bert_config
from ..common.config import (TASK_HEAD_LAYOUTS, BertFieldsConfig, ModelBuildKeys, bert_fields_from_hf_config,
                             visual_backbone)

MODEL_TYPE = "vilbert"
# how the two pooled vectors become one (the authors' fusion_method): their elementwise product (released) or sum
FUSION_METHODS = ("mul", "sum")
# what the first (global) region, the visual pooler's input, is: the visual network's feature of the whole-image
# box at that box's location (this project's), or the mean of the other regions' features at location
# (0, 0, 1, 1, 1), what the released models were trained on (vilbert/datasets/_image_features_reader.py)
GLOBAL_REGIONS = ("whole_image_box", "mean_of_regions")
# Task tokens (the authors' multi-task models, task_specific_tokens): their BertEmbeddings' table has 20 rows, and a
# task's id is the number n of its TASK<n> in vilbert-multi-task's vilbert_tasks.yml (task_utils.py feeds
# int(task_id[4:]) as every row's task token)
TASK_TOKEN_COUNT = 20
AUTHORS_TASK_IDS = {"VQA": 1, "GenomeQA": 2, "VisualDialog": 3, "Visual7w": 4, "VCR_Q-A": 5, "VCR_QA-R": 6,
                    "RetrievalCOCO": 7, "RetrievalFlickr30k": 8, "refcoco": 9, "refcoco+": 10, "refcocog": 11,
                    "NLVR2": 12, "VisualEntailment": 13, "GuessWhat": 14, "GQA": 15, "Foil": 16,
                    "GuessWhatPointing": 17, "FlickrGrounding": 18}
# this pipeline's fine-tuning tasks -> the authors' task of the same data (our retrieval is Flickr30k's, our
# refcoco RefCOCO+)
PIPELINE_AUTHORS_TASKS = {"vqa": "VQA", "vcr_q2a": "VCR_Q-A", "vcr_qa2r": "VCR_QA-R", "retrieval": "RetrievalFlickr30k",
                          "refcoco": "refcoco+"}


def task_token_id(task: str) -> int:
    """The task token the authors' code feeds for this pipeline's task `task`."""
    if task not in PIPELINE_AUTHORS_TASKS:
        raise ValueError(f"no task token of the authors' multi-task ViLBERT for task {task!r}; the tasks that have "
                         f"one are {list(PIPELINE_AUTHORS_TASKS)}")
    return AUTHORS_TASK_IDS[PIPELINE_AUTHORS_TASKS[task]]


@dataclass
class ViLBertConfig(BertFieldsConfig):
    """The text stream's BERT fields (BertFieldsConfig; its layer_norm_eps is every LayerNorm's of the model, as
    the authors hard-code BERT's 1e-12), then the rest."""

    model_type: ClassVar[str] = MODEL_TYPE
    family_name: ClassVar[str] = "ViLBERT"

    type_vocab_size: int = 2         # BERT token types: sentence A = 0, B = 1
    # visual stream: v_num_hidden_layers BERT-like layers over the regions
    v_hidden_size: int = 1024
    v_num_hidden_layers: int = 6
    v_num_attention_heads: int = 8
    v_intermediate_size: int = 1024
    v_hidden_act: str = "gelu"
    v_hidden_dropout_prob: float = 0.1
    v_attention_probs_dropout_prob: float = 0.1
    # co-attention ("connection") layers: one per (v_biattention_id[k], t_biattention_id[k]) pair; the k-th runs
    # after visual layers < v_biattention_id[k] and text layers < t_biattention_id[k] (ViLBertEncoder)
    bi_hidden_size: int = 1024
    bi_num_attention_heads: int = 8
    v_biattention_id: list = field(default_factory=lambda: [0, 1, 2, 3, 4, 5])
    t_biattention_id: list = field(default_factory=lambda: [6, 7, 8, 9, 10, 11])
    with_coattention: bool = True    # False: the co-attention layers are skipped (the streams meet at the pooler only)
    fusion_method: str = "mul"
    global_region: str = "whole_image_box"   # GLOBAL_REGIONS
    # task tokens: whether a task embedding follows [CLS] (text outputs one longer), the table's size, and the id
    # `encode` feeds (task_token_id of the task the model is used for; required when task_specific_tokens)
    task_specific_tokens: bool = False
    task_token_count: int = TASK_TOKEN_COUNT
    task_id: int | None = None
    # visual network: the same fields, names and defaults as VLBertConfig's (FastRCNNVisualNetwork reads them);
    # appearance_dim is the authors' v_feature_size and num_object_classes their v_target_size (the detector's
    # classes incl. background, the masked-region head's targets)
    visual_backbone: dict = field(default_factory=dict)
    appearance_dim: int = 128
    num_object_classes: int = 1
    roi_align_size: int = ROI_OUTPUT_SIZE
    tune_frcnn: bool = False
    frozen_stages: int = 2
    freeze_bn: bool = True
    roi_sampling_ratio: int = ROI_SAMPLING_RATIO
    # task heads' layer structure (vlbert_core/tasks/modeling, HeadSpec.layout)
    task_heads: str = "project"
    bert_path: str = ""              # spec the text weights / vocabulary came from

    def __post_init__(self) -> None:
        self.v_biattention_id = [int(i) for i in self.v_biattention_id]
        self.t_biattention_id = [int(i) for i in self.t_biattention_id]
        self.validate()

    def validate(self) -> None:
        for width, heads in (("hidden_size", "num_attention_heads"), ("v_hidden_size", "v_num_attention_heads"),
                             ("bi_hidden_size", "bi_num_attention_heads")):
            if getattr(self, heads) < 1 or getattr(self, width) % getattr(self, heads):
                raise ValueError(f"ViLBertConfig: {width} {getattr(self, width)} is not a multiple of {heads} "
                                 f"{getattr(self, heads)}")
        if self.num_hidden_layers < 1 or self.v_num_hidden_layers < 1:
            raise ValueError(f"ViLBertConfig: num_hidden_layers ({self.num_hidden_layers}) and v_num_hidden_layers "
                             f"({self.v_num_hidden_layers}) must be >= 1")
        if self.type_vocab_size < 2:
            raise ValueError(f"ViLBertConfig: type_vocab_size must be >= 2 (sentences A and B), got "
                             f"{self.type_vocab_size}")
        self._validate_coattention_ids()
        if self.global_region not in GLOBAL_REGIONS:
            raise ValueError(f"ViLBertConfig: global_region must be one of {GLOBAL_REGIONS}, got "
                             f"{self.global_region!r}")
        if self.fusion_method not in FUSION_METHODS:
            raise ValueError(f"ViLBertConfig: fusion_method must be one of {FUSION_METHODS}, got "
                             f"{self.fusion_method!r}")
        if self.task_token_count < 1 or (self.task_id is not None
                                         and not 0 <= self.task_id < self.task_token_count):
            raise ValueError(f"ViLBertConfig: task_id {self.task_id} must be in 0..task_token_count - 1 "
                             f"({self.task_token_count - 1})")
        if self.num_object_classes < 1 or self.appearance_dim < 1:
            raise ValueError(f"ViLBertConfig: num_object_classes ({self.num_object_classes}) and appearance_dim "
                             f"({self.appearance_dim}) must be >= 1")
        if self.task_heads not in TASK_HEAD_LAYOUTS:
            raise ValueError(f"ViLBertConfig: task_heads must be one of {TASK_HEAD_LAYOUTS}, got {self.task_heads!r}")
        if self.roi_sampling_ratio < 0:
            raise ValueError(f"ViLBertConfig: roi_sampling_ratio must be >= 0 (0: adaptive), got "
                             f"{self.roi_sampling_ratio}")
        if not 0 <= self.frozen_stages <= 5:
            raise ValueError(f"ViLBertConfig: frozen_stages must be in 0..5, got {self.frozen_stages}")

    def _validate_coattention_ids(self) -> None:
        v_ids, t_ids = self.v_biattention_id, self.t_biattention_id
        if not v_ids or len(v_ids) != len(t_ids):
            raise ValueError(f"ViLBertConfig: v_biattention_id {v_ids} and t_biattention_id {t_ids} must be "
                             "non-empty and of one length (one co-attention layer per pair)")
        for name, ids, layers, layers_name in (("v_biattention_id", v_ids, self.v_num_hidden_layers,
                                                "v_num_hidden_layers"),
                                               ("t_biattention_id", t_ids, self.num_hidden_layers,
                                                "num_hidden_layers")):
            # decreasing ids would make the authors' loop run some layers twice; ids are layer indices
            if any(b < a for a, b in zip(ids, ids[1:])) or ids[0] < 0 or ids[-1] >= layers:
                raise ValueError(f"ViLBertConfig: {name} {ids} must be non-decreasing layer indices below "
                                 f"{layers_name} {layers}")

    @property
    def num_coattention_layers(self) -> int:
        return len(self.v_biattention_id)


def build_vilbert_config(model_cfg: Mapping[str, Any], detector_meta: Mapping[str, Any], *,
                         tune_frcnn: bool) -> ViLBertConfig:
    """ViLBertConfig from the config's `model:` section (its `vilbert:` sizes), the BERT checkpoint (the text
    stream, cut to num_hidden_layers as VL-BERT's) and the detector checkpoint (the same visual network)."""
    keys = ModelBuildKeys.from_config(model_cfg)
    backbone, appearance_dim = visual_backbone(model_cfg, detector_meta)
    bert = read_bert_config(keys.bert_path)
    return ViLBertConfig(
        **bert_fields_from_hf_config(bert, keys.num_hidden_layers),
        type_vocab_size=int(bert.get("type_vocab_size", 2)),
        **dict(model_cfg.get("vilbert") or {}),
        visual_backbone=backbone, appearance_dim=appearance_dim,
        num_object_classes=int(detector_meta["num_classes"]) + 1,  # + background, as in the RoI class scores
        tune_frcnn=tune_frcnn, frozen_stages=keys.frozen_stages, freeze_bn=keys.freeze_bn,
        bert_path=keys.bert_path,
        **{k: model_cfg[k] for k in ("roi_sampling_ratio", "task_heads") if model_cfg.get(k) is not None},
    )
