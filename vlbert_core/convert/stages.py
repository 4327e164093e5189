"""Comparing this project's per-stage outputs with the authors' (every family's reference check,
convert/<family>/reference.py): the arrays both sides write, the per-stage differences, and the report."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from vlbert_core.utils import atomic_path


def save_arrays(arrays: dict[str, np.ndarray], path: str | Path) -> None:
    with atomic_path(Path(path)) as tmp:
        with open(tmp, "wb") as f:
            np.savez_compressed(f, **arrays)


def load_arrays(path: str | Path) -> dict[str, np.ndarray]:
    with np.load(path, allow_pickle=False) as data:
        return {k: data[k] for k in data.files}


# ---- comparing stages -----------------------------------------------------------------------------------------

def compare_stages(ours: dict[str, np.ndarray], theirs: dict[str, np.ndarray]) -> list[dict]:
    """One row per stage both have: its shape, the largest |ours - theirs| and the largest |theirs|."""
    rows = []
    for stage in theirs:
        if stage not in ours:
            continue
        a, b = np.asarray(ours[stage], dtype=np.float64), np.asarray(theirs[stage], dtype=np.float64)
        if a.shape != b.shape:
            raise ValueError(f"stage {stage}: ours has shape {a.shape}, the authors' {b.shape}")
        rows.append({"stage": stage, "shape": list(b.shape), "max_abs_diff": float(np.abs(a - b).max(initial=0.0)),
                     "max_abs_ref": float(np.abs(b).max(initial=0.0))})
    return rows


GOLDEN_SAMPLES = 32   # values kept per stage in a golden file


def golden_numbers(outputs: dict[str, np.ndarray], seed: int = 0) -> dict[str, dict]:
    """A few numbers per stage (the mean of |x| and GOLDEN_SAMPLES values at fixed positions): small enough to
    keep in the repository, and any wrong element of a stage moves its mean or, likely, a sampled value."""
    rng = np.random.default_rng(seed)
    numbers = {}
    for stage, value in outputs.items():
        flat = np.asarray(value, dtype=np.float64).ravel()
        index = np.sort(rng.choice(flat.size, size=min(GOLDEN_SAMPLES, flat.size), replace=False))
        numbers[stage] = {"shape": list(np.shape(value)), "mean_abs": float(np.abs(flat).mean()),
                          "index": index.tolist(), "values": flat[index].tolist()}
    return numbers


def stage_table(rows: list[dict]) -> str:
    lines = ["| stage | shape | max abs diff | max abs value |", "|---|---|---|---|"]
    lines += [f"| {r['stage']} | {'x'.join(map(str, r['shape']))} | {r['max_abs_diff']:.2e} | {r['max_abs_ref']:.3g} |"
              for r in rows]
    return "\n".join(lines)


def report_stages(rows: list[dict], title: str, tolerance: float, json_path: Path | None = None) -> int:
    """Print the per-stage table under `title` (and write the rows as JSON); 0 when every stage is within
    `tolerance`, else 1 (the exit status of a verify command)."""
    print(title)
    print(stage_table(rows))
    if json_path is not None:
        Path(json_path).write_text(json.dumps(rows, indent=1) + "\n")
    worst = max(rows, key=lambda r: r["max_abs_diff"])
    verdict = "within" if worst["max_abs_diff"] <= tolerance else "ABOVE"
    print(f"largest difference {worst['max_abs_diff']:.2e} at {worst['stage']}: {verdict} {tolerance:g}")
    return 0 if verdict == "within" else 1
