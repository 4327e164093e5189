"""VL-BERT against ViLBERT under one controlled setup: `results/tables/model_comparison.csv` (+ .md).

Each ViLBERT setting sits beside the VL-BERT setting it is compared with (pretrain.settings.COMPARISON_PAIRS):
without pre-training each, and pre-trained with the same three tasks (masked words, masked regions' classes,
image-caption alignment; VL-BERT's setting (c) is the ViLBERT paper's single-stream baseline). Both families read
the same shards, RoIs and detector features, train the same steps and fine-tune on the same schedule (Table 4's)
with the same seeds (`compare.seeds`; the config's own seed is the default run, results/).

CSV layout: one row per setting: `setting`, `family`, `pre_trained`, `parameters` (of the pre-trained model,
heads excluded), `pretrain_train_s` (seconds of pre-training steps, mean over the seeds; 0 without
pre-training), then per Table 4 column `{col}_mean`, `{col}_std`, `{col}_values` (each seed's number, in the order
of `seeds`) and, on the ViLBERT rows, `{col}_p_vs_vlbert`: the paired test (the task's, vlbert_core.stats) of its
per-example outcomes against its VL-BERT partner's, the examples of every seed pooled and each paired with the
same example at the same seed.
"""

from __future__ import annotations

import json
import struct
from math import prod
from pathlib import Path

from vlbert_core.models.registry import family
from vlbert_core.pretrain.settings import COMPARISON_PAIRS, get_setting
from vlbert_core.stats import format_p_value, mean_std, paired_p_value
from vlbert_core.tasks.registry import comparison_columns, task_of_eval
from vlbert_core.utils import get_logger

from .build import (ABLATION_TABLE, eval_json_path, format_number, load_reported, outcome_paths, paired_outcomes,
                    read_eval, table_specs, write_csv_and_markdown)
from .seeds import seed_results_dir

log = get_logger(__name__)

COMPARISON_TABLE = "model_comparison"
MIN_COMPARISON_SEEDS = 2  # a mean ± std needs two runs


def comparison_settings() -> list[str]:
    """Every setting of the comparison, VL-BERT's first: none, c, vilbert_none, vilbert."""
    return [vlbert for vlbert, _ in COMPARISON_PAIRS] + [vilbert for _, vilbert in COMPARISON_PAIRS]


def partner(setting: str) -> str | None:
    """The VL-BERT setting a ViLBERT setting is compared with (None for a VL-BERT setting)."""
    return next((vlbert for vlbert, vilbert in COMPARISON_PAIRS if vilbert == setting), None)


def check_comparison_seeds(seeds: list[int]) -> None:
    if len(seeds) < MIN_COMPARISON_SEEDS or len(set(seeds)) != len(seeds):
        raise ValueError(f"config compare.seeds: the model comparison needs at least {MIN_COMPARISON_SEEDS} distinct "
                         f"seeds, got {seeds}")


def comparison_eval_paths(results_dir: str | Path, seeds: list[int], default_seed: int) -> list[Path]:
    """Every eval JSON the comparison reads and the predictions files of its paired tests: each seed x setting x
    column, at Table 4's schedule."""
    schedule = table_specs()[ABLATION_TABLE].schedule
    paths = []
    for seed in seeds:
        root = seed_results_dir(results_dir, seed, default_seed)
        for setting in comparison_settings():
            for col in comparison_columns():
                paths.append(eval_json_path(root, col.eval_task, setting, schedule, col.eval_split))
                paths += outcome_paths(root, col.eval_task, setting, schedule, col.eval_split)
    return list(dict.fromkeys(paths))


def pretrain_dir(results_dir: str | Path, seed: int, default_seed: int, setting: str) -> Path:
    return seed_results_dir(results_dir, seed, default_seed) / "pretrain" / setting


def zero_shot_settings() -> list[str]:
    """The comparison's settings whose pre-training trains an image-caption alignment head (VL-BERT's
    relationship head, ViLBERT's alignment head): those that retrieve zero-shot."""
    return [s for s in comparison_settings() if get_setting(s).relationship]


