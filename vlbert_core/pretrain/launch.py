"""How rule `pretrain` starts its processes: one in-process run, torchrun on one node, or srun + torchrun
across nodes.

`pretrain.launch` in the config says how many nodes and how many processes per node (one per GPU):

    pretrain:
      launch: {nodes: 2, processes_per_node: 4}

- 1 x 1: the rule's script calls `pretrain()` itself (laptop, CI, one GPU).
- 1 x P: `torchrun --standalone --nproc-per-node P -m vlbert_core.pretrain ...` on this machine.
- N x P: `srun --nodes N --ntasks-per-node 1 torchrun --nnodes N --nproc-per-node P --rdzv-backend c10d
  --rdzv-endpoint <this host>:<port> -m vlbert_core.pretrain ...`: one torchrun per node, started by
  srun inside the SLURM allocation the rule's resources asked for (nodes, tasks, gpu; see
  workflow/rules/pretrain.smk). The batch script runs on the allocation's first node, so this host is
  the rendezvous point.

Every process gets the same command line; `python -m vlbert_core.pretrain` (its __main__) reads the
merged config from the YAML file the rule writes beside the outputs, and torchrun gives each process its
RANK / LOCAL_RANK / WORLD_SIZE.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

RENDEZVOUS_PORT = 29500  # torchrun's default; the c10d store listens here on the first node
# How long a rank waits in a collective for the others (pretrain.collective_timeout_s). When a rank dies, torchrun
# stops the other processes of its node at once; ranks on other nodes only notice through this timeout (NCCL's
# default is 10 minutes, gloo's 30). It must exceed the longest step plus a checkpoint's writing.
DEFAULT_COLLECTIVE_TIMEOUT_S = 600
RANK_LOG = "pretrain.rank{rank}.log"
# One failed process in torchrun's failure summary (torch.distributed.elastic's ChildFailedError).
_FAILURE = re.compile(r"host\s*:\s*(?P<host>\S+)\s*\n\s*rank\s*:\s*(?P<rank>\d+)\s*\(local_rank:\s*(?P<local_rank>\d+)\)"
                      r"\s*\n\s*exitcode\s*:\s*(?P<code>-?\d+)")


class DistributedRunFailed(RuntimeError):
    """A process of a torchrun launch failed; the message names the rank that failed first."""


@dataclass(frozen=True)
class Launch:
    nodes: int = 1
    processes_per_node: int = 1

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.processes_per_node < 1:
            raise ValueError(f"pretrain.launch: nodes ({self.nodes}) and processes_per_node "
                             f"({self.processes_per_node}) must be >= 1")

    @classmethod
    def from_config(cls, launch: Mapping | None) -> "Launch":
        launch = dict(launch or {})
        unknown = sorted(set(launch) - {"nodes", "processes_per_node"})
        if unknown:
            raise ValueError(f"pretrain.launch: unknown keys {unknown}; expected nodes, processes_per_node")
        return cls(int(launch.get("nodes", 1)), int(launch.get("processes_per_node", 1)))

    @property
    def world_size(self) -> int:
        return self.nodes * self.processes_per_node

    @property
    def in_process(self) -> bool:
        return self.world_size == 1


def pretrain_arguments(*, setting: str, config_file: str, cc_shards: Sequence[str], roi_parquets: Sequence[str],
                       text_shards: Sequence[str], detector: str, out_dir: str, init_from: str | None = None) -> list[str]:
    """The arguments of `python -m vlbert_core.pretrain` (see its __main__) for one setting."""
    args = ["--setting", setting, "--config", config_file, "--cc-shards", *cc_shards,
            "--roi-parquets", *roi_parquets, "--detector", detector, "--out", out_dir]
    if text_shards:
        args += ["--text-shards", *text_shards]
    if init_from:
        args += ["--init-from", init_from]
    return args


def distributed_command(launch: Launch, pretrain_args: Sequence[str], *, python: str = sys.executable,
                        environ: Mapping[str, str] = os.environ, hostname: str | None = None) -> list[str]:
    """The command line that starts launch.world_size processes of `python -m vlbert_core.pretrain`."""
    if launch.in_process:
        raise ValueError("one process: call pretrain() directly, no launcher needed")
    torchrun = [python, "-m", "torch.distributed.run", f"--nproc-per-node={launch.processes_per_node}"]
    if launch.nodes == 1:
        return [*torchrun, "--standalone", "-m", "vlbert_core.pretrain", *pretrain_args]
    job_id = environ.get("SLURM_JOB_ID")
    if not job_id:
        raise RuntimeError(
            f"pretrain.launch asks for {launch.nodes} nodes, which needs a SLURM allocation: run the workflow "
            "with --profile profiles/slurm (docs/multi-gpu.md), or set "
            "pretrain.launch.nodes: 1")
    # The allocation's size is not checked here: the SLURM plugin's job step drops every SLURM_* variable
    # but the job id, and srun itself fails with "only N nodes allocated" when it is too small.
    endpoint = f"{hostname or socket.getfqdn()}:{RENDEZVOUS_PORT}"
    return ["srun", f"--nodes={launch.nodes}", "--ntasks-per-node=1", f"--ntasks={launch.nodes}",
            *torchrun, f"--nnodes={launch.nodes}", "--rdzv-backend=c10d", f"--rdzv-id=vlbert-{job_id}",
            f"--rdzv-endpoint={endpoint}", "-m", "vlbert_core.pretrain", *pretrain_args]


def exit_status_meaning(code: int) -> str:
    """What a rank's exit status says (torchrun reports a death by signal N as -N)."""
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        if -code == signal.SIGKILL:
            return f"was killed by {name} (out of memory, a kill -9, or the scheduler)"
        return f"was killed by {name}"
    if code > 128 and code - 128 in (signal.SIGTERM, signal.SIGUSR1):
        return f"stopped on {signal.Signals(code - 128).name} after writing its checkpoint"
    return f"exited with status {code}"


