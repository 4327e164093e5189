"""VL-BERT vs ViLBERT (results/tables/model_comparison.csv): the table from its eval files, and the plan of its
target."""

import csv
import json
from pathlib import Path

import numpy as np
import pytest
from test_workflow import CI_CONFIG, planned_rules, snakemake

from vlbert_core.tables.comparison import (comparison_settings, count_parameters, write_comparison_table,
                                           zero_shot_settings)
from vlbert_core.tables.retrieval import write_retrieval_table, zero_shot_eval_path
from vlbert_core.tables.seeds import seed_results_dir
from vlbert_core.tasks.registry import comparison_columns, task_of_eval

pytestmark = pytest.mark.workflow

SEEDS = [0, 1]
COLUMNS = comparison_columns()
EXAMPLES = 40


def outcome(seed: int, setting: str, column: int, example: int) -> float:
    """ViLBERT (`vilbert`) right on every example of column 0, its partner `c` wrong on all of them; elsewhere the
    two families give the same outcomes."""
    if column == 0 and setting == "vilbert":
        return 1.0
    if column == 0 and setting == "c":
        return 0.0
    return float((example + seed + column) % 3 == 0)


def make_comparison_run(results: Path) -> None:
    from safetensors.numpy import save_file

    for seed in SEEDS:
        root = seed_results_dir(results, seed, 0)
        for setting in comparison_settings():
            pretrained = root / "pretrain" / setting
            pretrained.mkdir(parents=True, exist_ok=True)
            width = 3 if setting.startswith("vilbert") else 2
            save_file({"a": np.zeros((width, 5), np.float32), "b": np.zeros(7, np.float32)},
                      str(pretrained / "model.safetensors"))
            steps = [] if setting in ("none", "vilbert_none") else [{"step": s, "seconds": 1.5 + seed} for s in (1, 2)]
            (pretrained / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [{"step": 0}, *steps]))
            for c, col in enumerate(COLUMNS):
                task = task_of_eval(col.eval_task)
                rows = [{**{k: f"{k}-{i}" for k in task.example_key}, task.outcome_field: outcome(seed, setting, c, i)}
                        for i in range(EXAMPLES)]
                path = root / "eval" / col.eval_task / setting / "half" / f"{col.eval_split}.json"
                path.parent.mkdir(parents=True, exist_ok=True)
                value = 100.0 * sum(r[task.outcome_field] for r in rows) / EXAMPLES
                path.write_text(json.dumps({"task": col.eval_task, "value": value, "split": col.eval_split,
                                            "num_examples": EXAMPLES, "predictions": "p",
                                            "recall_at_5": value + 10, "recall_at_10": value + 20,
                                            "baseline": 2.5, "baseline_kind": "chance"}))
                path.with_suffix(".predictions.json").write_text(json.dumps(rows))
            if setting in zero_shot_settings():
                path = zero_shot_eval_path(root, setting)
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(json.dumps({"value": 5.0 + seed, "recall_at_5": 15.0, "recall_at_10": 25.0 + seed,
                                            "split": "test", "num_examples": EXAMPLES, "predictions": "p"}))


def test_the_comparison_pairs_each_vilbert_row_with_its_vlbert_partner(tmp_path):
    results = tmp_path / "results"
    make_comparison_run(results)
    csv_path = write_comparison_table(results, results / "tables", SEEDS, 0, "synthetic")
    with open(csv_path, newline="", encoding="utf-8") as f:
        rows = {r["setting"]: r for r in csv.DictReader(f)}
    assert list(rows) == ["none", "c", "vilbert_none", "vilbert"]
    assert [rows[s]["family"] for s in rows] == ["VL-BERT", "VL-BERT", "ViLBERT", "ViLBERT"]
    assert rows["vilbert"]["parameters"] == "22" and rows["c"]["parameters"] == "17"
    assert float(rows["vilbert"]["pretrain_train_s"]) == pytest.approx((3.0 + 5.0) / 2)
    assert float(rows["none"]["pretrain_train_s"]) == 0.0
    first = COLUMNS[0].name
    assert float(rows["vilbert"][f"{first}_mean"]) == 100.0 and float(rows["c"][f"{first}_mean"]) == 0.0
    # 80 discordant examples, all one way: McNemar's p is tiny; identical outcomes: p = 1
    assert float(rows["vilbert"][f"{first}_p_vs_vlbert"]) < 1e-6
    assert float(rows["vilbert"][f"{COLUMNS[1].name}_p_vs_vlbert"]) == 1.0
    assert rows["c"][f"{first}_p_vs_vlbert"] == "" and rows["none"][f"{first}_p_vs_vlbert"] == ""
    values = [float(v) for v in rows["none"][f"{COLUMNS[1].name}_values"].split()]
    assert len(values) == 2 and float(rows["none"][f"{COLUMNS[1].name}_std"]) == pytest.approx(np.std(values, ddof=1))
    markdown = csv_path.with_suffix(".md").read_text()
    assert "| ViLBERT | vilbert | yes |" in markdown and "p<0.001" in markdown and "single-stream baseline" in markdown
    # the papers' numbers for the same evals (Tables 1–3, at their precision): VQA test-dev 70.55 for ViLBERT
    assert "| ViLBERT (Lu et al. 2019) †, reported |" in markdown and "70.55" in markdown


