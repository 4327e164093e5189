"""The default run's comparison over fine-tuning seeds: the same pre-trained models fine-tuned again.

Issue #19's default-run target compares `full` with `w/o pre-training` on Table 4's four columns at
the full schedule, by paired tests on one fine-tuning of each. A paired test counts only the noise of
the held-out examples; the fine-tuning seed (head initialisation, data order, dropout) moves a column
too. Here the pre-trained models of the config's `seed` (results/pretrain/) are fine-tuned once per
seed of config `finetune_seeds`, so the spread between seeds is the fine-tuning's alone (Table 4 over
training seeds, vlbert_core.tables.seeds, re-trains pre-training as well).

The config's own seed is the default run itself (results/); every other seed has
results/finetune_seeds/<seed>/ with the default run's layout below it (finetune/, eval/).

CSV layout (`results/tables/finetune_seeds.csv`): one row per setting and fine-tuning seed; per column
`{col}` (the number) and `{col}_p_vs_none` (the paired test against `none` fine-tuned with the same
seed; empty on `none`'s rows).
"""

from __future__ import annotations

from pathlib import Path

from vlbert_core.stats import format_p_value, mean_std
from vlbert_core.utils import get_logger

from .build import (
    ABLATION_TABLE,
    BASELINE_SETTING,
    SETTING_NAMES,
    PairedComparison,
    eval_json_path,
    read_eval,
    table_specs,
    write_csv_and_markdown,
)
from .seeds import MIN_SEEDS, SIGNIFICANT, seed_results_dir

log = get_logger(__name__)

FINETUNE_SEED_TABLE = "finetune_seeds"
SCHEDULE = "full"  # Tables 1-3's schedule: the one issue #19's default-run target reads


def finetune_seed_dir(results_dir: str | Path, seed: int, default_seed: int) -> Path:
    """Where one fine-tuning seed's fine-tunings and evals live: the default run's results for the
    config's seed (they are the same jobs), results/finetune_seeds/<seed>/ for any other."""
    return seed_results_dir(results_dir, seed, default_seed, kind=FINETUNE_SEED_TABLE)


def check_finetune_seeds(seeds: list[int], settings: list[str]) -> None:
    if len(seeds) < MIN_SEEDS or len(set(seeds)) != len(seeds):
        raise ValueError(f"config finetune_seeds: the comparison over fine-tuning seeds needs at least {MIN_SEEDS} "
                         f"distinct seeds, got {seeds} (use --configfile config/seeds.yaml)")
    if BASELINE_SETTING not in settings or len(settings) < 2:
        raise ValueError(f"the comparison over fine-tuning seeds needs {BASELINE_SETTING!r} and a pre-trained "
                         f"setting, got {settings}")


def columns() -> list:
    """Table 4's measured columns: the four of issue #19's target (VCR Q→A, QA→R, VQA, RefCOCO+ detected)."""
    return table_specs()[ABLATION_TABLE].measured_columns()


def finetune_seed_eval_paths(results_dir: str | Path, seeds: list[int], default_seed: int,
                             settings: list[str]) -> list[Path]:
    """Every eval JSON the table reads: each seed x setting x column."""
    return [eval_json_path(finetune_seed_dir(results_dir, seed, default_seed), col.eval_task, setting, SCHEDULE,
                           col.eval_split)
            for seed in seeds for setting in settings for col in columns()]


def finetune_seed_rows(results_dir: str | Path, seeds: list[int], default_seed: int,
                       settings: list[str]) -> list[dict]:
    """One row per setting and seed: each column's number and, on a pre-trained setting's row, the p-value
    of its predictions against `none`'s of the same seed."""
    check_finetune_seeds(seeds, settings)
    rows = []
    for seed in seeds:
        seed_dir = finetune_seed_dir(results_dir, seed, default_seed)
        compare = PairedComparison(seed_dir, SCHEDULE)
        for setting in settings:
            row = {"setting": setting, "model": SETTING_NAMES[setting], "finetune_seed": seed}
            for col in columns():
                record = read_eval(eval_json_path(seed_dir, col.eval_task, setting, SCHEDULE, col.eval_split))
                row[col.name] = float(record["value"])
                row[f"{col.name}_p_vs_none"] = "" if setting == BASELINE_SETTING else compare.p_value(col, setting)
            rows.append(row)
    return rows


