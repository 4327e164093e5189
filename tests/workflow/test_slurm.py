"""profiles/slurm: how it renders, and the config/ci.yaml workflow run through it on a real SLURM.

The SLURM run starts a one-node cluster on this machine (.ci/slurm/start.sh: slurm-wlm + munge,
installed when missing; needs root), submits every job with sbatch through
snakemake-executor-plugin-slurm, and stops the daemons at the end, also when the run fails. Its 97
jobs took 48 minutes on 2 shared, busy cores (load average ~12): besides the work, each job starts
Snakemake twice inside SLURM, and the plugin polls job states every few seconds. While it runs, one
pre-training job is requeued with `scontrol requeue` (what SLURM does at preemption): it must stop on SIGTERM
with a checkpoint and resume from it. So it runs only with VLBERT_SLURM_TEST=1, as its own step of .ci/run:

    VLBERT_SLURM_TEST=1 uv run pytest tests/workflow/test_slurm.py

The profile asks for GPUs, GPU partitions and GPU-sized memory; the test node has 2 CPUs and no GPU.
The test, not the profile, overrides exactly that: gpu=0, and memory requests capped at half the node's.
"""

import contextlib
import csv
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from snakemake.profiles import ProfileConfigFileParser

pytestmark = pytest.mark.workflow

REPO = Path(__file__).resolve().parents[2]
SLURM_PROFILE = REPO / "profiles" / "slurm" / "config.yaml"
DEFAULT_PROFILE = REPO / "profiles" / "default" / "config.yaml"
CI_CONFIG = REPO / "config" / "ci.yaml"
START, STOP = REPO / ".ci" / "slurm" / "start.sh", REPO / ".ci" / "slurm" / "stop.sh"
TABLES = ["table1_vcr", "table2_vqa", "table3_refcoco", "table4_ablation"]
TARGETS = ["results/tables/table4_ablation.csv", "results/report/index.html"]
# The rules the profile sends to GPU nodes (import_* only exist for configs with bottom-up TSVs). pretrain's
# GPU count is the rule's own: it follows the config's pretrain.launch (tests/pretrain/test_launch.py).
GPU_RULES = {"train_detector", "extract_rois", "extract_task_rois", "import_rois", "import_task_rois", "finetune",
             "pretrain"}
# The partitions and account of .ci/slurm/start.sh's cluster (no accounting database: any account passes).
CLUSTER_ENV = {"SLURM_PARTITION": "cpu", "SLURM_GPU_PARTITION": "gpu", "SLURM_ACCOUNT": "vlbert-ci"}
PROFILE_ENV_VARS = ["SLURM_PARTITION", "SLURM_GPU_PARTITION", "SLURM_GPU_MODEL", "SLURM_ACCOUNT"]

needs_slurm_run = pytest.mark.skipif(
    os.environ.get("VLBERT_SLURM_TEST") != "1",
    reason="a 30-50 min run on a local SLURM cluster (root); set VLBERT_SLURM_TEST=1, as .ci/run's SLURM step does",
)


@contextlib.contextmanager
def environment(values: dict[str, str]):
    """os.environ with the profile's variables set to `values` (the others of them unset), restored after."""
    saved = {name: os.environ.get(name) for name in PROFILE_ENV_VARS}
    try:
        for name in PROFILE_ENV_VARS:
            os.environ.pop(name, None)
        os.environ.update(values)
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def render_profile(path: Path, env: dict[str, str]) -> dict:
    """The profile as Snakemake's own parser turns it into command-line values, under `env`."""
    with environment(env), open(path) as stream:
        return dict(ProfileConfigFileParser().parse(stream))


def assignments(entries: list[str]) -> dict[str, str]:
    """['mem_mb=4000', ...] or ['rule:mem_mb=4000', ...] -> {'mem_mb': '4000', ...} / {'rule:mem_mb': ...}."""
    return dict(entry.split("=", 1) for entry in entries)


# ---- the profile itself (fast, part of the normal suite) -----------------------------------------------------