def test_the_retrieval_table_has_fine_tuned_and_zero_shot_recalls_beside_the_vilbert_paper(tmp_path):
    results = tmp_path / "results"
    make_comparison_run(results)
    assert zero_shot_settings() == ["c", "vilbert"]  # the settings that train an image-caption head
    csv_path = write_retrieval_table(results, results / "tables", SEEDS, 0, "synthetic")
    with open(csv_path, newline="", encoding="utf-8") as f:
        rows = {r["setting"]: r for r in csv.DictReader(f)}
    assert list(rows) == comparison_settings() + ["chance"]
    # ranking 40 images at random: R@1 2.5 (the eval JSON's baseline), R@5 12.5, R@10 25
    assert [float(rows["chance"][f"finetuned_{k}_mean"]) for k in ("r1", "r5", "r10")] == [2.5, 12.5, 25.0]
    r1 = [c for c in COLUMNS if c.eval_task == "retrieval"][0]
    fine_tuned = [json.loads((seed_results_dir(results, seed, 0) / "eval" / "retrieval" / "vilbert" / "half" /
                              f"{r1.eval_split}.json").read_text()) for seed in SEEDS]
    assert float(rows["vilbert"]["finetuned_r1_mean"]) == pytest.approx(np.mean([f["value"] for f in fine_tuned]))
    assert float(rows["vilbert"]["finetuned_r10_mean"]) == pytest.approx(np.mean([f["recall_at_10"] for f in fine_tuned]))
    assert float(rows["c"]["zero_shot_r1_mean"]) == 5.5 and float(rows["c"]["zero_shot_r10_std"]) > 0
    assert rows["none"]["zero_shot_r1_mean"] == "" and rows["vilbert_none"]["zero_shot_r5_mean"] == ""
    markdown = csv_path.with_suffix(".md").read_text()
    assert "| ViLBERT (Lu et al. 2019), zero-shot, reported |  | – | – | – | 31.86 | 61.12 | 72.80 |" in markdown


def test_the_comparison_refuses_one_seed_and_examples_that_differ(tmp_path):
    results = tmp_path / "results"
    make_comparison_run(results)
    with pytest.raises(ValueError, match="at least 2 distinct seeds"):
        write_comparison_table(results, results / "tables", [0], 0, "synthetic")
    col = COLUMNS[0]
    path = results / "eval" / col.eval_task / "vilbert" / "half" / f"{col.eval_split}.predictions.json"
    path.write_text(json.dumps(json.loads(path.read_text())[1:]))
    with pytest.raises(ValueError, match="evaluated on different examples"):
        write_comparison_table(results, results / "tables", SEEDS, 0, "synthetic")


def test_count_parameters_reads_the_header_only(tmp_path):
    (tmp_path / "bad.safetensors").write_bytes(b"\x01")
    with pytest.raises(ValueError, match="bad.safetensors: not a safetensors file"):
        count_parameters(tmp_path / "bad.safetensors")


def test_the_comparison_target_plans_both_families_over_the_seeds(tmp_path):
    proc = snakemake(tmp_path, "-n", "--configfile", str(CI_CONFIG), "--cores", "1",
                     "results/tables/model_comparison.csv", timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    jobs = planned_rules(proc.stdout)
    seeds = 2  # config/ci.yaml compare.seeds
    assert jobs["pretrain"] == 4 and jobs["pretrain_seed"] == 4 * (seeds - 1)
    tasks = 5  # VCR Q->A, QA->R, VQA, RefCOCO+, retrieval
    assert jobs["finetune"] == 4 * tasks and jobs["finetune_seed"] == 4 * tasks * (seeds - 1)
    assert jobs["zero_shot_retrieval"] == 2 and jobs["zero_shot_retrieval_seed"] == 2 * (seeds - 1)
    assert jobs["model_comparison"] == 1
    assert "results/pretrain/vilbert/model.safetensors" in proc.stdout
