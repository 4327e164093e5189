"""The model families the pipeline trains, behind one loader.

A family is a model class with `model_type` (its name in the pre-training settings, vlbert_core/pretrain/settings.py,
and in the `model_type` of every config.json it saves), a `config_class` (`from_dict` / `to_dict`),
`save_pretrained(directory)` and the classmethod `from_pretrained(directory)`, the names researchers know from
transformers, plus what the pipeline asks of it: `from_bert(config, detector_state_dict)`, `visual_network`,
`encode(batch, roi_features=None, rows_per_image=1) -> EncoderOutput` and `head_spec() -> HeadSpec`
(vlbert_core/model_output.py). `from_pretrained` here reads a directory's config.json and builds the right class,
so the code that loads a pre-trained model (fine-tuning, prediction, continued pre-training) names no family.
The families: VL-BERT (vlbert_core/model) and ViLBERT (vlbert_core/vilbert); docs/models.md compares them and
says how to add a third.
"""

from __future__ import annotations

import json
import os
from importlib import import_module
from pathlib import Path
from typing import Any, Mapping

MODEL_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
# model_type -> (module, class)
FAMILIES: dict[str, tuple[str, str]] = {"vlbert": ("vlbert_core.model.vlbert", "VLBertModel"),
                                        "vilbert": ("vlbert_core.vilbert.model", "ViLBertModel")}
# config.json files written before `model_type` existed hold a VL-BERT
LEGACY_MODEL_TYPE = "vlbert"


def model_types() -> tuple[str, ...]:
    return tuple(FAMILIES)


def model_class(model_type: str) -> type:
    if model_type not in FAMILIES:
        raise ValueError(f"unknown model type {model_type!r}; the registered families are {list(FAMILIES)}")
    module, name = FAMILIES[model_type]
    return getattr(import_module(module), name)


def split_model_type(config: Mapping[str, Any], where: str) -> tuple[str, dict]:
    """(model_type, the config's other fields) of a saved config dict."""
    fields = dict(config)
    model_type = fields.pop("model_type", LEGACY_MODEL_TYPE)
    if model_type not in FAMILIES:
        raise ValueError(f"{where}: model_type {model_type!r} is not one of the registered families {list(FAMILIES)}")
    return model_type, fields


def read_config(directory: str | os.PathLike) -> tuple[str, dict]:
    """(model_type, config fields) of a model directory's config.json."""
    path = Path(directory) / CONFIG_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: {directory} is not a model directory")
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not valid JSON: {exc}") from exc
    if not isinstance(config, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return split_model_type(config, str(path))


def from_pretrained(directory: str | os.PathLike):
    """The model saved in `directory` (model.safetensors + config.json), as the class its model_type names."""
    model_type, _ = read_config(directory)
    return model_class(model_type).from_pretrained(directory)


def build_model(model_type: str, config_fields: Mapping[str, Any]):
    """A model of `model_type` from its config fields (random initialisation)."""
    cls = model_class(model_type)
    return cls(cls.config_class.from_dict(config_fields))


def load_state_exactly(module, state: Mapping[str, Any], weights_path: str | os.PathLike,
                       config_path: str | os.PathLike) -> None:
    """Load `state` into `module` (built on the meta device: every tensor comes from the file); a key missing
    or left over is an error naming both files."""
    missing, unexpected = module.load_state_dict(dict(state), strict=False, assign=True)
    if missing or unexpected:
        raise ValueError(f"{weights_path} does not match {config_path}: missing {sorted(missing)[:8]}, unexpected "
                         f"{sorted(unexpected)[:8]}")


class PretrainedModel:
    """`save_pretrained` / `from_pretrained` of a family's model class (an nn.Module with `model_type`,
    `config_class` and `__init__(config)`), the one way every family's directory is written and read."""

    def save_pretrained(self, directory: str | os.PathLike) -> None:
        """model.safetensors and config.json (with its model_type) into `directory`."""
        from vlbert_core.utils import atomic_path, save_safetensors

        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        save_safetensors(self.state_dict(), directory / MODEL_FILE)
        with atomic_path(directory / CONFIG_FILE) as tmp:
            tmp.write_text(json.dumps({"model_type": self.model_type, **self.config.to_dict()}, indent=2,
                                      sort_keys=True) + "\n")

    @classmethod
    def from_pretrained(cls, directory: str | os.PathLike):
        """The model saved in `directory`; an error naming the file when it is missing, of another family or does
        not match its config."""
        import torch

        from vlbert_core.utils import load_safetensors

        directory = Path(directory)
        config_path, weights_path = directory / CONFIG_FILE, directory / MODEL_FILE
        if not weights_path.is_file():
            raise FileNotFoundError(f"{cls.__name__}.from_pretrained: {weights_path} does not exist")
        model_type, fields = read_config(directory)
        if model_type != cls.model_type:
            raise ValueError(f"{config_path}: a {model_type} model, not a {cls.model_type} one "
                             f"(vlbert_core.model_registry.from_pretrained builds any family)")
        try:
            config = cls.config_class.from_dict(fields)
        except (ValueError, TypeError) as exc:
            raise ValueError(f"{cls.__name__}.from_pretrained: {config_path}: {exc}") from exc
        with torch.device("meta"):  # every tensor comes from the file: no random init to throw away
            model = cls(config)
        load_state_exactly(model, load_safetensors(weights_path), weights_path, config_path)
        return model
