"""python -m vlbert_core.convert.vilbert.reference --authors-repo DIR [--authors-python PY] [--config JSON] ...

Does a converted ViLBERT compute what the authors' code computes? Runs the authors' BertForMultiModalPreTraining
(facebookresearch/vilbert-multi-task, in its own Python environment: authors_runner.py) and the converted
model on one fixed batch of two samples with different numbers of words and regions, and prints the largest
difference at every stage: the text and image embeddings, the output of every co-attention layer, the final text
and visual states, the two pooled vectors, and the heads' logits (MLM at a few words, the region classes of every
real region, the alignment logits).

The checkpoint is the authors' file (--checkpoint, with its --config; --detector optional: the stages start from
given region features, so without one a random detector of the right widths stands in) or a random-valued
stand-in in the released key layout (the default; --config sizes it: the released bert_base_6layer_6conect sizes
unless given). --golden-out writes the batch and the authors' outputs (tests/data/golden/vilbert.*, compared by
tests/convert/test_golden_vilbert.py).

--layout vl-tasks checks a fine-tuned VILBertForVLTasks checkpoint (the multi-task model and its per-task files)
instead: the same stages, then every task head of theirs against ours (tasks/modeling/vilbert_released.py, the
shared task classes' heads where the pipeline has the task); --task-tokens gives the stand-in task embeddings and
feeds each row a task token (TASK_IDS: VQA's and RefCOCO+'s), as multi_task_model.bin is run. --layout
vl-tasks-beta checks the ViLBERT paper's single-task fine-tuned files (jiasenlu/vilbert_beta's VILBertForVLTasks,
--authors-repo a checkout of it) the same way, on its four heads.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import torch

from ..stages import compare_stages, load_arrays, report_stages, save_arrays

RUNNER = Path(__file__).with_name("authors_runner.py")
TOLERANCE = 1e-4
TEXT_LENGTHS = (7, 5)       # words of the two samples, [CLS] and [SEP] included
REGION_COUNTS = (5, 3)      # regions of the two samples, the global region 0 included
MLM_PER_SAMPLE = 2
# A small config in the authors' keys (tests/data/golden): 3 text layers, 2 visual layers, 2 co-attention layers
# after text layers 0 and 1-2 and visual layer 0 and 1 (so each stream runs layers between and after them).
SMALL_CONFIG: dict[str, Any] = {
    "vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 3, "num_attention_heads": 2, "intermediate_size": 48,
    "max_position_embeddings": 16, "type_vocab_size": 2, "hidden_act": "gelu", "hidden_dropout_prob": 0.1,
    "attention_probs_dropout_prob": 0.1, "initializer_range": 0.02, "v_feature_size": 16, "v_target_size": 7,
    "v_hidden_size": 24, "v_num_hidden_layers": 2, "v_num_attention_heads": 2, "v_intermediate_size": 40,
    "bi_hidden_size": 16, "bi_num_attention_heads": 2, "bi_intermediate_size": 40, "bi_attention_type": 1,
    "v_attention_probs_dropout_prob": 0.1, "v_hidden_act": "gelu", "v_hidden_dropout_prob": 0.1,
    "v_initializer_range": 0.02, "v_biattention_id": [0, 1], "t_biattention_id": [1, 2], "pooling_method": "mul",
}
INPUTS_FILE, OUTPUTS_FILE, RECORD_FILE = "vilbert.inputs.npz", "vilbert.authors.npz", "vilbert.json"
# the task tokens of the reference batch's two rows (with --task-tokens): VQA's and RefCOCO+'s
TASK_IDS = ("vqa", "refcoco")
# each task head of the authors' VILBertForVLTasks -> ours in ViLBertReleasedHeads (the stage both are kept as)
TASK_HEAD_STAGES = {"vil_prediction": "vqa", "vil_prediction_gqa": "gqa", "vil_logit": "pair_score",
                    "vil_binary_prediction": "nlvr2", "vil_tri_prediction": "entailment",
                    "vision_logit": "region_score", "linguisic_logit": "word_score"}


# the golden files' stem of each checkpoint layout (checkpoint.CHECKPOINT_LAYOUTS)
GOLDEN_STEMS = {"pretrained": "vilbert", "vl-tasks": "vilbert_tasks", "vl-tasks-beta": "vilbert_tasks_beta"}


def golden_name(layout: str, task_tokens: bool) -> str:
    """The golden files' stem of a layout: vilbert (pre-trained), vilbert_tasks, vilbert_tasks_tokens (the
    multi-task layout), vilbert_tasks_beta."""
    if task_tokens and layout != "vl-tasks":
        raise ValueError("task tokens belong to vilbert-multi-task's fine-tuned (vl-tasks) layout")
    return GOLDEN_STEMS[layout] + ("_tokens" if task_tokens else "")


def golden_files(layout: str, task_tokens: bool) -> tuple[str, str, str]:
    """(inputs, authors' outputs, record) file names of a layout's golden files."""
    stem = golden_name(layout, task_tokens)
    return f"{stem}.inputs.npz", f"{stem}.authors.npz", f"{stem}.json"


# ---- the reference batch ---------------------------------------------------------------------------------------

def reference_inputs(config: Mapping[str, Any], seed: int = 0, task_tokens: bool = False) -> dict[str, np.ndarray]:
    """Two samples in the authors' input conventions: word ids (id 0 padding), token types (the second sample
    has a sentence B), region features (non-negative, as pooled CNN features), 5-d locations (region 0 the
    global one at (0, 0, 1, 1, 1), as their datasets prepend it), masks, and the words whose MLM logits are read;
    with `task_tokens`, each row's task token (TASK_IDS)."""
    rng = np.random.default_rng(seed)
    batch, length, regions = len(TEXT_LENGTHS), max(TEXT_LENGTHS), max(REGION_COUNTS)
    input_ids = np.zeros((batch, length), dtype=np.int64)
    token_type_ids = np.zeros((batch, length), dtype=np.int64)
    text_mask = np.zeros((batch, length), dtype=np.int64)
    mlm_positions = np.zeros((batch, length), dtype=bool)
    features = np.zeros((batch, regions, config["v_feature_size"]), dtype=np.float32)
    locations = np.zeros((batch, regions, 5), dtype=np.float32)
    region_mask = np.zeros((batch, regions), dtype=np.int64)
    for i, (words, boxes) in enumerate(zip(TEXT_LENGTHS, REGION_COUNTS)):
        input_ids[i, :words] = rng.integers(1, config["vocab_size"], size=words)
        text_mask[i, :words] = 1
        if i == 1:
            token_type_ids[i, 3:words] = 1
        mlm_positions[i, rng.choice(np.arange(1, words - 1), size=MLM_PER_SAMPLE, replace=False)] = True
        features[i, :boxes] = rng.random((boxes, config["v_feature_size"]), dtype=np.float32) * 2.0
        corners = np.sort(rng.random((boxes, 2, 2), dtype=np.float32), axis=1)   # [box, (min, max), (x, y)]
        x1, y1, x2, y2 = corners[:, 0, 0], corners[:, 0, 1], corners[:, 1, 0], corners[:, 1, 1]
        locations[i, :boxes] = np.stack([x1, y1, x2, y2, (x2 - x1) * (y2 - y1)], axis=1)
        locations[i, 0] = (0.0, 0.0, 1.0, 1.0, 1.0)
        region_mask[i, :boxes] = 1
    inputs = {"input_ids": input_ids, "token_type_ids": token_type_ids, "text_mask": text_mask,
              "mlm_positions": mlm_positions, "features": features, "locations": locations, "region_mask": region_mask}
    if task_tokens:
        from vlbert_core.models.vilbert.config import task_token_id

        inputs["task_ids"] = np.array([task_token_id(task) for task in TASK_IDS], dtype=np.int64)
    return inputs