def test_profile_takes_partitions_and_account_from_the_environment():
    profile = render_profile(SLURM_PROFILE, {**CLUSTER_ENV, "SLURM_GPU_MODEL": "a100"})
    assert profile["executor"] == "slurm"
    defaults = assignments(profile["default-resources"])
    assert defaults["slurm_partition"] == "'cpu'" and defaults["slurm_account"] == "'vlbert-ci'"
    per_rule = assignments(profile["set-resources"])
    gpu_rules = {key.split(":")[0] for key, value in per_rule.items() if key.endswith(":gpu") and int(value) >= 1}
    assert gpu_rules == GPU_RULES - {"pretrain"}
    assert not [key for key in per_rule if key.startswith("pretrain:") and key.endswith((":gpu", ":nodes", ":tasks"))]
    for rule in GPU_RULES:
        assert per_rule[f"{rule}:slurm_partition"] == "'gpu'", rule
        assert per_rule[f"{rule}:gpu_model"] == "'a100'", rule
        assert int(per_rule[f"{rule}:cpus_per_gpu"]) >= 1, rule
        assert f"{rule}:runtime" in per_rule, rule
    assert "shard_text:slurm_partition" not in per_rule  # CPU rules keep the default partition


def test_profile_leaves_unset_variables_to_the_cluster_defaults():
    profile = render_profile(SLURM_PROFILE, {})
    defaults = assignments(profile["default-resources"])
    assert "slurm_partition" not in defaults and "slurm_account" not in defaults
    per_rule = assignments(profile["set-resources"])
    assert not [key for key in per_rule if key.endswith((":slurm_partition", ":gpu_model"))]
    assert "$" not in str(profile)  # no variable is passed on literally
    # Without SLURM_GPU_PARTITION, GPU jobs go where the CPU jobs go.
    per_rule = assignments(render_profile(SLURM_PROFILE, {"SLURM_PARTITION": "batch"})["set-resources"])
    assert per_rule["pretrain:slurm_partition"] == "'batch'"


def test_default_profile_cannot_spoil_a_slurm_run():
    """profiles/default is applied to every run and wins over --profile key by key (see its header)."""
    default = yaml.safe_load(DEFAULT_PROFILE.read_text())
    slurm = render_profile(SLURM_PROFILE, {})
    assert "cores" not in default  # would cap every cluster job's threads at the login node's cores
    for key, value in default.items():
        if key in slurm:
            assert str(value).lower() == str(slurm[key]).lower(), f"{key}: default {value} overrides slurm {slurm[key]}"


# ---- the workflow on a real one-node SLURM ----------------------------------------------------------------


def run_as_root(script: Path) -> subprocess.CompletedProcess:
    command = [str(script)] if os.geteuid() == 0 else ["sudo", "-n", str(script)]
    return subprocess.run(command, capture_output=True, text=True, timeout=900)


@pytest.fixture(scope="module")
def slurm_cluster():
    """.ci/slurm/start.sh's cluster for this module; stopped at the end whatever happened."""
    started = run_as_root(START)
    try:
        if started.returncode != 0:
            pytest.fail(f"{START} failed:\n{started.stdout[-3000:]}\n{started.stderr[-3000:]}")
        node_memory_mb = int(subprocess.run(["sinfo", "--noheader", "--partition=cpu", "--format=%m"],
                                            capture_output=True, text=True, check=True).stdout.split()[0])
        yield {"node_memory_mb": node_memory_mb}
    finally:
        stopped = run_as_root(STOP)
        assert stopped.returncode == 0, stopped.stderr


