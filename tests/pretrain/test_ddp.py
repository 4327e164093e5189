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

from vlbert_core.images import DEFAULT_MAX_PIXELS
from vlbert_core.pretrain import pretrain
from vlbert_core.pretrain.launch import (DistributedRunFailed, Launch, distributed_command, pretrain_arguments,
                                        run_distributed)
from vlbert_core.tensorboard_log import EVENTS_DIR

REPO = Path(__file__).resolve().parents[2]

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


def _two_process_command(kwargs: dict, root: Path) -> list[str]:
    """Rule pretrain's command for pretrain.launch {nodes: 1, processes_per_node: 2}: the config in a YAML file,
    `torchrun --standalone --nproc-per-node=2 -m vlbert_core.pretrain ...`."""
    config_file = Path(kwargs["out_dir"]).with_name(Path(kwargs["out_dir"]).name + "_config.yaml")
    config_file.write_text(yaml.safe_dump({"model": kwargs["model_cfg"], "pretrain": kwargs["pretrain_cfg"],
                                           "seed": kwargs["seed"], "device": kwargs["device"],
                                           "max_image_pixels": kwargs.get("max_image_pixels", DEFAULT_MAX_PIXELS)}))
    command = distributed_command(Launch(nodes=1, processes_per_node=2), pretrain_arguments(
        setting=kwargs["setting"], config_file=str(config_file), cc_shards=kwargs["cc_shards"],
        roi_parquets=kwargs["roi_parquets"], text_shards=kwargs["text_shards"], detector=kwargs["detector_path"],
        out_dir=kwargs["out_dir"]))
    assert "--standalone" in command  # one node: a local rendezvous, on loopback
    return command


@pytest.fixture
def launch_environment(monkeypatch):
    """The environment torchrun's processes inherit: no rank variables of an outer launch, gloo on loopback."""
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in {"GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}.items():
        monkeypatch.setenv(name, value)


def _launch_two_processes(kwargs: dict, root: Path) -> None:
    """The rule's path: run_distributed, torchrun's output in a log file."""
    run_distributed(_two_process_command(kwargs, root), root / f"{Path(kwargs['out_dir']).name}.log", kwargs["out_dir"])


def _weights(out: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(out / "model.safetensors"))


@pytest.mark.slow
def test_two_process_ddp_matches_one_process_on_the_same_global_batch(world, tmp_path, launch_environment):
    bert = _dropout_free_bert(world, tmp_path)
    one, two = tmp_path / "one_process", tmp_path / "two_processes"
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


def _rank_pid(out: Path, rank: int) -> int | None:
    """The pid of rank `rank` of the launch writing to `out`: the process whose command line names `out` and whose
    environment has RANK=<rank> (torchrun's own process has none)."""
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            command_line = (proc / "cmdline").read_bytes().split(b"\0")
            environment = (proc / "environ").read_bytes().split(b"\0")
        except OSError:   # gone meanwhile, or not ours
            continue
        if str(out).encode() in command_line and f"RANK={rank}".encode() in environment:
            return int(proc.name)
    return None


@pytest.mark.slow
def test_a_rank_killed_mid_step_fails_the_launch_naming_it_and_the_rerun_resumes(world, tmp_path, launch_environment):
    """kill -9 to rank 1 of a running two-process pre-training: the launch ends within a bounded time (torchrun
    stops rank 0; the collective timeout bounds it otherwise), fails with one message naming rank 1 and its log,
    and the same command resumes from the last checkpoint and ends with an uninterrupted run's weights."""
    import signal
    import threading
    import time

    bert = _dropout_free_bert(world, tmp_path)
    killed_out, straight_out = tmp_path / "killed", tmp_path / "straight"
    # 40 steps (~0.1-0.2 s each here) after the first checkpoint at step 2: rank 1 dies long before the end.
    settings = {"steps": 40, "checkpoint_every": 2, "collective_timeout_s": 20}
    kwargs = _kwargs(world, bert, killed_out, per_rank_batch=2, streams_per_rank=1)
    kwargs["pretrain_cfg"].update(settings)
    command = _two_process_command(kwargs, tmp_path)

    outcome: dict = {}

    def launch() -> None:
        try:
            run_distributed(command, tmp_path / "killed.log", killed_out)
        except DistributedRunFailed as failure:
            outcome["failure"] = failure

    thread = threading.Thread(target=launch)
    thread.start()
    try:
        deadline = time.monotonic() + 180
        while not (killed_out / "checkpoint.pt").is_file():
            assert thread.is_alive(), f"the launch ended before its first checkpoint: {outcome}"
            assert time.monotonic() < deadline, "no checkpoint within 180 s"
            time.sleep(0.05)
        pid = _rank_pid(killed_out, 1)
        assert pid is not None, "rank 1's process not found"
        os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
    finally:
        thread.join(timeout=120)
    assert not thread.is_alive(), "the launch did not end within 120 s of rank 1's death"
    assert time.monotonic() - killed < 60
    message = str(outcome.get("failure"))
    assert "rank 1 (local rank 1" in message and "killed by SIGKILL" in message, message
    assert str(killed_out / "pretrain.rank1.log") in message and "resumes from" in message, message
    assert "\n" not in message
    stopped_at = torch.load(killed_out / "checkpoint.pt", weights_only=True)["step"]
    assert 2 <= stopped_at < settings["steps"] and not (killed_out / "model.safetensors").exists()

    run_distributed(command, tmp_path / "rerun.log", killed_out)
    assert f"at step {stopped_at}" in (killed_out / "pretrain.rank1.log").read_text()

    straight = _kwargs(world, bert, straight_out, per_rank_batch=2, streams_per_rank=1)
    straight["pretrain_cfg"].update(settings)
    _launch_two_processes(straight, tmp_path)
    want, got = _weights(straight_out), _weights(killed_out)
    assert want.keys() == got.keys()
    for key in want:
        assert torch.equal(got[key], want[key]), key