# ---- our side ---------------------------------------------------------------------------------------------------

def our_stages(model, heads, inputs: Mapping[str, np.ndarray], task_heads=None) -> dict[str, np.ndarray]:
    """The converted model's outputs laid out as the runner lays out the authors' (real elements only); with
    `task_heads` (ViLBertReleasedHeads) every task head's too, under the authors' names (TASK_HEAD_STAGES)."""
    from vlbert_core.models.common.output import EncoderOutput
    from vlbert_core.models.vilbert.model import with_task_token

    def t(name: str) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(inputs[name]))

    text_mask, region_mask = t("text_mask").bool(), t("region_mask").bool()
    task_ids = t("task_ids") if model.config.task_specific_tokens else None
    # where the text stages are read: the words' mask, with the task token's position when the model has one
    text_read = with_task_token(text_mask) if task_ids is not None else text_mask
    mlm_positions = t("mlm_positions").bool()
    if task_ids is not None:
        # the task token (never an MLM position) follows [CLS]: the words after it move one on
        mlm_positions = torch.cat([mlm_positions[:, :1], torch.zeros_like(mlm_positions[:, :1]),
                                   mlm_positions[:, 1:]], dim=1)
    recorded: dict[str, torch.Tensor] = {}
    handles = []
    for k, layer in enumerate(model.encoder.coattention_layers):
        def keep(module, args, output, k=k):
            recorded[f"coattention_{k}_visual"], recorded[f"coattention_{k}_text"] = output
        handles.append(layer.register_forward_hook(keep))
    if task_heads is not None:   # the fine-tuned layout's check reads every layer, as the runner's does
        for kind, layers in (("text", model.encoder.text_layers), ("visual", model.encoder.visual_layers)):
            for i, layer in enumerate(layers):
                def keep_layer(module, args, output, name=f"{kind}_layer_{i}"):
                    recorded[name] = output
                handles.append(layer.register_forward_hook(keep_layer))
    model.eval()
    heads.eval()
    try:
        with torch.no_grad():
            streams = model.forward_streams(t("input_ids"), t("token_type_ids"), text_mask, t("features"),
                                            t("locations"), region_mask, task_ids)
            out = {"text_embeddings": streams.text_embeddings[text_read],
                   "visual_embeddings": streams.visual_embeddings[region_mask]}
            for name, value in recorded.items():
                is_visual = name.endswith("_visual") or name.startswith("visual_")
                out[name] = value[region_mask] if is_visual else value[text_read]
            out.update(text_states=streams.text_states[text_read], visual_states=streams.visual_states[region_mask],
                       pooled_text=streams.pooled_text, pooled_visual=streams.pooled_visual,
                       mlm_logits=heads.mlm(streams.text_states[mlm_positions]),
                       region_logits=heads.region(streams.visual_states[region_mask]),
                       alignment_logits=heads.alignment(streams.pooled))
            if task_heads is not None:
                task_heads.eval()
                # what the heads read, at every position of both streams (the task token's included)
                output = EncoderOutput(text_states=streams.text_states, text_mask=text_read,
                                       visual_states=streams.visual_states, visual_mask=region_mask,
                                       pooled=streams.pooled)
                logits = task_heads(output, None)
                for theirs, ours in TASK_HEAD_STAGES.items():
                    if ours in task_heads.head_names:   # vilbert_beta's release has four of them
                        out[theirs] = logits[ours]
                # the authors' scores keep their last axis of 1 ([B, 1], [B, R, 1], [B, T, 1]); per region and
                # word they are kept at the real ones
                out["vil_logit"] = out["vil_logit"][:, None]
                out["vision_logit"] = out["vision_logit"][region_mask][:, None]
                out["linguisic_logit"] = out["linguisic_logit"][text_read]
    finally:
        for handle in handles:
            handle.remove()
    return {name: value.numpy() for name, value in out.items()}


