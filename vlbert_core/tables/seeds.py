"""Table 4 over training seeds: each cell's mean ± std over the seeds' runs (config/seeds.yaml).

A seed covers what training draws at random: pre-training (initialisation of the new parameters,
masking, data order, dropout) and fine-tuning. The world, its data, the detector and the RoIs stay
those of the config's `seed`, shared by every seed, so the spread is the training's alone.

Each seed's runs live under `seed_results_dir`: the config's own seed is the default run itself
(results/), every other seed has results/seeds/<seed>/ with the same layout below it.

CSV layout (`results/tables/table4_seeds.csv`): one row per setting, the Table 4 switches, then per
column `{col}_mean`, `{col}_std` (sample std, n - 1), `{col}_paper`, `{col}_values` (each seed's
number, in the order of the `seeds` cell), `{col}_diff_vs_none` (mean minus `none`'s mean) and
`{col}_pooled_p_vs_none`: the paired test against `none` on the examples of every seed pooled, each
seed's predictions paired with `none`'s of the same seed (docs/significance.md); both empty on `none`'s row.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from vlbert_core.stats import format_p_value, mean_std, paired_p_value
from vlbert_core.tasks.registry import task_of_eval
from vlbert_core.utils import get_logger

from .build import (
    ABLATION_TABLE,
    BASELINE_SETTING,
    SETTING_NAMES,
    SWITCH_COLUMNS,
    SWITCH_TITLES,
    PairedComparison,
    eval_json_path,
    format_number,
    load_reported,
    paired_outcomes,
    read_eval,
    switch_cells,
    table_specs,
    write_csv_and_markdown,
)

log = get_logger(__name__)

SEED_TABLE = "table4_seeds"
MIN_SEEDS = 3
SIGNIFICANT = 0.05


@dataclass(frozen=True)
class Claim:
    """One of the paper's directional claims about Table 4 (Section 4.3), on the seeds' means:
    `setting` >= (or <=) `than` on each column of `columns` (on their average when `on_average`); no
    columns: every column of the paper's Table 4 (`paper_columns`; not the columns we add, such as VQA's held-out
    concepts)."""

    text: str
    setting: str
    than: str
    columns: tuple[str, ...] | None = None
    at_least: bool = True  # True: setting >= than; False: setting <= than
    on_average: bool = False


# The paper's reading of its Table 4 (Su et al. 2020, Section 4.3), as issue #19 lists it.
TABLE4_CLAIMS = (
    *(Claim(f"pre-training ({s}) >= w/o pre-training on every column", s, "none")
      for s in ("a", "b", "c", "d", "full")),
    Claim("masked RoI classification helps RefCOCO+: (b) >= (a)", "b", "a", ("refcoco_det_val",)),
    Claim("sentence-image relationship prediction does not help: (c) <= (b) on average", "c", "b",
          at_least=False, on_average=True),
    Claim("the text-only corpus helps VCR: (d) >= (b) on both VCR columns", "d", "b", ("vcr_q2a_val", "vcr_qa2r_val")),
)


def paper_columns() -> tuple[str, ...]:
    """The measured Table 4 columns the paper reports a number for: those its claims are about."""
    reported = {r["column"] for r in load_reported() if r["table"] == ABLATION_TABLE}
    return tuple(col.name for col in table_specs()[ABLATION_TABLE].measured_columns() if col.name in reported)


def check_claims(rows: list[dict], claims: tuple[Claim, ...] = TABLE4_CLAIMS) -> list[dict]:
    """Each claim checked on the seed table's means: whether it holds, and the differences it rests on."""
    means = {row["setting"]: row for row in rows}
    every_column = paper_columns()
    checked = []
    for claim in claims:
        columns = claim.columns or every_column
        if claim.setting not in means or claim.than not in means:
            checked.append({"claim": claim.text, "holds": None, "detail": f"setting {claim.setting!r} or "
                            f"{claim.than!r} not in the table"})
            continue
        missing = [c for c in columns if f"{c}_mean" not in means[claim.setting]]
        if missing:
            raise KeyError(f"Table 4 claim {claim.text!r}: no column(s) {missing} in the seeds table")
        diffs = {c: float(means[claim.setting][f"{c}_mean"]) - float(means[claim.than][f"{c}_mean"])
                 for c in columns}
        sign = 1.0 if claim.at_least else -1.0
        if claim.on_average:
            average = sum(diffs.values()) / len(diffs)
            holds = sign * average >= 0
            detail = f"average difference {average:+.2f}"
        else:
            holds = all(sign * d >= 0 for d in diffs.values())
            detail = ", ".join(f"{c} {d:+.2f}" for c, d in diffs.items())
        checked.append({"claim": claim.text, "holds": holds, "detail": f"{claim.setting} − {claim.than}: {detail}"})
    return checked


