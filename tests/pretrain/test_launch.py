"""How rule pretrain starts its processes (vlbert_core/pretrain/launch.py) and what it asks SLURM for."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from vlbert_core.pretrain.launch import RENDEZVOUS_PORT, Launch, distributed_command, pretrain_arguments

REPO = Path(__file__).resolve().parents[2]
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


@pytest.mark.workflow
def test_pretrain_job_asks_slurm_for_the_launch(tmp_path):
    one_gpu = _planned_resources(tmp_path, "{nodes: 1, processes_per_node: 1}", "cuda")
    assert "nodes=1" in one_gpu and "gpu=1" in one_gpu and "mpi=" not in one_gpu
    two_nodes = _planned_resources(tmp_path, "{nodes: 2, processes_per_node: 4}", "cuda")
    assert "nodes=2" in two_nodes and "tasks=2" in two_nodes and "mpi=srun" in two_nodes
    assert "slurm_extra=--gpus-per-node=4" in two_nodes and "tasks_per_gpu=0" in two_nodes


# torchrun's failure summary as torch 2.13 prints it: rank 0 recorded first (it failed in its next collective, or
# was stopped), rank 1 the one that was killed.
TORCHRUN_FAILURE = """
============================================================
vlbert_core.pretrain FAILED
------------------------------------------------------------
Failures:
[1]:
  time      : 2026-11-27_14:41:07
  host      : node07
  rank      : 1 (local_rank: 1)
  exitcode  : -9 (pid: 4242)
  error_file: <N/A>
  traceback : Signal 9 (SIGKILL) received by PID 4242
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-11-27_14:41:07
  host      : node07
  rank      : 0 (local_rank: 0)
  exitcode  : 1 (pid: 4241)
  error_file: <N/A>
  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html
============================================================
"""


def test_a_failed_launch_names_the_killed_rank_before_those_that_failed_after_it(tmp_path):
    from vlbert_core.pretrain.launch import distributed_failure

    message = distributed_failure(TORCHRUN_FAILURE, 1, tmp_path)
    assert message.startswith("rank 1 (local rank 1 on node07) was killed by SIGKILL"), message
    assert "(then rank 0)" in message and str(tmp_path / "pretrain.rank1.log") in message
    assert "starts from step 0" in message   # no checkpoint yet
    (tmp_path / "checkpoint.pt").write_bytes(b"")
    assert f"resumes from {tmp_path / 'checkpoint.pt'}" in distributed_failure(TORCHRUN_FAILURE, 1, tmp_path)
    # a rank that raised an error, alone
    alone = TORCHRUN_FAILURE.split("Root Cause")[1]
    assert distributed_failure(alone, 1, tmp_path).startswith("rank 0 (local rank 0 on node07) exited with status 1")
    # torchrun itself failed (rendezvous, a bad argument): no rank to name
    assert distributed_failure("usage: torchrun ...", 2, tmp_path).startswith("torchrun exited with status 2")


def test_exit_statuses_of_ranks_read_as_what_happened():
    from vlbert_core.pretrain.launch import exit_status_meaning

    assert "killed by SIGKILL" in exit_status_meaning(-9)
    assert exit_status_meaning(-11) == "was killed by SIGSEGV"
    assert exit_status_meaning(143) == "stopped on SIGTERM after writing its checkpoint"
    assert exit_status_meaning(1) == "exited with status 1"