def load_converted(model_dir: str | os.PathLike, with_task_heads: bool = False):
    """(model, pre-training heads) of a converted directory, through the registry as the pipeline loads it; with
    `with_task_heads`, (model, heads, the released task heads of task_heads.safetensors)."""
    from vlbert_core.models.registry import from_pretrained
    from vlbert_core.models.vilbert.heads import ViLBertPretrainingHeads, load_vilbert_pretraining_heads

    model = from_pretrained(model_dir)
    heads = ViLBertPretrainingHeads(model.config, model.word_embeddings())
    load_vilbert_pretraining_heads(heads, model_dir)
    if not with_task_heads:
        return model, heads
    from vlbert_core.tasks.modeling.vilbert_released import load_released_heads

    return model, heads, load_released_heads(model.head_spec(), model_dir)


# ---- stand-in files -----------------------------------------------------------------------------------------------

def write_detector_stand_in(path: str | os.PathLike, feature_width: int, num_classes: int, seed: int = 0) -> Path:
    """A random detector checkpoint of this project whose RoI features are `feature_width`-d (a one-block-per-stage
    ResNet-C4, bottleneck when the width allows) with `num_classes` classes incl. background: the visual network a
    conversion needs when the comparison starts from given region features."""
    from vlbert_core.detector import build_detector
    from vlbert_core.utils import atomic_path

    if feature_width % 4 == 0:
        backbone = {"stage_widths": [8, 8, 16, feature_width // 4], "blocks_per_stage": [1, 1, 1, 1],
                    "block": "bottleneck"}
    else:
        backbone = {"stage_widths": [8, 8, 16, feature_width], "blocks_per_stage": [1, 1, 1, 1], "block": "basic"}
    config = {"backbone": backbone, "min_size": 64, "max_size": 64, "rpn_post_nms_train": 32, "rpn_post_nms_test": 8,
              "box_batch_size_per_image": 16}
    torch.manual_seed(seed)
    detector = build_detector(config, num_classes - 1)
    categories = [{"id": i + 1, "name": f"class_{i + 1}"} for i in range(num_classes - 1)]
    with atomic_path(Path(path)) as tmp:
        torch.save({"config": config, "categories": categories, "num_classes": num_classes - 1,
                    "state_dict": detector.state_dict()}, tmp)
    return Path(path)


def convert_stand_in(config: Mapping[str, Any], seed: int, workdir: str | os.PathLike, layout: str = "pretrained",
                     task_tokens: bool = False) -> tuple[Path, Path, Path]:
    """Write the stand-in checkpoint of `config` (authors' keys) in `layout` (checkpoint.CHECKPOINT_LAYOUTS; with
    `task_tokens`, the task embeddings) with `seed`, its config file and a detector stand-in into `workdir`, and
    convert them; returns (checkpoint, config file, converted directory)."""
    from .checkpoint import PUBLISHED_FILE, convert_vilbert, write_stand_in

    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    checkpoint, config_file = workdir / PUBLISHED_FILE, workdir / "config.json"
    write_stand_in(checkpoint, {**config, "task_specific_tokens": True} if task_tokens else config, seed, layout)
    config_file.write_text(json.dumps(dict(config), indent=1) + "\n")
    detector = write_detector_stand_in(workdir / "detector.pt", config["v_feature_size"], config["v_target_size"], seed)
    out = workdir / "converted"
    shutil.rmtree(out, ignore_errors=True)
    convert_vilbert(checkpoint, out, detector=detector, config_path=config_file)
    return checkpoint, config_file, out


# ---- the comparison ---------------------------------------------------------------------------------------------

def run_authors(authors_python: str, authors_repo: Path, config_file: Path, checkpoint: Path, inputs_path: Path,
                out_path: Path, layout: str = "pretrained", task_tokens: bool = False) -> dict[str, np.ndarray]:
    command = [str(authors_python), str(RUNNER), "--authors-repo", str(authors_repo), "--config", str(config_file),
               "--checkpoint", str(checkpoint), "--inputs", str(inputs_path), "--out", str(out_path),
               "--model", "pretraining" if layout == "pretrained" else layout]
    if task_tokens:
        command.append("--task-tokens")
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"the authors' model failed ({' '.join(command)}):\n{result.stderr[-4000:]}")
    return load_arrays(out_path)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m vlbert_core.convert.vilbert.reference", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--authors-repo", required=True, type=Path,
                        help="a checkout of facebookresearch/vilbert-multi-task")
    parser.add_argument("--authors-python", default=sys.executable,
                        help="the Python of an environment with torch and numpy that runs their vilbert.py "
                             "(default: this one)")
    parser.add_argument("--config", type=Path, default=None,
                        help="the authors'-format config of the checkpoint (default: the released "
                             "bert_base_6layer_6conect values)")
    parser.add_argument("--small", action="store_true", help="the small stand-in config of the golden test instead")
    parser.add_argument("--checkpoint", type=Path, default=None, help="the authors' pretrained_model.bin "
                                                                      "(default: a stand-in)")
    parser.add_argument("--detector", type=Path, default=None, help="a detector checkpoint for the conversion "
                                                                    "(default: a random one of the right widths)")
    parser.add_argument("--layout", choices=list(GOLDEN_STEMS), default="pretrained",
                        help="the checkpoint's model class: pretrained (BertForMultiModalPreTraining, "
                             "pretrained_model.bin), vl-tasks (VILBertForVLTasks: multi_task_model.bin and the "
                             "per-task fine-tuned files; every task head is compared too) or vl-tasks-beta (the "
                             "VILBertForVLTasks of jiasenlu/vilbert_beta, the ViLBERT paper's single-task files; "
                             "--authors-repo a checkout of vilbert_beta)")
    parser.add_argument("--task-tokens", action="store_true",
                        help="vl-tasks: the checkpoint has task tokens (a stand-in gets them); each row is fed one")
    parser.add_argument("--seed", type=int, default=0, help="of the stand-in's values and of the batch")
    parser.add_argument("--workdir", type=Path, default=None, help="keep the intermediate files here")
    parser.add_argument("--golden-out", type=Path, default=None, help="write the golden files into this directory")
    parser.add_argument("--json", type=Path, default=None, help="write the comparison rows as JSON")
    return parser