def distributed_failure(torchrun_output: str, returncode: int, out_dir: str | os.PathLike) -> str:
    """One line on a failed torchrun launch: which rank failed and how (from torchrun's failure summary in its
    output), where that rank's log is, and what running the job again does.

    A rank killed by a signal other than SIGTERM (kill -9, the out-of-memory killer) is named before the ranks
    that failed after it: those fail in their next collective, or are stopped by torchrun with SIGTERM, and
    torchrun may record them first."""
    out = Path(out_dir)
    checkpoint = out / "checkpoint.pt"
    again = (f"running the job again resumes from {checkpoint}" if checkpoint.is_file()
             else "no checkpoint was written yet: running the job again starts from step 0")
    failures = [m.groupdict() for m in _FAILURE.finditer(torchrun_output)]
    if not failures:
        return (f"torchrun exited with status {returncode} without naming a failed rank; the ranks' logs are "
                f"{out / RANK_LOG.format(rank='<RANK>')}; {again}")
    killed = [f for f in failures if int(f["code"]) < 0 and -int(f["code"]) != signal.SIGTERM]
    first = (killed or failures)[0]
    others = sorted({int(f["rank"]) for f in failures} - {int(first["rank"])})
    after = f" (then rank{'s' if len(others) > 1 else ''} {', '.join(map(str, others))})" if others else ""
    return (f"rank {first['rank']} (local rank {first['local_rank']} on {first['host']}) "
            f"{exit_status_meaning(int(first['code']))}, and the launch failed{after}; its log: "
            f"{out / RANK_LOG.format(rank=first['rank'])}; {again}")


def run_distributed(command: Sequence[str], log_file: str | os.PathLike, out_dir: str | os.PathLike) -> None:
    """Run a torchrun `command`, its output appended to `log_file`; raise DistributedRunFailed naming the rank that
    failed first when it fails."""
    with open(log_file, "ab") as log:
        start = log.tell()
        done = subprocess.run(list(command), stdout=log, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        with open(log_file, "rb") as log:
            log.seek(start)
            output = log.read().decode(errors="replace")
        raise DistributedRunFailed(distributed_failure(output, done.returncode, out_dir))