def claims_markdown(checked: list[dict]) -> list[str]:
    lines = ["", "## The paper's claims, on the means", "", "| claim | holds | mean differences (points) |",
             "|---|---|---|"]
    for c in checked:
        verdict = {True: "yes", False: "**no**", None: "not measured"}[c["holds"]]
        lines.append(f"| {c['claim']} | {verdict} | {c['detail']} |")
    return lines


def seed_results_dir(results_dir: str | Path, seed: int, default_seed: int, kind: str = "seeds") -> Path:
    """Where one seed's runs live: the default run's results for the config's seed (they are the same
    jobs), results/<kind>/<seed>/ for any other (kind `seeds`: pre-training, fine-tuning and evals;
    `finetune_seeds`: fine-tuning and evals, vlbert_core.tables.finetune_seeds)."""
    results_dir = Path(results_dir)
    return results_dir if seed == default_seed else results_dir / kind / str(seed)


def seed_eval_paths(results_dir: str | Path, seeds: list[int], default_seed: int,
                    settings: list[str]) -> list[Path]:
    """Every eval JSON the seeds table reads: each seed x setting x Table 4 column."""
    spec = table_specs()[ABLATION_TABLE]
    return [eval_json_path(seed_results_dir(results_dir, seed, default_seed), task, setting, spec.schedule, split)
            for seed in seeds for setting in settings for task, split in spec.eval_targets()]


def check_seeds(seeds: list[int]) -> None:
    if len(seeds) < MIN_SEEDS or len(set(seeds)) != len(seeds):
        raise ValueError(f"config seeds: Table 4 over seeds needs at least {MIN_SEEDS} distinct seeds, got "
                         f"{seeds} (use --configfile config/seeds.yaml)")


def seed_table_rows(results_dir: str | Path, seeds: list[int], default_seed: int,
                    settings: list[str]) -> list[dict]:
    """One row per setting: each Table 4 column's mean ± std over the seeds."""
    check_seeds(seeds)
    spec = table_specs()[ABLATION_TABLE]
    paper = {(r["setting"], r["column"]): r["value"] for r in load_reported() if r["table"] == ABLATION_TABLE}
    rows = []
    for setting in settings:
        row = {"setting": setting, "model": SETTING_NAMES[setting], "seeds": " ".join(map(str, seeds)),
               **switch_cells(setting)}
        for col in spec.measured_columns():
            values = [float(read_eval(eval_json_path(seed_results_dir(results_dir, seed, default_seed),
                                                     col.eval_task, setting, spec.schedule, col.eval_split))["value"])
                      for seed in seeds]
            cell = mean_std(values)
            row.update({f"{col.name}_mean": cell.mean, f"{col.name}_std": cell.std,
                        f"{col.name}_paper": paper.get((setting, col.name), ""),
                        f"{col.name}_values": " ".join(repr(v) for v in values)})
        rows.append(row)
    add_pooled_comparison(rows, results_dir, seeds, default_seed)
    return rows


def add_pooled_comparison(rows: list[dict], results_dir: str | Path, seeds: list[int], default_seed: int) -> None:
    """Each pre-trained setting's row gets, per column, its difference from `none`'s mean and the p-value of the
    paired test on every seed's examples pooled (seed s of a setting paired with seed s of `none`). Without a
    `none` row the cells stay empty."""
    spec = table_specs()[ABLATION_TABLE]
    baseline = next((row for row in rows if row["setting"] == BASELINE_SETTING), None)
    comparisons = {seed: PairedComparison(seed_results_dir(results_dir, seed, default_seed), spec.schedule)
                   for seed in seeds}
    for row in rows:
        for col in spec.measured_columns():
            diff = p = ""
            if baseline is not None and row["setting"] != BASELINE_SETTING:
                ours, theirs = [], []
                for seed, compare in comparisons.items():
                    a, b = paired_outcomes(compare.outcomes(col, row["setting"]),
                                           compare.outcomes(col, BASELINE_SETTING),
                                           f"{col.title}, seed {seed}: setting {row['setting']!r} and setting "
                                           f"{BASELINE_SETTING!r}", compare.results_dir / "eval")
                    ours += a
                    theirs += b
                p = paired_p_value(task_of_eval(col.eval_task).paired_test, ours, theirs)
                diff = row[f"{col.name}_mean"] - baseline[f"{col.name}_mean"]
            row[f"{col.name}_diff_vs_none"], row[f"{col.name}_pooled_p_vs_none"] = diff, p


