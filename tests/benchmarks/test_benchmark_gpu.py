"""benchmarks/gpu.py: its CPU dry run (what the command does where there is no GPU: one step of every workload
through the functions the GPU run uses), the bf16 peak lookup and MFU, the largest-batch search and the report."""

import os
import re
import subprocess
import sys

import pytest
import torch
from conftest import REPO, load_benchmark

gpu = load_benchmark("gpu")


@pytest.mark.slow
def test_without_cuda_it_says_so_and_dry_runs_every_workload_on_the_cpu():
    # no GPU visible even on a GPU machine; one thread, as the suite's other processes share the cores
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    result = subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu.py")], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    out = result.stdout
    assert "no CUDA device found: the GPU table is not measured" in out
    for workload in ("pretrain", "vqa", "vcr", "rois"):
        line = re.search(rf"^dry run: {workload}: .*: step ([0-9.]+) s, ([0-9.e+]+) FLOPs counted$", out, re.MULTILINE)
        assert line, f"no dry-run line for {workload} in:\n{out}"
        assert float(line[1]) > 0 and float(line[2]) > 0, line[0]
    # the pre-training step of 2 images and 4 rows: the visual network's convolutions and the encoder's matmuls
    pretraining_flops = float(re.search(r"^dry run: pretrain: .* ([0-9.e+]+) FLOPs counted$", out, re.MULTILINE)[1])
    assert pretraining_flops > 1e10
    loader = re.search(r"^dry run: loader: ([0-9.]+) samples/s from one worker", out, re.MULTILINE)
    assert loader and float(loader[1]) > 0, out
    assert "| pre-training, setting full | fp32 |" in out   # the table the GPU run prints, from the dry run's rows


@pytest.mark.parametrize("name, label, peak", [
    ("NVIDIA H100 80GB HBM3", "H100 SXM", 989e12),
    ("NVIDIA H100 PCIe", "H100 PCIe", 756e12),
    ("NVIDIA H200", "H200", 989e12),
    ("NVIDIA A100-SXM4-80GB", "A100", 312e12),
    ("NVIDIA A100 80GB PCIe", "A100", 312e12),
])
def test_bf16_peak_of_known_gpus(name, label, peak):
    assert gpu.bf16_peak(name) == (label, peak)


def test_mfu_is_counted_flops_over_step_time_over_the_peak_and_na_for_an_unknown_gpu():
    _, peak = gpu.bf16_peak("NVIDIA H100 80GB HBM3")
    assert gpu.model_flops_utilisation(98.9e12, 0.5, peak) == pytest.approx(0.2)
    assert gpu.percent_or_na(gpu.model_flops_utilisation(98.9e12, 0.5, peak)) == "20.0%"
    for unknown in ("NVIDIA GeForce RTX 4090", "NVIDIA H100 NVL", "Tesla V100-SXM2-32GB"):
        assert gpu.bf16_peak(unknown) is None
        assert gpu.model_flops_utilisation(1e12, 1.0, None) is None
        assert gpu.percent_or_na(gpu.model_flops_utilisation(1e12, 1.0, None)) == "n/a"


def measurement(multiple: int, step_s: float = 0.1) -> "gpu.Measurement":
    return gpu.Measurement("pre-training", "bf16 autocast", f"x{multiple}", 16 * multiple, "rows", step_s, 0.01,
                           10**12 * multiple, 2**30 * multiple)


def test_largest_batch_search_stops_at_the_first_out_of_memory():
    tried = []

    def try_multiple(multiple):
        tried.append(multiple)
        if multiple >= 8:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return measurement(multiple)

    largest, why = gpu.largest_that_fits(try_multiple, torch.device("cpu"))
    assert tried == [2, 4, 8] and largest.samples == 64 and why == "x8 ran out of GPU memory"


