"""Run the authors' ViLBERT (facebookresearch/vilbert-multi-task, vilbert/vilbert.py) on a reference batch and
save its per-stage outputs.

A standalone script for the authors' environment: it imports torch, numpy and the authors' vilbert/vilbert.py
(from --authors-repo, a checkout the user downloaded), never this package. `python -m
vlbert_core.convert.vilbert.reference` runs it with --authors-python and compares its outputs with ours.

    PY vlbert_core/convert/vilbert/authors_runner.py --authors-repo vilbert-multi-task \
        --config config/bert_base_6layer_6conect.json --checkpoint pretrained_model.bin --inputs in.npz --out out.npz

What it stands in for to run their module on a CPU under today's torch (nothing of their code is edited):
their vilbert/__init__.py is not run, and their vilbert/utils.py (boto3, requests, tensorboardX and torch._six,
which torch 2 no longer has) is replaced by a module holding the one thing vilbert.py takes from it,
PreTrainedModel: an nn.Module that keeps its config and ties a module's weight to another's, as theirs does.
Their model runs in fp32 on the CPU; apex is absent, so their BertLayerNorm is their pure-PyTorch one.

Inputs (.npz): input_ids, token_type_ids, text_mask [B, T]; features [B, R, v_feature_size], locations [B, R, 5],
region_mask [B, R]; mlm_positions (Bool [B, T]); task_ids [B] (with --task-tokens). Outputs (.npz), each at the
real elements only (row-major over the batch): text_embeddings, visual_embeddings, coattention_<k>_text /
_visual (the output of each co-attention layer), text_states, visual_states, pooled_text, pooled_visual,
mlm_logits (at mlm_positions), region_logits (at every real region), alignment_logits. With task tokens the
text stages are T + 1 long and kept where the authors' extended mask (a 1 prepended) is 1; mlm_positions are
shifted past the task token likewise.

--model vl-tasks-beta builds the VILBertForVLTasks of jiasenlu/vilbert_beta (--authors-repo a checkout of it: the
ViLBERT paper's single-task models), its vil_prediction as wide as the checkpoint's, its outputs as vl-tasks'
for its four heads (vil_prediction, vil_logit, vision_logit, linguisic_logit); vilbert_beta's vilbert.py takes
only cached_path from its utils, which the stand-in module holds too (never called).

--model vl-tasks builds their VILBertForVLTasks (the fine-tuned models) instead of BertForMultiModalPreTraining;
its outputs add every text and visual layer's (text_layer_<i>, visual_layer_<i>) and every task head's: vil_prediction, vil_prediction_gqa, vil_logit, vil_tri_prediction (per row),
vil_binary_prediction (per pair of rows), vision_logit (at every real region), linguisic_logit (at every real
text element); the pre-training heads (their `cls`, which VILBertForVLTasks keeps) are read off that module.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import types

import numpy as np
import torch
from torch import nn


def install_stand_ins(repo: str) -> None:
    """The `vilbert` package without its __init__, and `vilbert.utils` as the module docstring says."""
    package = types.ModuleType("vilbert")
    package.__path__ = [os.path.join(repo, "vilbert")]
    sys.modules["vilbert"] = package
    utils = types.ModuleType("vilbert.utils")

    class PreTrainedModel(nn.Module):
        def __init__(self, config, *inputs, **kwargs):
            super().__init__()
            self.config = config

        def _tie_or_clone_weights(self, first_module, second_module):
            first_module.weight = second_module.weight

    def cached_path(*args, **kwargs):   # vilbert_beta's import; its forward never downloads
        raise RuntimeError("the authors' runner downloads nothing")

    utils.PreTrainedModel = PreTrainedModel
    utils.cached_path = cached_path
    sys.modules["vilbert.utils"] = utils


def build_model(config_path: str, model_kind: str = "pretraining", task_tokens: bool = False, num_labels: int = 1):
    """Their BertForMultiModalPreTraining (as train_concap.py builds it) or VILBertForVLTasks (as train_tasks.py
    does: task_specific_tokens set on the config from the command line) from a config file of theirs;
    `num_labels`: vilbert_beta's vil_prediction rows (vilbert-multi-task's heads do not read it)."""
    vilbert = importlib.import_module("vilbert.vilbert")
    config = vilbert.BertConfig.from_json_file(config_path)
    config.task_specific_tokens = bool(task_tokens)
    if model_kind in ("vl-tasks", "vl-tasks-beta"):
        return vilbert.VILBertForVLTasks(config, num_labels=num_labels)
    return vilbert.BertForMultiModalPreTraining(config)


class Recorder:
    """The outputs of the text and image embeddings, of every co-attention layer and of the two poolers; with
    `every_layer`, of every text and visual layer too (text_layer_<i>, visual_layer_<i>)."""

    def __init__(self, model, every_layer: bool = False):
        self.outputs = {}
        bert = model.bert
        if every_layer:
            for kind, layers in (("text", bert.encoder.layer), ("visual", bert.encoder.v_layer)):
                for i, layer in enumerate(layers):   # each returns (states, attention probabilities)
                    layer.register_forward_hook(self._keep_first(f"{kind}_layer_{i}"))
        bert.embeddings.register_forward_hook(self._keep("text_embeddings"))
        bert.v_embeddings.register_forward_hook(self._keep("visual_embeddings"))
        bert.t_pooler.register_forward_hook(self._keep("pooled_text"))
        bert.v_pooler.register_forward_hook(self._keep("pooled_visual"))
        for k, layer in enumerate(bert.encoder.c_layer):
            layer.register_forward_hook(self._keep_coattention(k))
        bert.register_forward_hook(self._keep_states)

    def _keep(self, name):
        def hook(module, args, output):
            self.outputs[name] = output.detach()
        return hook

    def _keep_first(self, name):
        def hook(module, args, output):
            self.outputs[name] = output[0].detach()
        return hook

    def _keep_coattention(self, k):
        def hook(module, args, output):   # (visual, text, attention probabilities)
            self.outputs[f"coattention_{k}_visual"] = output[0].detach()
            self.outputs[f"coattention_{k}_text"] = output[1].detach()
        return hook

    def _keep_states(self, module, args, output):   # (text states, visual states, pooled_t, pooled_v, attention)
        self.outputs["text_states"], self.outputs["visual_states"] = output[0].detach(), output[1].detach()


def with_leading_one(mask):
    """The authors' mask of a text stream with the task token: a 1 prepended (BertModel.forward)."""
    return torch.cat([torch.ones_like(mask[:, :1]), mask], dim=1)