def seed_table_header() -> list[str]:
    spec = table_specs()[ABLATION_TABLE]
    header = ["setting", "model", "seeds", *SWITCH_COLUMNS]
    for col in spec.measured_columns():
        header += [f"{col.name}_{part}" for part in ("mean", "std", "paper", "values", "diff_vs_none",
                                                      "pooled_p_vs_none")]
    return header


def pooled_markdown(rows: list[dict]) -> list[str]:
    """The pooled comparison with `none` as a table, and how many of the paper's columns each setting is ahead on
    with p < SIGNIFICANT."""
    spec = table_specs()[ABLATION_TABLE]
    columns = spec.measured_columns()
    compared = [row for row in rows if row[f"{columns[0].name}_pooled_p_vs_none"] != ""]
    if not compared:
        return []
    paper = set(paper_columns())
    lines = ["", f"## Against {SETTING_NAMES[BASELINE_SETTING]}, every seed's examples pooled", "",
             "Mean difference in points (paired test on the pooled examples: exact McNemar, paired bootstrap for "
             "VQA's soft scores; each seed's predictions paired with those of the same seed's "
             f"{SETTING_NAMES[BASELINE_SETTING]}).", "",
             "| setting | " + " | ".join(c.title for c in columns) + f" | ahead, p < {SIGNIFICANT}, of the paper's "
             f"{len(paper)} columns |", "|" + "---|" * (len(columns) + 2)]
    for row in compared:
        cells = [f"{row[f'{c.name}_diff_vs_none']:+.{spec.decimals}f} ({format_p_value(row[f'{c.name}_pooled_p_vs_none'])})"
                 for c in columns]
        ahead = sum(1 for c in columns if c.name in paper and row[f"{c.name}_diff_vs_none"] > 0
                    and row[f"{c.name}_pooled_p_vs_none"] < SIGNIFICANT)
        lines.append(f"| {row['model']} | " + " | ".join(cells) + f" | {ahead} |")
    return lines


def seed_table_markdown(rows: list[dict], dataset: str) -> str:
    spec = table_specs()[ABLATION_TABLE]
    columns = spec.measured_columns()
    header = ["setting", *SWITCH_TITLES] + [f"{c.title} (paper / ours, mean ± std)" for c in columns]
    lines = ["# Table 4 over training seeds: ablation, 0.5× fine-tuning epochs (%)", "",
             "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        cells = [row["model"]] + [row[s] for s in SWITCH_COLUMNS]
        for c in columns:
            ours = f"{row[f'{c.name}_mean']:.{spec.decimals}f} ± {row[f'{c.name}_std']:.{spec.decimals}f}"
            cells.append(f"{format_number(row[f'{c.name}_paper'], spec.decimals)} / {ours}")
        lines.append("| " + " | ".join(cells) + " |")
    seeds = rows[0]["seeds"] if rows else ""
    lines += ["", f"Measured on the **{dataset}** data (schedule `{spec.schedule}`), training seeds {seeds}: "
              "mean ± sample standard deviation over the seeds; each seed's numbers are in the CSV. "
              "A seed covers pre-training and fine-tuning; the world, detector and RoIs are shared."]
    lines += pooled_markdown(rows)
    lines += claims_markdown(check_claims(rows))
    return "\n".join(lines) + "\n"


def write_seed_table(results_dir: str | Path, tables_dir: str | Path, seeds: list[int], default_seed: int,
                     settings: list[str], dataset: str) -> Path:
    """Write results/tables/table4_seeds.csv and its Markdown twin; return the CSV path."""
    rows = seed_table_rows(results_dir, seeds, default_seed, settings)
    csv_path = Path(tables_dir) / f"{SEED_TABLE}.csv"
    write_csv_and_markdown(rows, seed_table_header(), csv_path, seed_table_markdown(rows, dataset))
    log.info("wrote %s (%d settings x %d seeds)", csv_path, len(rows), len(seeds))
    return csv_path