@pytest.mark.slow
def test_largest_batch_search_at_its_bounds_and_on_other_errors():
    def no_room(multiple):
        raise RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`")

    assert gpu.largest_that_fits(no_room, torch.device("cpu")) == (None, "x2 ran out of GPU memory")
    largest, why = gpu.largest_that_fits(measurement, torch.device("cpu"))
    assert largest.samples == 16 * 2 ** gpu.MAX_DOUBLINGS and why == f"the search ends at x{2 ** gpu.MAX_DOUBLINGS}"
    largest, why = gpu.largest_that_fits(lambda k: measurement(k, step_s=k * 4.0), torch.device("cpu"))
    assert largest.samples == 64 and why.startswith("x4 took 16.0 s a step")

    def broken(multiple):
        raise RuntimeError("shape mismatch")   # a bug is not a full GPU: it surfaces

    with pytest.raises(RuntimeError, match="shape mismatch"):
        gpu.largest_that_fits(broken, torch.device("cpu"))


def test_report_has_the_table_notes_and_workers_a_gpu_needs():
    rows = [measurement(1, step_s=0.2), measurement(4, step_s=0.5)]
    loader = gpu.LoaderRate(samples_per_s=30.0, image_samples_per_s=15.0, per_batch="2 + 2", first_batch_s=1.0)
    report = gpu.gpu_report("uv run python benchmarks/gpu.py --write-docs", "NVIDIA H100 80GB HBM3 (79 GiB)",
                            gpu.bf16_peak("NVIDIA H100 80GB HBM3"), rows, ["a note"], loader, streams_per_rank=4)
    # 16 rows in 0.2 s: 80 rows/s, 5 TFLOP/s of 989: 0.5%; 64 rows in 0.5 s: 128 rows/s
    assert "| pre-training | bf16 autocast | x1 | 80.0 rows | 200 (± 5) | 1.0 | 1.00 | 5.0 | 0.5% |" in report
    assert "- a note" in report
    assert "- x1: 80.0 rows/s on the GPU → **3 workers** at 30.0 samples/s each" in report
    assert "- x4: 128.0 rows/s on the GPU → **5 workers**" in report
    assert "dense bf16 peak 989 TFLOP/s (H100 SXM)" in report
    unknown = gpu.gpu_report("cmd", "a GPU", None, rows, [], None, streams_per_rank=4)
    assert "dense bf16 peak unknown (MFU n/a)" in unknown and "| n/a |" in unknown


# ---- issue 57: the A/B switches, the authors' side, the GPU session and the GPU-hours estimate ------------------

gpu_hours = load_benchmark("gpu_hours")
AUTHORS_REPO = os.environ.get("VLBERT_AUTHORS_REPO", str(REPO / ".authors" / "VL-BERT"))


@pytest.mark.parametrize("switch", ["channels_last", "foreach"])
@pytest.mark.slow
def test_a_switch_meant_to_compute_the_same_gives_the_same_weights_after_steps(switch):
    # fp32 on the CPU, the dry run's sizes: today's pre-training step and the switched one from the same seed
    torch.set_num_threads(1)
    cfg = gpu.paper_config()
    today = gpu.weights_after("pretrain", gpu.DEFAULT_SWITCHES, cfg, gpu.DRY_RUN_SIZES, steps=2)
    switched = gpu.weights_after("pretrain", gpu.Switches(**gpu.AB_SWITCHES[switch][0]), cfg, gpu.DRY_RUN_SIZES,
                                 steps=2)
    assert today.keys() == switched.keys()
    moved = 0
    for name, value in today.items():
        torch.testing.assert_close(switched[name], value, rtol=1e-5, atol=1e-6, msg=name)
    start = gpu.weights_after("pretrain", gpu.DEFAULT_SWITCHES, cfg, gpu.DRY_RUN_SIZES, steps=0)
    moved = sum(not torch.equal(start[k], v) for k, v in today.items())
    assert moved > len(today) // 2   # the steps trained: equal weights are not untouched ones


@pytest.mark.slow
def test_the_ab_dry_run_times_a_switch_against_today_on_the_cpu():
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    result = subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu.py"), "--device", "cpu", "--only",
                             "--ab", "rois_batch"], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    assert re.search(r"^\| rois \| rois_batch \| \d+ \| \d+ \| [0-9.]+ \| \*\*[0-9.]+\*\* \| n/a / n/a \|$",
                     result.stdout, re.MULTILINE), result.stdout


@pytest.mark.skipif(not os.path.isdir(AUTHORS_REPO), reason="no checkout of jackroos/VL-BERT (VLBERT_AUTHORS_REPO, "
                    "or .authors/VL-BERT from benchmarks/gpu_session_wheels.sh)")
@pytest.mark.slow
def test_the_authors_dry_run_times_both_sides_on_the_same_weights_and_batch():
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    result = subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu.py"), "--device", "cpu", "--only",
                             "--authors-repo", AUTHORS_REPO], cwd=REPO, env=env, capture_output=True, text=True,
                            timeout=1200)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    row = re.search(r"^\| 2 <caption, image> \(112x80, 3 boxes\) \+ 2 text-only \| (\d+) \| (\d+) \| .* \| "
                    r"\*\*([0-9.]+)\*\* \| ([0-9.]+) / ([0-9.]+) \| n/a \|$", result.stdout, re.MULTILINE)
    assert row, result.stdout
    assert float(row[3]) > 0 and float(row[4]) > 0 and float(row[5]) > 0
    gap = float(re.search(r"largest \|ours - theirs\| per batch: ([0-9.e+-]+)\.", result.stdout)[1])
    assert gap < 1e-4


def test_the_authors_pairs_alternate_and_stop_at_a_batch_that_does_not_fit():
    from types import SimpleNamespace

    vs = load_benchmark("gpu_vs_authors")
    calls = []

    def fake_run(command, threads):
        side = "ours" if "--worker" in command else "authors"
        multiple = int(command[command.index("--inputs") + 1][1:])
        calls.append((side, multiple))
        if side == "authors" and multiple == 4:
            return None   # out of GPU memory
        return {"median_s": 0.1 * multiple if side == "ours" else 0.2 * multiple, "step_s": [0.1]}

    args = SimpleNamespace(authors_pairs=2, device="cuda", warmup=1, steps=2, threads=1, authors_python="py",
                           authors_repo="VL-BERT")
    prepared = {"converted": "m", "checkpoint": "c", "vocab": "v", "batches": {"x1": "x1", "x4": "x4", "x16": "x16"}}
    rows = vs.measure_pairs(args, prepared, [1, 4, 16], run=fake_run)
    assert calls == [("ours", 1), ("authors", 1), ("authors", 1), ("ours", 1), ("ours", 4), ("authors", 4)]
    assert [p["ratio"] for p in rows[0]["pairs"]] == [0.5, 0.5]
    assert rows[1] == {"multiple": 4, "pairs": [], "why": "the authors’ ran out of GPU memory"}
    assert len(rows) == 2   # x16 not tried


def test_gpu_hours_of_pre_training_are_steps_times_gpus_times_the_slower_of_step_and_loader():
    plan = gpu_hours.PretrainPlan(steps=1000, global_batch=256, per_gpu_batch=16)
    # GPU-bound: 16 samples from 4 workers at 10/s take 0.4 s < the 0.5 s step: 1000 x 16 x 0.5 s = 8000 s
    est = gpu_hours.pretrain_gpu_hours(plan, step_s=0.5, loader_samples_per_s=10.0, workers_per_gpu=4)
    assert est.bound == "GPU" and est.gpus == 16 and est.gpu_hours == pytest.approx(8000 / 3600)
    # loader-bound: 16 samples from 4 workers at 2/s take 2 s: 1000 x 16 x 2 s = 32000 s
    est = gpu_hours.pretrain_gpu_hours(plan, step_s=0.5, loader_samples_per_s=2.0, workers_per_gpu=4)
    assert est.bound == "loader" and est.gpu_step_s == pytest.approx(2.0)
    assert est.gpu_hours == pytest.approx(32000 / 3600)


def test_gpu_hours_use_the_released_plan_and_the_fine_tunes_of_the_paper_config():
    cfg = gpu.paper_config()
    plan = gpu_hours.paper_pretrain_plan(cfg)
    assert (plan.steps, plan.global_batch, plan.per_gpu_batch, plan.gpus) == (259245, 256, 16, 16)
    # 259,245 steps x 16 GPUs x 0.127 s = 526,766 GPU-s = 146.3 GPU-hours
    est = gpu_hours.pretrain_gpu_hours(plan, 0.127, 72.8, 4)
    assert est.gpu_hours == pytest.approx(259245 * 16 * 0.127 / 3600) and est.bound == "GPU"
    assert gpu_hours.default_finetunes(cfg) == {"vqa": (5.0, 256), "vcr_q2a": (20.0, 64)}
    # VQA: ceil(5 x 443,757 / 256) = 8,668 steps; measured 0.58 s at 64 -> 2.32 s at 256: 5.586 GPU-hours
    est = gpu_hours.finetune_gpu_hours(5.0, 443_757, 256, 0.58, 64)
    assert est.steps == 8668 and est.gpu_step_s == pytest.approx(2.32)
    assert est.gpu_hours == pytest.approx(8668 * 2.32 / 3600)
    lines = gpu_hours.estimate_lines(cfg, 0.127, 72.8, 4, {"vqa": (0.58, 64)}, "H200")
    assert lines[0].startswith("- BASE pre-training, 259,245 steps at 256 samples (16 x 16): **146 H200-hours**")
    assert "~768 V100-hours" in lines[0] and "**5.6 H200-hours**" in lines[1] and len(lines) == 2


def test_the_gpu_session_dry_run_prints_its_steps_within_the_budget():
    result = subprocess.run(["bash", str(REPO / "benchmarks" / "gpu_session.sh"), "--dry-run"], cwd=REPO,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "budget 540 s" in out
    assert "step env:" in out
    for step in ("gpu", "ab", "dag"):
        assert re.search(rf"^step {step}: at most \d+% of what is left", out, re.MULTILINE), out
    assert "benchmarks/gpu.py --device cuda --only pretrain loader --authors-repo" in out
    assert "--configfile" in out and "config/rehearsal_gpu.yaml" in out


@pytest.mark.workflow
def test_the_gpu_rehearsal_config_validates_and_plans_the_whole_dag(tmp_path):
    from snakemake.utils import validate
    from test_config import SCHEMA, load, merged
    from test_workflow import TARGET, planned_rules, snakemake

    config = merged({**load("rehearsal.yaml"), **load("rehearsal_gpu.yaml")})
    validate(config, SCHEMA)
    assert config["device"] == "cuda"
    rehearsal, gpu_config = REPO / "config" / "rehearsal.yaml", REPO / "config" / "rehearsal_gpu.yaml"
    proc = snakemake(tmp_path, "-n", "--cores", "1", TARGET, "--configfile", str(rehearsal), str(gpu_config),
                     timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    counts = planned_rules(proc.stdout + proc.stderr)
    assert counts["pretrain"] >= 1 and counts["finetune"] >= 1 and counts["extract_rois"] == 1
