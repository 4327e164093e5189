"""Where the initialising BERT comes from: its directory, tokenizer, config and weights (local only)."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import torch

from vlbert_core.safe_pickle import load_torch_file
from vlbert_core.utils import load_safetensors

PACKAGE_PREFIX = "package:"
# Keys of BERT's pre-training MLM head (BertForPreTraining / BertForMaskedLM), absent in BertModel.
MLM_HEAD_PREFIX = "cls.predictions."


def resolve_bert_path(spec: str) -> Path:
    """"package:NAME" -> NAME.get_model_path() (a Python package shipping a checkpoint); else a directory."""
    if not spec:
        raise ValueError("bert_path is empty: expected 'package:NAME' or a BERT checkpoint directory")
    if spec.startswith(PACKAGE_PREFIX):
        name = spec[len(PACKAGE_PREFIX):]
        try:
            module = importlib.import_module(name)
        except ImportError as exc:
            raise ValueError(f"bert_path {spec!r}: cannot import package {name!r}: {exc}") from exc
        if not hasattr(module, "get_model_path"):
            raise ValueError(f"bert_path {spec!r}: package {name!r} has no get_model_path()")
        path = Path(module.get_model_path())
    else:
        path = Path(spec)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"bert_path {spec!r}: {path} is not a BERT checkpoint directory (no config.json)")
    return path


def load_tokenizer(spec: str):
    """The WordPiece tokenizer of the checkpoint (transformers.BertTokenizerFast), never downloaded."""
    from transformers import BertTokenizerFast

    return BertTokenizerFast.from_pretrained(str(resolve_bert_path(spec)), local_files_only=True)


def read_bert_config(spec: str) -> dict:
    path = resolve_bert_path(spec) / "config.json"
    with open(path) as f:
        cfg = json.load(f)
    if cfg.get("model_type", "bert") != "bert":
        raise ValueError(f"{path}: model_type {cfg.get('model_type')!r} is not a BERT checkpoint")
    return cfg


def load_bert_state_dict(spec: str) -> dict[str, torch.Tensor]:
    """transformers.BertModel.from_pretrained(dir).state_dict() (embeddings.*, encoder.layer.*, pooler.*)."""
    from transformers import BertModel

    model = BertModel.from_pretrained(str(resolve_bert_path(spec)), local_files_only=True,
                                      add_pooling_layer=True)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def load_bert_mlm_head_state(spec: str) -> dict[str, torch.Tensor] | None:
    """BERT's `cls.predictions.*` weights (transform + LayerNorm + decoder bias) if the checkpoint has them.

    BertModel.from_pretrained drops these keys, so the raw checkpoint file is read. Sentence-embedding
    checkpoints such as MiniLM (all-MiniLM-L6-v2) have none: the caller then initialises the head.
    """
    path = resolve_bert_path(spec)
    safetensors_file = path / "model.safetensors"
    bin_file = path / "pytorch_model.bin"
    if safetensors_file.is_file():
        state = load_safetensors(safetensors_file, keep=lambda k: MLM_HEAD_PREFIX in k)
    elif bin_file.is_file():
        full = load_torch_file(bin_file, "a BERT checkpoint")
        state = {k: v for k, v in full.items() if MLM_HEAD_PREFIX in k}
    else:
        return None
    # Strip any leading model prefix (e.g. "bert." checkpoints store "cls.predictions." at top level).
    state = {k[k.index(MLM_HEAD_PREFIX) + len(MLM_HEAD_PREFIX):]: v for k, v in state.items()}
    return state or None
