"""The model families the pipeline trains: one `Family` record per `model_type`, the one place that knows them.

A family is a package vlbert_core/models/<family>/ whose model class has `model_type` (its name in the
pre-training settings, vlbert_core/pretrain/settings.py, and in the `model_type` of every config.json it saves), a
`config_class` (`from_dict` / `to_dict`) and what the pipeline asks of it (models/common/pretrained.py
PretrainedModel: `save_pretrained`, `from_pretrained`, `from_bert`; `visual_network`, `encode(batch,
roi_features=None, rows_per_image=1) -> EncoderOutput` and `head_spec() -> HeadSpec`, models/common/output.py).
Code outside a family package reaches it through its record here only, so fine-tuning, prediction, pre-training,
the tables and the converters name no family. The record names its parts as "module:attr" strings, imported on
first use, so that importing the registry stays cheap and imports no torch. docs/models.md compares the families
and says how to add a third (`register_family`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from importlib import import_module
from pathlib import Path
from typing import Any, Mapping

from .common.pretrained import CONFIG_FILE, pop_model_type, read_config

__all__ = ["Family", "build_model", "families", "family", "from_pretrained", "model_class", "model_types",
           "read_config", "register_family", "resolve", "split_model_type", "unregister_family"]


def resolve(target: Any) -> Any:
    """The object a "module:attr" string names (a "module" string: the module), imported now; anything else is
    the object itself."""
    if not isinstance(target, str):
        return target
    module, _, attr = target.partition(":")
    return getattr(import_module(module), attr) if attr else import_module(module)


@dataclass(frozen=True)
class Family:
    """A model family: each part a "module:attr" string (resolved by `load`) or the object itself.

    model_class: the nn.Module class (PretrainedModel); config_builder: (model_cfg, detector_meta, *, tune_frcnn)
    -> its config, how a pre-training run builds one from the run's config; pretraining_module: (model, setting)
    -> the model with its pre-training heads, forward(batch) -> losses (pretrain/objectives.py); alignment_readout:
    where its pre-training caption-image head lives (models/common/heads.py AlignmentReadout), read by zero-shot
    retrieval; display_name: its name in tables and messages; converter: the module of its `python -m
    vlbert_core.convert` subcommand (COMMAND, add_parser(subparsers), run(args)), or None."""

    model_type: str
    display_name: str
    model_class: Any
    config_builder: Any
    pretraining_module: Any
    alignment_readout: Any
    converter: Any = None

    def load(self, part: str) -> Any:
        """The object the record's `part` (a field name) names."""
        return resolve(getattr(self, part))

    @property
    def config_class(self) -> type:
        return self.load("model_class").config_class


_FAMILIES: dict[str, Family] = {}


def register_family(record: Family) -> Family:
    """Add (or replace) the family of `record.model_type`: how a family defined outside the library joins."""
    _FAMILIES[record.model_type] = record
    return record


def unregister_family(model_type: str) -> Family:
    """Remove the family of `model_type` (a test's family, registered for the test only); returns its record."""
    return _FAMILIES.pop(family(model_type).model_type)


register_family(Family(
    model_type="vlbert", display_name="VL-BERT",
    model_class="vlbert_core.models.vlbert.model:VLBertModel",
    config_builder="vlbert_core.models.vlbert.config:build_vlbert_config",
    pretraining_module="vlbert_core.models.vlbert.pretraining:VLBertForPretraining",
    alignment_readout="vlbert_core.models.vlbert.pretraining:ALIGNMENT_READOUT",
    converter="vlbert_core.convert.vlbert.command"))
register_family(Family(
    model_type="vilbert", display_name="ViLBERT",
    model_class="vlbert_core.models.vilbert.model:ViLBertModel",
    config_builder="vlbert_core.models.vilbert.config:build_vilbert_config",
    pretraining_module="vlbert_core.models.vilbert.pretraining:ViLBertForPretraining",
    alignment_readout="vlbert_core.models.vilbert.pretraining:ALIGNMENT_READOUT",
    converter="vlbert_core.convert.vilbert.command"))


def model_types() -> tuple[str, ...]:
    return tuple(_FAMILIES)


def families() -> tuple[Family, ...]:
    return tuple(_FAMILIES.values())


def family(model_type: str) -> Family:
    if model_type not in _FAMILIES:
        raise ValueError(f"unknown model type {model_type!r}; the registered families are {list(_FAMILIES)}")
    return _FAMILIES[model_type]


def model_class(model_type: str) -> type:
    return family(model_type).load("model_class")


def _registered(model_type: str, where: str) -> str:
    if model_type not in _FAMILIES:
        raise ValueError(f"{where}: model_type {model_type!r} is not one of the registered families {list(_FAMILIES)}")
    return model_type


def split_model_type(config: Mapping[str, Any], where: str) -> tuple[str, dict]:
    """(model_type, the config's other fields) of a saved config dict, of a registered family."""
    model_type, fields = pop_model_type(config)
    return _registered(model_type, where), fields


def from_pretrained(directory: str | os.PathLike):
    """The model saved in `directory` (model.safetensors + config.json), as the class its model_type names."""
    model_type, _ = read_config(directory)
    return model_class(_registered(model_type, str(Path(directory) / CONFIG_FILE))).from_pretrained(directory)


def build_model(model_type: str, config_fields: Mapping[str, Any]):
    """A model of `model_type` from its config fields (random initialisation)."""
    cls = model_class(model_type)
    return cls(cls.config_class.from_dict(config_fields))
