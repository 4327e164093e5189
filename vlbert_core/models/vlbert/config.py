"""The VL-BERT configuration: the BERT part read from the initialising checkpoint, plus the visual part."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Mapping

from vlbert_core.detector.resnet_c4 import ROI_OUTPUT_SIZE, ROI_SAMPLING_RATIO

from vlbert_core.typed_settings import read_fields

from ..common.bert_init import read_bert_config
from ..common.config import (TASK_HEAD_LAYOUTS, BertFieldsConfig, ModelBuildKeys, bert_fields_from_hf_config,
                             visual_backbone)
from ..common.inputs import TEXT_ONLY_LAYOUTS

# Segments: sentence A = 0, sentence B = 1, visual elements and [END] = 2.
NUM_SEGMENTS = 3
GEOMETRY_ENCODINGS = ("corners", "centre_size")
SENTENCE_READOUTS = ("cls", "text_mean")
# model-config keys of the released-architecture options (config/schema.yaml `model:`), with the VLBertConfig
# field each sets; `build_vlbert_config` copies them.
RELEASED_OPTION_KEYS = ("geometry_encoding", "end_visual_term", "text_only_visual_norm", "text_only_layout",
                        "masked_roi_input", "roi_sampling_ratio", "roi_cls_layer_norm", "task_heads")
MASKED_ROI_INPUTS = ("pixels", "feature")


@dataclass
class VLBertConfig(BertFieldsConfig):
    """The BERT fields (BertFieldsConfig), then the visual part."""

    model_type: ClassVar[str] = "vlbert"
    family_name: ClassVar[str] = "VL-BERT"
    released_option_keys: ClassVar[tuple[str, ...]] = RELEASED_OPTION_KEYS

    # visual part
    visual_backbone: dict = field(default_factory=dict)  # the detector's `backbone` config
    appearance_dim: int = 128        # RoI head output size (128 small, 2048 ResNet-50/101)
    geometry_dim: int = 2048         # sin/cos geometry embedding size (paper: 2048)
    num_object_classes: int = 1      # detector classes incl. background (soft RoI labels)
    roi_align_size: int = ROI_OUTPUT_SIZE
    tune_frcnn: bool = False         # train stages 3-5 of the visual network
    frozen_stages: int = 2
    freeze_bn: bool = True
    # Starting weights of the LayerNorms that gate the visual term (released: 0.0, so training starts from BERT).
    visual_scale_text_init: float = 0.0
    visual_scale_object_init: float = 0.0
    # Z-score each appearance dimension with statistics of the visual network's RoI features before the
    # visual FC (released: off, raw features). See VisualFeatureEmbedding.
    standardise_appearance: bool = False
    # Details where the released code differs from this project's defaults (docs/released-architecture.md;
    # config/paper_*.yaml sets the released values):
    # how a box enters the geometry embedding: "corners" (x1/W, y1/H, x2/W, y2/H, as the paper writes) or
    # "centre_size" ((x1+x2)/2W, (y1+y2)/2H, (x2-x1)/W, (y2-y1)/H, common/utils/bbox.py)
    geometry_encoding: str = "corners"
    # whether [END] adds box 0's visual term like the words (ours) or is its token embedding only (released)
    end_visual_term: bool = True
    # whether a text-only sample's visual vector passes the words' visual LayerNorm (released
    # aux_text_visual_embedding -> visual_ln_text) or is added as it is (ours)
    text_only_visual_norm: bool = False
    # how a text-only sample is laid out (models/common/inputs.py TEXT_ONLY_LAYOUTS): "bert", [CLS] text [SEP] (ours),
    # or "released", the word pieces then [END] at position id T+1
    text_only_layout: str = "bert"
    # how a masked RoI reaches the model in masked RoI classification: "pixels", its pixels zeroed before the
    # visual network (paper; released e2e MASK_RAW_PIXELS), or "feature", its appearance feature replaced by a
    # learned vector (VisualFeatureEmbedding.masked_appearance; the released "prec" models, whose RoI features
    # were precomputed: object_mask_visual_embedding)
    masked_roi_input: str = "pixels"
    # RoIAlign bilinear samples per bin side (released ROIAlign: sampling_ratio 1)
    roi_sampling_ratio: int = ROI_SAMPLING_RATIO
    # the masked-RoI classification head's transform: dense -> act -> LayerNorm (ours, as BERT's MLM head)
    # or dense -> act (released VisualLinguisticBertMVRCHeadTransform)
    roi_cls_layer_norm: bool = True
    # task heads' layer structure: "project" (tasks/modeling/*, this project's) or "released" (the authors'
    # VQA 'mlm' classifier, RefCOCO+ MVRC-transform head, VCR pooler + 1fc head)
    task_heads: str = "project"
    # what a sentence-level task head (VCR, a config-declared classifier) reads: "cls", the [CLS] output (paper,
    # released), or "text_mean", the mean output of the text elements: the sentence vector of a checkpoint trained
    # with mean pooling, whose [CLS] output may carry nothing (finetune.sentence_readout, docs/default-run.md)
    sentence_readout: str = "cls"
    bert_path: str = ""              # spec the weights/vocab came from

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"VLBertConfig: hidden_size {self.hidden_size} is not a multiple of "
                             f"num_attention_heads {self.num_attention_heads}")
        if self.num_hidden_layers < 1:
            raise ValueError(f"VLBertConfig: num_hidden_layers must be >= 1, got {self.num_hidden_layers}")
        if self.geometry_dim % 8:
            # 4 coordinates x (sin, cos) x geometry_dim/8 wavelengths
            raise ValueError(f"VLBertConfig: geometry_dim must be a multiple of 8, got {self.geometry_dim}")
        if self.num_object_classes < 1 or self.appearance_dim < 1:
            raise ValueError(f"VLBertConfig: num_object_classes ({self.num_object_classes}) and appearance_dim "
                             f"({self.appearance_dim}) must be >= 1")
        if self.geometry_encoding not in GEOMETRY_ENCODINGS:
            raise ValueError(f"VLBertConfig: geometry_encoding must be one of {GEOMETRY_ENCODINGS}, got "
                             f"{self.geometry_encoding!r}")
        if self.text_only_layout not in TEXT_ONLY_LAYOUTS:
            raise ValueError(f"VLBertConfig: text_only_layout must be one of {TEXT_ONLY_LAYOUTS}, got "
                             f"{self.text_only_layout!r}")
        if self.masked_roi_input not in MASKED_ROI_INPUTS:
            raise ValueError(f"VLBertConfig: masked_roi_input must be one of {MASKED_ROI_INPUTS}, got "
                             f"{self.masked_roi_input!r}")
        if self.task_heads not in TASK_HEAD_LAYOUTS:
            raise ValueError(f"VLBertConfig: task_heads must be one of {TASK_HEAD_LAYOUTS}, got {self.task_heads!r}")
        if self.sentence_readout not in SENTENCE_READOUTS:
            raise ValueError(f"VLBertConfig: sentence_readout must be one of {SENTENCE_READOUTS}, got "
                             f"{self.sentence_readout!r}")
        if self.roi_sampling_ratio < 0:
            raise ValueError(f"VLBertConfig: roi_sampling_ratio must be >= 0 (0: adaptive), got {self.roi_sampling_ratio}")
        if not 0 <= self.frozen_stages <= 5:
            raise ValueError(f"VLBertConfig: frozen_stages must be in 0..5, got {self.frozen_stages}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


def build_vlbert_config(model_cfg: Mapping[str, Any], detector_meta: Mapping[str, Any], *, tune_frcnn: bool) -> VLBertConfig:
    """VLBertConfig from the config's `model:` section, the BERT checkpoint and the detector checkpoint."""
    keys, own = ModelBuildKeys.from_config(model_cfg), VLBertModelKeys.from_config(model_cfg)
    backbone, appearance_dim = visual_backbone(model_cfg, detector_meta)
    return VLBertConfig(
        **bert_fields_from_hf_config(read_bert_config(keys.bert_path), keys.num_hidden_layers),
        visual_backbone=backbone, appearance_dim=appearance_dim, geometry_dim=keys.geometry_dim,
        num_object_classes=int(detector_meta["num_classes"]) + 1,  # + background, as in the RoI class scores
        tune_frcnn=tune_frcnn, frozen_stages=keys.frozen_stages, freeze_bn=keys.freeze_bn,
        bert_path=keys.bert_path,
        visual_scale_text_init=own.visual_scale_text_init,
        visual_scale_object_init=own.visual_scale_object_init,
        standardise_appearance=own.standardise_appearance,
        **{k: model_cfg[k] for k in RELEASED_OPTION_KEYS if model_cfg.get(k) is not None},
    )


@dataclass(frozen=True)
class VLBertModelKeys:
    """VL-BERT's own keys of the `model:` section (the visual term's initial scales, the appearance
    standardisation), typed."""

    visual_scale_text_init: float = 0.0
    visual_scale_object_init: float = 0.0
    standardise_appearance: bool = False

    @classmethod
    def from_config(cls, mapping: Mapping[str, Any], where: str = "model") -> "VLBertModelKeys":
        return cls(**read_fields(cls, mapping, where))
