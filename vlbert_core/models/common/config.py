"""What every family's configuration shares: the BERT fields read from the initialising checkpoint, their
to_dict / from_dict, and the pieces a config builder takes from a run's `model:` section and detector."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar, Mapping

from vlbert_core.typed_settings import read_fields, source_field

# the BERT fields, read from the initialising checkpoint: required in every config
BERT_KEYS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
             "hidden_act", "hidden_dropout_prob", "attention_probs_dropout_prob", "max_position_embeddings",
             "layer_norm_eps")
# task heads' layer structure (vlbert_core/tasks/modeling, HeadSpec.layout)
# "project": this project's heads; "released": the heads of VL-BERT's released fine-tuned checkpoints
# (jackroos/VL-BERT); "vilbert_released": those of ViLBERT's (facebookresearch/vilbert-multi-task VILBertForVLTasks);
# "vilbert_beta_released": those of the ViLBERT paper's single-task ones (jiasenlu/vilbert_beta)
TASK_HEAD_LAYOUTS = ("project", "released", "vilbert_released", "vilbert_beta_released")
# the run config's `model:` keys every config builder reads


@dataclass
class BertFieldsConfig:
    """The BERT part of a family's config (read from the checkpoint's config.json, then num_hidden_layers
    possibly reduced). A family's config derives from it, adding its own fields after these, and names its
    `model_type` and `family_name`."""

    model_type: ClassVar[str]
    family_name: ClassVar[str]   # in from_dict's errors: "not a VL-BERT one"

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    hidden_act: str
    hidden_dropout_prob: float
    attention_probs_dropout_prob: float
    max_position_embeddings: int
    layer_norm_eps: float

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]):
        """The config of its to_dict(), or of a saved config.json (whose model_type, if given, must be the
        family's)."""
        d = dict(d)
        model_type = d.pop("model_type", cls.model_type)
        if model_type != cls.model_type:
            raise ValueError(f"{cls.__name__}.from_dict: a {model_type!r} config, not a {cls.family_name} one")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"{cls.__name__}.from_dict: unknown keys {unknown}")
        missing = [k for k in BERT_KEYS if k not in d]
        if missing:
            raise ValueError(f"{cls.__name__}.from_dict: missing keys {missing}")
        return cls(**d)


def bert_fields_from_hf_config(hf_config: Mapping[str, Any], num_hidden_layers: int | None = None) -> dict:
    """The BERT fields of a family's config from a transformers BERT config.json dict.

    `num_hidden_layers` keeps only the first k layers of the checkpoint (a config choice of the embedded
    world); it may not exceed the checkpoint's depth.
    """
    missing = [k for k in BERT_KEYS if k not in hf_config]
    if missing:
        raise ValueError(f"BERT config lacks keys {missing}")
    if hf_config.get("position_embedding_type", "absolute") != "absolute":
        raise ValueError(f"BERT config: only absolute position embeddings are supported, got "
                         f"{hf_config['position_embedding_type']!r}")
    fields = {k: hf_config[k] for k in BERT_KEYS}
    if num_hidden_layers is not None:
        if not 1 <= num_hidden_layers <= hf_config["num_hidden_layers"]:
            raise ValueError(f"model.num_hidden_layers={num_hidden_layers}: the BERT checkpoint has "
                             f"{hf_config['num_hidden_layers']} layers")
        fields["num_hidden_layers"] = int(num_hidden_layers)
    return fields


def visual_pixel_format(config) -> str:
    """The pixel format the visual network's weights expect (detector/pixels.py): its backbone's (any family's
    config: they all have `visual_backbone`)."""
    from vlbert_core.detector.pixels import DEFAULT_PIXEL_FORMAT

    return str(config.visual_backbone.get("pixel_format") or DEFAULT_PIXEL_FORMAT)


# ---- what a config builder takes from the run (a Family's config_builder) --------------------------------

@dataclass(frozen=True)
class ModelBuildKeys:
    """The keys of the config's `model:` section that every family's config builder reads, typed once: a
    missing key or a value of the wrong kind is an error naming it (typed_settings.read_fields)."""

    bert_path: str
    num_hidden_layers: int
    geometry_dim: int
    max_rois: int
    image_max_side: int
    frozen_stages: int
    freeze_bn: bool
    visual_head_dilation: int | None = None
    visual_stem_pool: str | None = None

    @classmethod
    def from_config(cls, mapping: Mapping[str, Any], where: str = "model") -> "ModelBuildKeys":
        return cls(**read_fields(cls, mapping, where))


def visual_backbone(model_cfg: Mapping[str, Any], detector_meta: Mapping[str, Any]) -> tuple[dict, int]:
    """(the visual network's backbone config, its RoI feature size): the detector's, with the config's changes."""
    from vlbert_core.detector.resnet_c4 import build_resnet_c4

    keys = ModelBuildKeys.from_config(model_cfg)
    backbone = {k: v for k, v in dict(detector_meta["config"]["backbone"]).items() if k != "init_weights"}
    if keys.visual_head_dilation is not None:
        # released: the detector's stage 5 re-used per RoI at stride 1, dilation 2 (IMAGE_C5_DILATED)
        backbone["head_dilation"] = keys.visual_head_dilation
    if keys.visual_stem_pool is not None:
        # released: VL-BERT's own ResNet pools its stem the torchvision way, though its weights are the Caffe
        # detector's (resnet101-pt-vgbua)
        backbone["stem_pool"] = keys.visual_stem_pool
    _, _, _, appearance_dim = build_resnet_c4(backbone)
    return backbone, appearance_dim


# ---- the run config's `model:` section, typed -----------------------------------------------------------

@dataclass(frozen=True)
class ModelSettings:
    """What the loops read of the config's `model:` section (the input sizes); `section` is the section as
    given, which the family's config builder reads (ModelBuildKeys and its own keys) and the resume fingerprints
    hash exactly as written (to_fingerprint)."""

    max_rois: int
    image_max_side: int
    image_min_side: int | None = None
    task_heads: str | None = None
    section: dict = source_field(default_factory=dict)

    @classmethod
    def from_config(cls, mapping: Mapping[str, Any], where: str = "model") -> "ModelSettings":
        return cls(**read_fields(cls, mapping, where), section=dict(mapping))

    @classmethod
    def of(cls, value: "ModelSettings | Mapping[str, Any]", where: str = "model") -> "ModelSettings":
        """`value` itself, or the settings of a `model:` mapping (hand-written calls, tests)."""
        return value if isinstance(value, cls) else cls.from_config(value, where)

    def to_fingerprint(self) -> dict:
        return dict(self.section)