def comparison_pretrain_paths(results_dir: str | Path, seeds: list[int], default_seed: int) -> list[Path]:
    """The pre-training outputs the comparison reads (metrics for the seconds, the weights for the size)."""
    return [pretrain_dir(results_dir, seed, default_seed, setting) / name
            for seed in seeds for setting in comparison_settings() for name in ("metrics.jsonl", "model.safetensors")]


def count_parameters(path: Path) -> int:
    """The number of values in a .safetensors file, from its header alone (no tensor is read)."""
    with open(path, "rb") as f:
        size_bytes = f.read(8)
        if len(size_bytes) != 8:
            raise ValueError(f"{path}: not a safetensors file (shorter than its 8-byte header size)")
        (size,) = struct.unpack("<Q", size_bytes)
        try:
            header = json.loads(f.read(size))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ValueError(f"{path}: unreadable safetensors header: {exc}") from None
    return sum(prod(entry["shape"]) for key, entry in header.items() if key != "__metadata__")


def training_seconds(metrics_path: Path) -> float:
    """The seconds of a pre-training job's steps (the sum of its metrics rows' `seconds`)."""
    total = 0.0
    for i, line in enumerate(metrics_path.read_text().splitlines()):
        try:
            total += float(json.loads(line).get("seconds", 0.0))
        except (json.JSONDecodeError, TypeError, ValueError, AttributeError) as exc:
            raise ValueError(f"{metrics_path} line {i + 1}: not a metrics row ({exc})") from None
    return total


def _pooled_outcomes(results_dir: Path, seeds: list[int], default_seed: int, col, setting: str,
                     schedule: str) -> dict[tuple, float]:
    task = task_of_eval(col.eval_task)
    pooled = {}
    for seed in seeds:
        paths = outcome_paths(seed_results_dir(results_dir, seed, default_seed), col.eval_task, setting, schedule,
                              col.eval_split)
        pooled.update({(seed, *key): value for key, value in task.example_outcomes(col.eval_task, paths).items()})
    return pooled


def comparison_rows(results_dir: str | Path, seeds: list[int], default_seed: int) -> list[dict]:
    check_comparison_seeds(seeds)
    results_dir = Path(results_dir)
    spec = table_specs()[ABLATION_TABLE]
    rows = []
    for setting in comparison_settings():
        model_type = get_setting(setting).model_type
        dirs = [pretrain_dir(results_dir, seed, default_seed, setting) for seed in seeds]
        seconds = [training_seconds(d / "metrics.jsonl") for d in dirs]
        row = {"setting": setting, "family": family(model_type).display_name, "pre_trained": get_setting(setting).trains,
               "parameters": count_parameters(dirs[0] / "model.safetensors"),
               "pretrain_train_s": round(sum(seconds) / len(seconds), 1), "seeds": " ".join(map(str, seeds))}
        for col in comparison_columns():
            values = [float(read_eval(eval_json_path(seed_results_dir(results_dir, seed, default_seed), col.eval_task,
                                                     setting, spec.schedule, col.eval_split))["value"])
                      for seed in seeds]
            cell = mean_std(values)
            row.update({f"{col.name}_mean": cell.mean, f"{col.name}_std": cell.std,
                        f"{col.name}_values": " ".join(repr(v) for v in values), f"{col.name}_p_vs_vlbert": ""})
            other = partner(setting)
            if other is not None:
                ours = _pooled_outcomes(results_dir, seeds, default_seed, col, setting, spec.schedule)
                theirs = _pooled_outcomes(results_dir, seeds, default_seed, col, other, spec.schedule)
                ours, theirs = paired_outcomes(ours, theirs, f"{col.title}: settings {setting!r} and {other!r}",
                                               results_dir)
                row[f"{col.name}_p_vs_vlbert"] = paired_p_value(task_of_eval(col.eval_task).paired_test,
                                                                ours, theirs)
        rows.append(row)
    return rows


def comparison_header() -> list[str]:
    header = ["setting", "family", "pre_trained", "parameters", "pretrain_train_s", "seeds"]
    for col in comparison_columns():
        header += [f"{col.name}_{part}" for part in ("mean", "std", "values", "p_vs_vlbert")]
    return header


