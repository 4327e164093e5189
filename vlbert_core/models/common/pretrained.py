"""What a family's model directory is (model.safetensors + config.json naming its model_type) and the one way
every family writes, reads and initialises one from BERT (`PretrainedModel`). Imports no torch until a model is
read: the registry, which command lines answering --help import, reads this module."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, ClassVar, Mapping

MODEL_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
# config.json files written before `model_type` existed hold a VL-BERT
LEGACY_MODEL_TYPE = "vlbert"


def pop_model_type(config: Mapping[str, Any]) -> tuple[str, dict]:
    """(model_type, the config's other fields) of a saved config dict, whichever family it names."""
    fields = dict(config)
    return fields.pop("model_type", LEGACY_MODEL_TYPE), fields


def read_config(directory: str | os.PathLike) -> tuple[str, dict]:
    """(model_type, config fields) of a model directory's config.json (the registry checks the family)."""
    path = Path(directory) / CONFIG_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: {directory} is not a model directory")
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not valid JSON: {exc}") from exc
    if not isinstance(config, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return pop_model_type(config)


def _config_fields_of_size(config_path: str | os.PathLike, size: int) -> list[str]:
    """The fields of a config.json that set a tensor dimension of `size`: the lists of that length (an answer list,
    class names, labels), else the integers of that value (a class count, a width); [] when it cannot be read."""
    try:
        config = json.loads(Path(config_path).read_text())
    except (OSError, ValueError):
        return []
    lists, numbers = [], []

    def walk(value, where: str) -> None:
        if isinstance(value, dict):
            for key, item in value.items():
                walk(item, f"{where}.{key}" if where else str(key))
        elif isinstance(value, list):
            if len(value) == size:
                lists.append(f"{where} (a list of {size})")
        elif isinstance(value, int) and not isinstance(value, bool) and value == size:
            numbers.append(f"{where} = {size}")

    walk(config, "")
    return lists or numbers


def check_state_shapes(module, state: Mapping[str, Any], weights_path: str | os.PathLike,
                       config_path: str | os.PathLike) -> None:
    """Every tensor of `state` the module has must have the module's shape; else an error naming the file, the
    tensor, both shapes and the config.json field that sets the differing size (instead of torch's state-dict
    report, which names none of them)."""
    own = module.state_dict()
    for key, tensor in state.items():
        if key not in own or tuple(tensor.shape) == tuple(own[key].shape):
            continue
        found, expected = tuple(tensor.shape), tuple(own[key].shape)
        sizes = [e for e, f in zip(expected, found) if e != f] if len(expected) == len(found) else []
        fields = _config_fields_of_size(config_path, sizes[0]) if sizes else []
        hint = (f"; the size {sizes[0]} comes from {config_path}: {', '.join(fields[:3])}" if fields
                else f"; {config_path} describes another model than {weights_path} holds")
        raise ValueError(f"{weights_path}: tensor {key} has shape {list(found)}, but the model that {config_path} "
                         f"describes expects {list(expected)}{hint}")


def check_finite_tensors(state: Mapping[str, Any], weights_path: str | os.PathLike) -> None:
    """A floating-point tensor holding NaN or infinity is an error naming it and the file: such weights give NaN
    answers, never a word."""
    import torch

    for key, tensor in state.items():
        if tensor.is_floating_point() and tensor.device.type != "meta" and not bool(torch.isfinite(tensor).all()):
            nan = int(torch.isnan(tensor).sum())
            inf = int(torch.isinf(tensor).sum())
            raise ValueError(f"{weights_path}: tensor {key} holds non-finite values ({nan} NaN, {inf} infinite of "
                             f"{tensor.numel()}); the file is damaged or its training diverged: it is not loaded")


def load_state_exactly(module, state: Mapping[str, Any], weights_path: str | os.PathLike,
                       config_path: str | os.PathLike) -> None:
    """Load `state` into `module` (built on the meta device: every tensor comes from the file), the one loader of
    every model directory's weights (pre-trained models, fine-tuned FinetuneModel directories): a tensor whose
    shape differs from the model's (`check_state_shapes`), a key missing or left over, or a NaN / infinite weight
    (`check_finite_tensors`) is an error naming the file and the tensor."""
    check_state_shapes(module, state, weights_path, config_path)
    check_finite_tensors(state, weights_path)
    missing, unexpected = module.load_state_dict(dict(state), strict=False, assign=True)
    if missing or unexpected:
        raise ValueError(f"{weights_path} does not match {config_path}: missing {sorted(missing)[:8]}, unexpected "
                         f"{sorted(unexpected)[:8]}")


class PretrainedModel:
    """`save_pretrained` / `from_pretrained` / `from_bert` of a family's model class (an nn.Module with
    `model_type`, `config_class`, `__init__(config)`, `visual_network` and `load_bert_weights(bert_state)`), the
    one way every family's directory is written and read and its BERT part initialised."""

    # the BERT config.json fields the family's config must equal (where the checkpoint has them)
    bert_matched_keys: ClassVar[tuple[str, ...]] = ("vocab_size", "hidden_size", "num_attention_heads",
                                                    "intermediate_size", "max_position_embeddings")

    def task_config(self, task: str) -> dict:
        """Config fields a model fine-tuned or run for `task` takes (fine-tuning rebuilds the model with them):
        none by default; a family whose model depends on the task says so (ViLBERT's task token)."""
        return {}

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
                             f"(vlbert_core.models.registry.from_pretrained builds any family)")
        try:
            config = cls.config_class.from_dict(fields)
        except (ValueError, TypeError) as exc:
            raise ValueError(f"{cls.__name__}.from_pretrained: {config_path}: {exc}") from exc
        with torch.device("meta"):  # every tensor comes from the file: no random init to throw away
            model = cls(config)
        load_state_exactly(model, load_safetensors(weights_path), weights_path, config_path)
        return model

    @classmethod
    def from_bert(cls, config, detector_state_dict: dict | None):
        """BERT weights from config.bert_path (`load_bert_weights`), the visual network from the detector, every
        other parameter new ~ N(0, 0.02) (the model's own initialisation)."""
        from vlbert_core.utils import get_logger

        from .bert_init import load_bert_state_dict, read_bert_config

        log = get_logger(cls.__module__)
        bert_cfg = read_bert_config(config.bert_path)
        for key in cls.bert_matched_keys:
            if key in bert_cfg and bert_cfg[key] != getattr(config, key):
                raise ValueError(f"{type(config).__name__}.{key}={getattr(config, key)} but the BERT checkpoint "
                                 f"{config.bert_path!r} has {bert_cfg[key]}")
        if config.num_hidden_layers > bert_cfg["num_hidden_layers"]:
            raise ValueError(f"{type(config).__name__}.num_hidden_layers={config.num_hidden_layers} but the BERT "
                             f"checkpoint {config.bert_path!r} has {bert_cfg['num_hidden_layers']} layers")
        model = cls(config)
        model.load_bert_weights(load_bert_state_dict(config.bert_path))
        if detector_state_dict is not None:
            model.visual_network.load_detector_weights(detector_state_dict)
        else:
            log.warning("%s.from_bert: no detector weights given; the visual network keeps its random init",
                        cls.__name__)
        log.info("%s from %s (%d of %d BERT layers), %.1fM parameters (%.1fM trainable)", config.family_name,
                 config.bert_path, config.num_hidden_layers, bert_cfg["num_hidden_layers"],
                 sum(p.numel() for p in model.parameters()) / 1e6,
                 sum(p.numel() for p in model.parameters() if p.requires_grad) / 1e6)
        return model