def fit_to_cpu_node(set_resources: list[str], node_memory_mb: int) -> list[str]:
    """The profile's per-rule resources for the CPU-only test node: no GPU, and memory requests of at
    most half the node's, so that two jobs share it (one per CPU) as they do in a local run.

    Given on the command line, --set-resources replaces the profile's whole mapping, so every other
    entry is passed on unchanged (runtimes, partitions, cpus_per_gpu, nodes)."""
    fitted = []
    for entry in set_resources:
        rule_and_name, value = entry.split("=", 1)
        name = rule_and_name.split(":", 1)[1]
        if name == "gpu":
            value = "0"
        elif name == "gpu_model":
            continue  # the plugin would still ask for --gpus=<model>:0
        elif name == "mem_mb":
            value = str(min(int(value), node_memory_mb // 2))
        fitted.append(f"{rule_and_name}={value}")
    return fitted


# Pre-training long enough (ci: 4 steps) for a job to be requeued while it trains, after its first checkpoint.
REQUEUE_CONFIG = {"pretrain": {"steps": 40}}


def requeue_a_pretraining_job(workdir: Path, snakemake: subprocess.Popen, seconds: float = 3000) -> dict | None:
    """What SLURM does at preemption, done with `scontrol requeue` to the first pre-training job seen training
    after its first checkpoint: SIGTERM to the job's processes, SIGKILL after KillWait (30 s), the job back in the
    queue. Returns the setting, the SLURM job id and the line the stopped job logged (None if no job was caught)."""
    deadline = time.monotonic() + seconds
    while snakemake.poll() is None and time.monotonic() < deadline:
        running = subprocess.run(["squeue", "--noheader", "--states=RUNNING", "--format=%i|%k"],
                                 capture_output=True, text=True, check=True).stdout.split()
        for checkpoint in sorted(workdir.glob("results/pretrain/*/checkpoint.pt")):
            setting = checkpoint.parent.name
            jobs = [line.split("|")[0] for line in running if line.endswith(f"|rule_pretrain_wildcards_{setting}")]
            if not jobs or (checkpoint.parent / "model.safetensors").exists():
                continue
            subprocess.run(["scontrol", "requeue", jobs[0]], check=True, capture_output=True, text=True)
            # The job's log (logs/pretrain/<setting>.log) is started afresh when the requeued job runs: keep the
            # stopped job's last word now.
            log = workdir / "logs" / "pretrain" / f"{setting}.log"
            stopped = None
            while stopped is None and time.monotonic() < deadline:
                time.sleep(0.5)
                lines = log.read_text().splitlines() if log.is_file() else []
                stopped = next((line for line in lines if "stopped by SIGTERM" in line), None)
            return {"setting": setting, "job_id": jobs[0], "stopped_line": stopped}
        time.sleep(0.5)
    return None


@pytest.fixture(scope="module")
def slurm_run(slurm_cluster, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("slurm_run")
    requeue_config = workdir.parent / "requeue.yaml"
    requeue_config.write_text(yaml.safe_dump(REQUEUE_CONFIG))
    profile = render_profile(SLURM_PROFILE, CLUSTER_ENV)
    overrides = fit_to_cpu_node(profile["set-resources"], slurm_cluster["node_memory_mb"])
    env = {name: value for name, value in os.environ.items() if name not in PROFILE_ENV_VARS} | CLUSTER_ENV
    configfiles = [str(CI_CONFIG), str(requeue_config)]
    cmd = [sys.executable, "-m", "snakemake", "-s", str(REPO / "Snakefile"), "-d", str(workdir), *TARGETS,
           "--profile", "profiles/slurm", "--configfile", *configfiles,
           # 4 jobs queued at once keep SLURM's 2 CPUs busy while Snakemake polls; SLURM runs what fits.
           "--jobs", "4",
           # No accounting database here, so job states come from squeue, and early polls keep it short.
           "--slurm-status-command", "squeue", "--slurm-init-seconds-before-status-checks", "2",
           "--slurm-keep-successful-logs",  # the test reads every job's SLURM log
           "--set-resources", *overrides]
    with open(workdir.parent / "slurm_run.out", "w+") as output:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=output, stderr=subprocess.STDOUT, text=True)
        try:
            requeued = requeue_a_pretraining_job(workdir, proc)
            proc.wait(timeout=5400)
        finally:
            proc.kill()
        output.seek(0)
        out = output.read()
    if proc.returncode != 0:
        job_logs = sorted((workdir / ".snakemake" / "slurm_logs").glob("**/*.log"), key=lambda p: p.stat().st_mtime)
        tails = "\n".join(f"== {p}\n{p.read_text()[-2000:]}" for p in job_logs[-3:])
        pytest.fail(f"the SLURM run failed (rc {proc.returncode}):\n{out[-6000:]}\n{tails}")
    run_id = re.search(r"SLURM run ID: (\S+)", out).group(1)
    # squeue keeps finished jobs for MinJobAge (an hour on the test cluster): each job's final state.
    listing = subprocess.run(["squeue", "--noheader", "--states=all", f"--name={run_id}", "--format=%i|%T|%P|%a|%k"],
                             capture_output=True, text=True, check=True).stdout
    slurm_jobs = {}
    for line in listing.splitlines():
        job_id, state, partition, account, comment = line.split("|")
        rule = re.fullmatch(r"rule_(.+?)(?:_wildcards_.*)?", comment).group(1)
        slurm_jobs[job_id] = {"state": state, "partition": partition, "account": account, "rule": rule}
    return {"workdir": workdir, "out": out, "slurm_jobs": slurm_jobs, "requeued": requeued,
            "configfiles": configfiles}


def planned_jobs(out: str) -> dict[str, int]:
    stats = out.split("Job stats:", 1)[1].split("\n\n", 1)[0]
    counts = {m.group(1): int(m.group(2)) for m in re.finditer(r"^(\w+)\s+(\d+)\s*$", stats, re.M)}
    counts.pop("total", None)
    return counts


@needs_slurm_run
def test_every_job_went_through_sbatch(slurm_run):
    submitted = re.findall(r"Job \d+ has been submitted with SLURM jobid (\d+) \(log: (.+?)\)\.", slurm_run["out"])
    planned = planned_jobs(slurm_run["out"])
    assert len(submitted) == sum(planned.values()) > 90, planned
    assert {job_id for job_id, _ in submitted} == set(slurm_run["slurm_jobs"])
    for job_id, log in submitted:
        # The SLURM log (sbatch --output) of each job, named by its SLURM job id, written inside the job.
        assert Path(log).name == f"{job_id}.log" and "Building DAG of jobs" in Path(log).read_text(), log
    per_rule = {}
    for job in slurm_run["slurm_jobs"].values():
        per_rule[job["rule"]] = per_rule.get(job["rule"], 0) + 1
    assert per_rule == planned


@needs_slurm_run
def test_jobs_completed_in_the_partitions_and_account_of_the_environment(slurm_run):
    jobs = slurm_run["slurm_jobs"].values()
    assert {job["state"] for job in jobs} == {"COMPLETED"}
    assert {job["account"] for job in jobs} == {CLUSTER_ENV["SLURM_ACCOUNT"]}
    for job in jobs:
        expected = CLUSTER_ENV["SLURM_GPU_PARTITION" if job["rule"] in GPU_RULES else "SLURM_PARTITION"]
        assert job["partition"] == expected, job
    assert {"pretrain", "finetune", "evaluate"} <= {job["rule"] for job in jobs}


@needs_slurm_run
def test_the_tables_and_the_report_came_out(slurm_run):
    results = slurm_run["workdir"] / "results"
    for name in TABLES:
        assert (results / "tables" / f"{name}.csv").stat().st_size > 0
        assert (results / "tables" / f"{name}.md").stat().st_size > 0
    with open(results / "tables" / "table4_ablation.csv", newline="") as f:
        measured = [row for row in csv.DictReader(f) if row["source"] == "measured"]
    assert [row["setting"] for row in measured] == ["none", "a", "b", "c", "d", "full"]
    assert all(float(row["vqa_test_dev"]) >= 0 for row in measured)
    assert (results / "report" / "index.html").stat().st_size > 0


@needs_slurm_run
def test_a_requeued_pretraining_job_resumes_its_sigterm_checkpoint_to_an_uninterrupted_runs_weights(
        slurm_run, tmp_path):
    """`scontrol requeue` on a running pre-training job (SLURM's preemption): SIGTERM makes it write a checkpoint
    and exit; the requeued job (the same SLURM job id) resumes there and the run goes on to its tables. Its weights
    are those of the same job run again here without interruption, so every table downstream is too."""
    from safetensors.torch import load_file

    requeued = slurm_run["requeued"]
    assert requeued is not None, "no pre-training job was caught training after its first checkpoint"
    setting, workdir = requeued["setting"], slurm_run["workdir"]
    stopped = re.search(r"stopped by SIGTERM after step (\d+); checkpoint written", requeued["stopped_line"] or "")
    assert stopped, f"the requeued job logged no SIGTERM stop: {requeued}"
    step = int(stopped.group(1))
    assert 2 <= step < REQUEUE_CONFIG["pretrain"]["steps"]
    log = (workdir / "logs" / "pretrain" / f"{setting}.log").read_text()
    assert f"at step {step}" in log and "resumed from" in log, log[-3000:]
    assert slurm_run["slurm_jobs"][requeued["job_id"]]["state"] == "COMPLETED"

    # The same job, uninterrupted, in a copy of the run's directory (files hard-linked; its outputs removed)
    reference = tmp_path / "reference"
    reference.mkdir()
    for name in ("results", "resources"):
        subprocess.run(["cp", "-al", str(workdir / name), str(reference / name)], check=True)
    subprocess.run(["rm", "-r", str(reference / "results" / "pretrain" / setting)], check=True)
    target = f"results/pretrain/{setting}/model.safetensors"
    done = subprocess.run([sys.executable, "-m", "snakemake", "-s", str(REPO / "Snakefile"), "-d", str(reference),
                           target, "--cores", "1", "--configfile", *slurm_run["configfiles"]],
                          cwd=REPO, capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stderr[-4000:]
    assert planned_jobs(done.stderr) == {"pretrain": 1}, done.stderr[-4000:]  # that job only
    want, got = load_file(str(reference / target)), load_file(str(workdir / target))
    assert want.keys() == got.keys()
    for key in want:
        assert (want[key] == got[key]).all(), key
