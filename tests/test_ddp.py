"""Two-process DDP on CPU (gloo, loopback), started the way rule pretrain starts it (torchrun, through
vlbert_core.pretrain.launch): it runs, and it trains exactly what one process trains on the same global batch."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
import yaml
from test_tensorboard import assert_events_match_metrics

from vlbert_core.pretrain import pretrain
from vlbert_core.pretrain.launch import Launch, distributed_command, pretrain_arguments
from vlbert_core.tensorboard_log import EVENTS_DIR

REPO = Path(__file__).resolve().parents[1]

# Both runs see the same global batch of 8 samples a step: one process runs the two data streams itself
# (4 + 4 samples), each of the two ranks runs one stream (2 + 2 samples).
STEPS = 3
# The two runs sum the same per-target losses in different orders and pad their batches to different
# lengths, so the float roundings differ: after 3 AdamW steps at lr 8e-4 the weights differed by at most
# 3e-7 when measured, while training moves them by ~1e-3 (and a per-rank mean instead of the global
# normalisation of the losses makes them differ by 1.6e-3).
ATOL, RTOL = 2e-5, 1e-4


def _dropout_free_bert(world, root: Path) -> str:
    """The world's tiny BERT without dropout: dropout masks are drawn per rank and cannot match one process."""
    path = root / "bert_no_dropout"
    shutil.copytree(world["bert"], path)
    config = json.loads((path / "config.json").read_text())
    config.update(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


def _kwargs(world, bert: str, out: Path, per_rank_batch: int, streams_per_rank: int) -> dict:
    # As the embedded default: standardised appearance (each rank measures the same statistics) and the
    # [IMG] elements gated on.
    model_cfg = {"bert_path": bert, "num_hidden_layers": 1, "geometry_dim": 16, "max_rois": 4, "image_max_side": 48,
                 "frozen_stages": 2, "freeze_bn": True, "standardise_appearance": True, "visual_scale_object_init": 1.0}
    pretrain_cfg = {"steps": STEPS, "cc_batch_size": per_rank_batch, "text_batch_size": per_rank_batch,
                    "lr_per_sample": 1e-4, "weight_decay": 0.01, "warmup_steps": 0, "clip_grad": 1.0,
                    "max_text_len": 16, "max_caption_len": 12, "checkpoint_every": STEPS,
                    "streams_per_rank": streams_per_rank, "stream_workers": False, "held_out_per_shard": 1}
    # `full`: every part trains (MLM on captions and text, masked RoIs, stages 3-5 of the visual network).
    return dict(setting="full", cc_shards=world["cc"], roi_parquets=world["rois"], text_shards=world["text"],
                detector_path=world["detector"], model_cfg=model_cfg, pretrain_cfg=pretrain_cfg, out_dir=str(out),
                seed=3, device="cpu")


def _launch_two_processes(kwargs: dict, root: Path) -> None:
    """Rule pretrain's path for pretrain.launch {nodes: 1, processes_per_node: 2}: the config in a YAML file,
    `torchrun --standalone --nproc-per-node=2 -m vlbert_core.pretrain ...`."""
    config_file = root / "launch_config.yaml"
    config_file.write_text(yaml.safe_dump({"model": kwargs["model_cfg"], "pretrain": kwargs["pretrain_cfg"],
                                           "seed": kwargs["seed"], "device": kwargs["device"]}))
    command = distributed_command(Launch(nodes=1, processes_per_node=2), pretrain_arguments(
        setting=kwargs["setting"], config_file=str(config_file), cc_shards=kwargs["cc_shards"],
        roi_parquets=kwargs["roi_parquets"], text_shards=kwargs["text_shards"], detector=kwargs["detector_path"],
        out_dir=kwargs["out_dir"]))
    assert "--standalone" in command  # one node: a local rendezvous, on loopback
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    env.update(GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    done = subprocess.run(command, env=env, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{' '.join(command)} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"


def _weights(out: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(out / "model.safetensors"))


def test_two_process_ddp_matches_one_process_on_the_same_global_batch(world, tmp_path, monkeypatch):
    bert = _dropout_free_bert(world, tmp_path)
    one, two = tmp_path / "one_process", tmp_path / "two_processes"
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")  # the tokenizer is used again in forked processes
    pretrain(**_kwargs(world, bert, one, per_rank_batch=4, streams_per_rank=2))
    _launch_two_processes(_kwargs(world, bert, two, per_rank_batch=2, streams_per_rank=1), tmp_path)

    single, ddp = _weights(one), _weights(two)
    assert single.keys() == ddp.keys()
    worst = max(((single[k] - ddp[k]).abs().max().item(), k) for k in single)
    for key in single:
        torch.testing.assert_close(ddp[key], single[key], atol=ATOL, rtol=RTOL, msg=lambda m, key=key: f"{key}: {m}")
    # Control: training really moved the weights, by far more than the tolerance.
    from transformers import BertModel

    init = BertModel.from_pretrained(bert, local_files_only=True).encoder.layer[0].intermediate.dense.weight
    moved = (single["encoder.layers.0.intermediate.weight"] - init).abs().max().item()
    assert moved > 50 * ATOL, f"training moved the weights by only {moved} (worst DDP difference {worst})"

    # The logged metrics of the DDP run are those of the global batch.
    records = {name: [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
               for name, out in (("one", one), ("two", two))}
    assert [r["step"] for r in records["two"]] == list(range(1, STEPS + 1))
    for a, b in zip(records["one"], records["two"]):
        for key in ("loss", "mlm_loss", "mlm_text_loss", "roi_loss", "mlm_acc", "roi_acc"):
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), (a["step"], key)
    # TensorBoard: rank 0 alone writes the event files, with the records of metrics.jsonl
    assert len(list((two / EVENTS_DIR).iterdir())) == 1
    assert_events_match_metrics(two)