def finetune_seed_header() -> list[str]:
    return ["setting", "model", "finetune_seed"] + [f"{c.name}{part}" for c in columns() for part in ("", "_p_vs_none")]


def default_run_target_holds(rows: list[dict], setting: str, seed: int) -> bool:
    """Issue #19's default-run target for one fine-tuning seed: `setting` ahead of `none` on every column,
    with p < 0.05 on at least two."""
    mine = next(r for r in rows if r["setting"] == setting and r["finetune_seed"] == seed)
    base = next(r for r in rows if r["setting"] == BASELINE_SETTING and r["finetune_seed"] == seed)
    names = [c.name for c in columns()]
    ahead = all(mine[n] > base[n] for n in names)
    return ahead and sum(mine[f"{n}_p_vs_none"] < SIGNIFICANT for n in names) >= 2


def finetune_seed_markdown(rows: list[dict], dataset: str) -> str:
    cols = columns()
    decimals = table_specs()[ABLATION_TABLE].decimals
    seeds = list(dict.fromkeys(r["finetune_seed"] for r in rows))
    settings = list(dict.fromkeys(r["setting"] for r in rows))
    header = ["setting", "fine-tuning seed", *(c.title for c in cols)]
    lines = ["# The default run's comparison over fine-tuning seeds (full schedule, %)", "",
             "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for setting in settings:
        mine = [r for r in rows if r["setting"] == setting]
        for r in mine:
            cells = [f"{r[c.name]:.{decimals}f}" + ("" if r[f"{c.name}_p_vs_none"] == ""
                                                    else f" ({format_p_value(r[f'{c.name}_p_vs_none'])})")
                     for c in cols]
            lines.append(f"| {SETTING_NAMES[setting]} | {r['finetune_seed']} | " + " | ".join(cells) + " |")
        spread = [mean_std([r[c.name] for r in mine]).format(decimals) for c in cols]
        lines.append(f"| {SETTING_NAMES[setting]} | mean ± std | " + " | ".join(spread) + " |")
    lines += ["", f"Measured on the **{dataset}** data: the pre-trained models of the config's seed, fine-tuned with "
              f"seeds {' '.join(map(str, seeds))} (the config's seed is the default run). (p=…): the paired test of "
              "that row's predictions against `w/o pre-training` fine-tuned with the same seed (docs/significance.md). "
              "Columns and held-out splits as in Table 4 (results/tables/table4_ablation.md names each split)."]
    for setting in settings:
        if setting == BASELINE_SETTING:
            continue
        lines.append("")
        for c in cols:
            pairs = [(r, next(b for b in rows if b["setting"] == BASELINE_SETTING
                              and b["finetune_seed"] == r["finetune_seed"]))
                     for r in rows if r["setting"] == setting]
            ahead = sum(r[c.name] > b[c.name] for r, b in pairs)
            significant = sum(r[c.name] > b[c.name] and r[f"{c.name}_p_vs_none"] < SIGNIFICANT for r, b in pairs)
            lines.append(f"- {c.title}: {SETTING_NAMES[setting]} ahead on {ahead} of {len(pairs)} seeds, "
                         f"with p < {SIGNIFICANT} on {significant}.")
        held = [s for s in seeds if default_run_target_holds(rows, setting, s)]
        lines.append(f"- {SETTING_NAMES[setting]} ahead on every column and with p < {SIGNIFICANT} on at least two "
                     f"(the default run's target): on {len(held)} of {len(seeds)} seeds"
                     + (f" ({' '.join(map(str, held))})." if held else "."))
    return "\n".join(lines) + "\n"


def write_finetune_seed_table(results_dir: str | Path, tables_dir: str | Path, seeds: list[int], default_seed: int,
                              settings: list[str], dataset: str) -> Path:
    """Write results/tables/finetune_seeds.csv and its Markdown twin; return the CSV path."""
    rows = finetune_seed_rows(results_dir, seeds, default_seed, settings)
    csv_path = Path(tables_dir) / f"{FINETUNE_SEED_TABLE}.csv"
    write_csv_and_markdown(rows, finetune_seed_header(), csv_path, finetune_seed_markdown(rows, dataset))
    log.info("wrote %s (%d settings x %d fine-tuning seeds)", csv_path, len(settings), len(seeds))
    return csv_path
