"""How rule pretrain starts its processes (vlbert_core/pretrain/launch.py) and what it asks SLURM for."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from vlbert_core.pretrain.launch import RENDEZVOUS_PORT, Launch, distributed_command, pretrain_arguments

REPO = Path(__file__).resolve().parents[1]
ARGS = pretrain_arguments(setting="full", config_file="out/launch_config.yaml", cc_shards=["a.tar", "b.tar"],
                          roi_parquets=["a.parquet", "b.parquet"], text_shards=[], detector="det.pt", out_dir="out")


def test_pretrain_arguments_name_every_input():
    assert ARGS == ["--setting", "full", "--config", "out/launch_config.yaml", "--cc-shards", "a.tar", "b.tar",
                    "--roi-parquets", "a.parquet", "b.parquet", "--detector", "det.pt", "--out", "out"]
    with_text = pretrain_arguments(setting="d", config_file="c.yaml", cc_shards=["a.tar"], roi_parquets=["a.parquet"],
                                   text_shards=["books.tar"], detector="det.pt", out_dir="out")
    assert with_text[-2:] == ["--text-shards", "books.tar"]


def test_launch_from_config():
    assert Launch.from_config(None) == Launch(1, 1) and Launch.from_config(None).in_process
    assert Launch.from_config({"nodes": 2, "processes_per_node": 4}).world_size == 8
    with pytest.raises(ValueError, match="unknown keys \\['gpus'\\]"):
        Launch.from_config({"gpus": 4})
    with pytest.raises(ValueError, match="must be >= 1"):
        Launch.from_config({"nodes": 0})


def test_one_process_needs_no_launcher():
    with pytest.raises(ValueError, match="no launcher"):
        distributed_command(Launch(1, 1), ARGS)


def test_one_node_runs_torchrun_standalone():
    command = distributed_command(Launch(1, 4), ARGS, python="/venv/bin/python", environ={})
    assert command == ["/venv/bin/python", "-m", "torch.distributed.run", "--nproc-per-node=4", "--standalone",
                       "-m", "vlbert_core.pretrain", *ARGS]


def test_several_nodes_run_one_torchrun_per_node_through_srun():
    command = distributed_command(Launch(2, 4), ARGS, python="py", environ={"SLURM_JOB_ID": "123"},
                                  hostname="node17")
    assert command[:4] == ["srun", "--nodes=2", "--ntasks-per-node=1", "--ntasks=2"]
    torchrun = command[4:command.index("-m", 7)]
    assert torchrun[:4] == ["py", "-m", "torch.distributed.run", "--nproc-per-node=4"]
    assert {"--nnodes=2", "--rdzv-backend=c10d", "--rdzv-id=vlbert-123",
            f"--rdzv-endpoint=node17:{RENDEZVOUS_PORT}"} <= set(torchrun)
    assert command[-len(ARGS) - 2:] == ["-m", "vlbert_core.pretrain", *ARGS]


def test_several_nodes_outside_slurm_fail_clearly():
    with pytest.raises(RuntimeError, match="needs a SLURM allocation.*--profile profiles/slurm"):
        distributed_command(Launch(2, 1), ARGS, environ={})


def _planned_resources(tmp_path: Path, launch: str, device: str) -> str:
    """`snakemake -n -p` of one pretrain job, printing its resources."""
    override = tmp_path / "launch.yaml"
    override.write_text(f"device: {device}\npretrain:\n  launch: {launch}\n")
    done = subprocess.run(
        [sys.executable, "-m", "snakemake", "-n", "--configfile", "config/ci.yaml", str(override),
         "--forceall", "--directory", str(tmp_path), "--snakefile", str(REPO / "Snakefile"),
         "results/pretrain/a/model.safetensors"],
        cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    block = done.stdout.split("rule pretrain:")[1].split("\n\n")[0]
    return next(line for line in block.splitlines() if "resources:" in line)


def test_pretrain_job_asks_slurm_for_the_launch(tmp_path):
    one_gpu = _planned_resources(tmp_path, "{nodes: 1, processes_per_node: 1}", "cuda")
    assert "nodes=1" in one_gpu and "gpu=1" in one_gpu and "mpi=" not in one_gpu
    two_nodes = _planned_resources(tmp_path, "{nodes: 2, processes_per_node: 4}", "cuda")
    assert "nodes=2" in two_nodes and "tasks=2" in two_nodes and "mpi=srun" in two_nodes
    assert "slurm_extra=--gpus-per-node=4" in two_nodes and "tasks_per_gpu=0" in two_nodes