# The paper rows of Tables 1–3 shown under the comparison: ViLBERT's reported numbers and VL-BERT BASE's
REPORTED_MODELS = ("ViLBERT (Lu et al. 2019) †", "VL-BERT BASE w/o pre-training", "VL-BERT BASE")


def reported_numbers() -> dict[str, dict[str, str]]:
    """{paper model: {Table 4 column: its number in Tables 1–3, at that table's precision}}: each Table 4 column
    matched with the Table 1–3 column that measures the same eval task and split."""
    specs = table_specs()
    same_eval = {}
    for name, spec in specs.items():
        if name == ABLATION_TABLE:
            continue
        for col in spec.columns:
            if col.eval_task is not None:
                same_eval[(name, col.name)] = (col.eval_task, col.eval_split, spec.decimals)
    by_eval = {(col.eval_task, col.eval_split): col.name for col in comparison_columns()}
    numbers: dict[str, dict[str, str]] = {model: {} for model in REPORTED_MODELS}
    for row in load_reported():
        eval_task, split, decimals = same_eval.get((row["table"], row["column"]), (None, None, 0))
        if row["model"] in numbers and (eval_task, split) in by_eval:
            numbers[row["model"]][by_eval[(eval_task, split)]] = format_number(row["value"], decimals)
    return numbers


def comparison_markdown(rows: list[dict], dataset: str) -> str:
    spec = table_specs()[ABLATION_TABLE]
    columns = comparison_columns()
    header = ["model", "setting", "pre-trained", "parameters (M)", "pre-training steps (s)",
              *[f"{c.title} (mean ± std)" for c in columns]]
    lines = ["# VL-BERT vs ViLBERT: same data, RoIs, schedule and seeds (%)", "",
             "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        cells = [row["family"], row["setting"], "yes" if row["pre_trained"] else "no",
                 f"{row['parameters'] / 1e6:.1f}", f"{row['pretrain_train_s']:.0f}"]
        for c in columns:
            cell = f"{row[f'{c.name}_mean']:.{spec.decimals}f} ± {row[f'{c.name}_std']:.{spec.decimals}f}"
            p = row[f"{c.name}_p_vs_vlbert"]
            cells.append(cell if p == "" else f"{cell} ({format_p_value(p)})")
        lines.append("| " + " | ".join(cells) + " |")
    reported = reported_numbers()
    for model in REPORTED_MODELS:
        cells = [f"{model}, reported", "", "", "", ""]
        cells += [reported[model].get(c.name, "–") for c in columns]
        lines.append("| " + " | ".join(cells) + " |")
    seeds = rows[0]["seeds"] if rows else ""
    pairs = ", ".join(f"`{b}` vs `{a}`" for a, b in COMPARISON_PAIRS)
    lines += ["", f"Measured on the **{dataset}** data, fine-tuning schedule `{spec.schedule}` (Table 4's), seeds "
              f"{seeds}: mean ± sample standard deviation over the seeds. The p-value on a ViLBERT row is the paired "
              f"test of its per-example outcomes against the VL-BERT row it is paired with ({pairs}), the examples "
              "of every seed pooled. VL-BERT's setting `c` (masked words, masked RoI classes, image-caption "
              "relationship, detector frozen) is the ViLBERT paper's single-stream baseline: VL-BERT's "
              "architecture trained with ViLBERT's objectives. Parameters: the pre-trained model with its visual "
              "network, heads excluded. The reported rows are the papers' numbers in Tables 1–3 of Su et al. 2020 "
              "for the same eval (real data, full fine-tuning schedules, ViLBERT's from Lu et al. 2019): where the "
              "two models stood in their papers, not a target for this data."]
    return "\n".join(lines) + "\n"


def write_comparison_table(results_dir: str | Path, tables_dir: str | Path, seeds: list[int], default_seed: int,
                           dataset: str) -> Path:
    rows = comparison_rows(results_dir, seeds, default_seed)
    csv_path = Path(tables_dir) / f"{COMPARISON_TABLE}.csv"
    write_csv_and_markdown(rows, comparison_header(), csv_path, comparison_markdown(rows, dataset))
    log.info("wrote %s (%d settings x %d seeds)", csv_path, len(rows), len(seeds))
    return csv_path
