"""Table 4 over training seeds: each cell's mean ± std over the seeds' runs (config/seeds.yaml).

A seed covers what training draws at random: pre-training (initialisation of the new parameters,
masking, data order, dropout) and fine-tuning. The world, its data, the detector and the RoIs stay
those of the config's `seed`, shared by every seed, so the spread is the training's alone.

Each seed's runs live under `seed_results_dir`: the config's own seed is the default run itself
(results/), every other seed has results/seeds/<seed>/ with the same layout below it.

CSV layout (`results/tables/table4_seeds.csv`): one row per setting, the Table 4 switches, then per
column `{col}_mean`, `{col}_std` (sample std, n - 1), `{col}_paper` and `{col}_values` (each seed's
number, in the order of the `seeds` cell).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from vlbert_core.stats import mean_std
from vlbert_core.utils import get_logger

from .build import (
    ABLATION_TABLE,
    SETTING_NAMES,
    SWITCH_COLUMNS,
    SWITCH_TITLES,
    eval_json_path,
    format_number,
    load_reported,
    read_eval,
    switch_cells,
    table_specs,
    write_csv_and_markdown,
)

log = get_logger(__name__)

SEED_TABLE = "table4_seeds"
MIN_SEEDS = 3


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
    return rows


def seed_table_header() -> list[str]:
    spec = table_specs()[ABLATION_TABLE]
    header = ["setting", "model", "seeds", *SWITCH_COLUMNS]
    for col in spec.measured_columns():
        header += [f"{col.name}_{part}" for part in ("mean", "std", "paper", "values")]
    return header


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