def verify(args) -> list[dict]:
    from .checkpoint import RELEASED_CONFIG, convert_vilbert, read_authors_config

    config = dict(SMALL_CONFIG if args.small else RELEASED_CONFIG)
    if args.config is not None:
        config = {**RELEASED_CONFIG, **read_authors_config(args.config)}
    tasks = args.layout != "pretrained"
    inputs_file, outputs_file, record_file = golden_files(args.layout, args.task_tokens)
    with tempfile.TemporaryDirectory() as scratch:
        workdir = args.workdir or Path(scratch)
        workdir.mkdir(parents=True, exist_ok=True)
        if args.checkpoint is None:
            checkpoint, config_file, converted = convert_stand_in(config, args.seed, workdir, args.layout,
                                                                  args.task_tokens)
        else:
            checkpoint, config_file = args.checkpoint, workdir / "config.json"
            config_file.write_text(json.dumps(config, indent=1) + "\n")
            detector = args.detector or write_detector_stand_in(workdir / "detector.pt", config["v_feature_size"],
                                                                config["v_target_size"], args.seed)
            converted = workdir / "converted"
            shutil.rmtree(converted, ignore_errors=True)
            convert_vilbert(checkpoint, converted, detector=detector, config_path=config_file)
        inputs = reference_inputs(config, args.seed, args.task_tokens)
        inputs_path = workdir / "inputs.npz"
        save_arrays(inputs, inputs_path)
        theirs = run_authors(args.authors_python, args.authors_repo, config_file, checkpoint, inputs_path,
                             workdir / "authors.npz", args.layout, args.task_tokens)
        if tasks:
            model, heads, task_heads = load_converted(converted, with_task_heads=True)
        else:
            (model, heads), task_heads = load_converted(converted), None
        if model.config.task_specific_tokens != args.task_tokens:
            raise SystemExit(f"{checkpoint}: task_specific_tokens is {model.config.task_specific_tokens}; pass "
                             f"--task-tokens exactly when the checkpoint has task embeddings")
        ours = our_stages(model, heads, inputs, task_heads)
        missing = sorted(set(theirs) ^ set(ours))
        if missing:
            raise SystemExit(f"stages only one side has: {missing}")
        rows = compare_stages(ours, theirs)
        if args.golden_out is not None:
            args.golden_out.mkdir(parents=True, exist_ok=True)
            save_arrays(inputs, args.golden_out / inputs_file)
            save_arrays(theirs, args.golden_out / outputs_file)
            record = {"config": config, "seed": args.seed, "tolerance": TOLERANCE,
                      "largest_differences": {r["stage"]: r["max_abs_diff"] for r in rows}}
            if tasks:
                record.update(layout=args.layout, task_tokens=args.task_tokens)
            (args.golden_out / record_file).write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    return rows


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    rows = verify(args)
    what = f"{args.layout}{', task tokens' if args.task_tokens else ''}, {args.checkpoint or 'stand-in'}"
    return report_stages(rows, f"ViLBERT: ours vs the authors' code ({what}), fp32 on {os.cpu_count()} CPU cores",
                         TOLERANCE, args.json)


if __name__ == "__main__":
    from vlbert_core.cli import run_command

    sys.exit(run_command(main, "python -m vlbert_core.convert.vilbert.reference"))