def run(model, inputs: dict, model_kind: str = "pretraining", task_tokens: bool = False) -> dict[str, np.ndarray]:
    def t(name, dtype=None):
        value = torch.from_numpy(np.ascontiguousarray(inputs[name]))
        return value if dtype is None else value.to(dtype)

    # the fine-tuned layout's check reads every layer (the pre-trained one's golden files predate that)
    recorder = Recorder(model, every_layer=model_kind != "pretraining")
    text_mask, region_mask = t("text_mask").bool(), t("region_mask").bool()
    mlm_positions = t("mlm_positions").bool()
    if task_tokens:
        text_mask = with_leading_one(text_mask)
        # the task token follows [CLS] (never an MLM position): the words after it move one on
        mlm_positions = torch.cat([mlm_positions[:, :1], torch.zeros_like(mlm_positions[:, :1]),
                                   mlm_positions[:, 1:]], dim=1)
    arguments = (t("input_ids", torch.long), t("features", torch.float32), t("locations", torch.float32),
                 t("token_type_ids", torch.long), t("text_mask", torch.long), t("region_mask", torch.long))
    heads = {}
    with torch.no_grad():
        if model_kind == "vl-tasks":
            pretraining_heads = {}
            model.cls.register_forward_hook(lambda module, args, output: pretraining_heads.update(out=output))
            task_ids = t("task_ids", torch.long)[:, None] if task_tokens else None
            (vil_prediction, vil_prediction_gqa, vil_logit, vil_binary_prediction, vil_tri_prediction, _,
             vision_logit, _, linguisic_logit, _) = model(*arguments, None, task_ids)
            mlm, regions, alignment = pretraining_heads["out"]
            heads = {"vil_prediction": vil_prediction, "vil_prediction_gqa": vil_prediction_gqa,
                     "vil_logit": vil_logit, "vil_binary_prediction": vil_binary_prediction,
                     "vil_tri_prediction": vil_tri_prediction, "vision_logit": vision_logit[region_mask],
                     "linguisic_logit": linguisic_logit[text_mask]}
        elif model_kind == "vl-tasks-beta":
            pretraining_heads = {}
            model.cls.register_forward_hook(lambda module, args, output: pretraining_heads.update(out=output))
            vil_prediction, vil_logit, _, _, vision_logit, _, linguisic_logit = model(*arguments)
            mlm, regions, alignment = pretraining_heads["out"]
            heads = {"vil_prediction": vil_prediction, "vil_logit": vil_logit,
                     "vision_logit": vision_logit[region_mask], "linguisic_logit": linguisic_logit[text_mask]}
        else:
            mlm, regions, alignment, _ = model(*arguments)
    out = {}
    for name, value in recorder.outputs.items():
        if name.startswith("pooled"):
            out[name] = value.numpy()
        elif name.endswith("_visual") or name.startswith("visual"):   # visual_layer_<i> too
            out[name] = value[region_mask].numpy()
        else:
            out[name] = value[text_mask].numpy()
    out["mlm_logits"] = mlm[mlm_positions].numpy()
    out["region_logits"] = regions[region_mask].numpy()
    out["alignment_logits"] = alignment.numpy()
    out.update({name: value.numpy() for name, value in heads.items()})
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--authors-repo", required=True, help="a checkout of facebookresearch/vilbert-multi-task")
    parser.add_argument("--config", required=True,
                        help="a config file of theirs (config/bert_base_6layer_6conect.json)")
    parser.add_argument("--checkpoint", required=True, help="the state dict (pretrained_model.bin or a stand-in)")
    parser.add_argument("--inputs", help="the reference batch (.npz)")
    parser.add_argument("--out", help="where the per-stage outputs go (.npz)")
    parser.add_argument("--model", choices=("pretraining", "vl-tasks", "vl-tasks-beta"), default="pretraining",
                        help="their BertForMultiModalPreTraining or VILBertForVLTasks (the fine-tuned models; "
                             "vl-tasks-beta: jiasenlu/vilbert_beta's)")
    parser.add_argument("--task-tokens", action="store_true",
                        help="the model has task tokens (their task_specific_tokens); the inputs hold task_ids")
    parser.add_argument("--list-keys", default=None,
                        help="also write the model's state-dict keys and shapes (JSON) here, before loading")
    args = parser.parse_args(argv)
    install_stand_ins(os.path.abspath(args.authors_repo))
    torch.set_grad_enabled(False)
    state = torch.load(args.checkpoint, map_location="cpu", weights_only=True)
    beta_rows = state.get("vil_prediction.main.3.weight_v")
    model = build_model(args.config, args.model, args.task_tokens,
                        num_labels=1 if beta_rows is None else int(beta_rows.shape[0]))
    if args.list_keys:
        with open(args.list_keys, "w") as f:
            json.dump({k: list(v.shape) for k, v in model.state_dict().items()}, f, indent=1)
    model.load_state_dict(state, strict=True)
    model.float().eval()
    if args.inputs is None:
        return 0
    with np.load(args.inputs, allow_pickle=False) as data:
        inputs = {k: data[k] for k in data.files}
    result = run(model, inputs, args.model, args.task_tokens)
    tmp = args.out + ".tmp"
    with open(tmp, "wb") as f:
        np.savez_compressed(f, **result)
    os.replace(tmp, args.out)
    print(f"vilbert authors_runner: {len(result)} stages -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
