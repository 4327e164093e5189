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
