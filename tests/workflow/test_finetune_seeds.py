"""The default run's comparison over fine-tuning seeds: rows, paired tests, the Markdown's counts, the plan."""

import csv
import json
from pathlib import Path

import numpy as np
import pytest
from test_workflow import CI_CONFIG, REPO, planned_rules, snakemake

from vlbert_core.stats import mcnemar_exact, paired_bootstrap
from vlbert_core.tables.finetune_seeds import columns, finetune_seed_dir, write_finetune_seed_table
from vlbert_core.tasks.registry import task_of_eval

pytestmark = pytest.mark.workflow

SETTINGS = ["none", "full"]
SEEDS = [0, 1, 2]
N = 40


def write_eval(seed_dir: Path, eval_task: str, setting: str, split: str, outcomes: list[float]) -> float:
    """An eval JSON and its scored predictions file (as `evaluate` writes them) with these per-example
    outcomes (0/1, or VQA's soft scores); returns the eval's value."""
    path = seed_dir / "eval" / eval_task / setting / "full" / f"{split}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    if eval_task.startswith("vcr"):
        rows = [{"annot_id": f"val-{i}", "prediction": 0 if o else 1, "probabilities": [0.25] * 4, "label": 0,
                 "correct": bool(o)} for i, o in enumerate(outcomes)]
    elif eval_task.startswith("vqa"):
        rows = [{"question_id": i, "answer": "yes", "accuracy": float(o)} for i, o in enumerate(outcomes)]
    else:
        rows = [{"ref_id": i, "sent_id": 100 + i, "image_id": 1, "box": [0, 0, 1, 1], "iou": 0.9 if o else 0.1,
                 "correct": bool(o)} for i, o in enumerate(outcomes)]
    path.with_suffix(".predictions.json").write_text(json.dumps(rows))
    value = 100.0 * float(np.mean(outcomes))
    path.write_text(json.dumps({"task": eval_task, "value": value, "split": split, "num_examples": len(outcomes),
                                "predictions": str(path.with_suffix(".predictions.json")), "setting": setting}))
    return value


def first_half(seed: int, col: str) -> list[float]:
    return [1.0] * (N // 2) + [0.0] * (N // 2)


def make_finetune_seed_evals(results: Path, full_outcomes, none_outcomes=first_half) -> dict[tuple, list[float]]:
    """Each setting's outcomes from `<setting>_outcomes(seed, column name)` (`none` right on the first half
    of the examples unless said). Returns every outcome list by (seed, setting, column)."""
    outcomes = {}
    for seed in SEEDS:
        for col in columns():
            for setting, values in (("none", none_outcomes(seed, col.name)), ("full", full_outcomes(seed, col.name))):
                write_eval(finetune_seed_dir(results, seed, 0), col.eval_task, setting, col.eval_split, values)
                outcomes[(seed, setting, col.name)] = values
    return outcomes


def read_rows(path: Path) -> list[dict]:
    with open(path, newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


def test_the_default_seed_is_the_default_run_and_other_fine_tuning_seeds_have_their_own_tree(tmp_path):
    assert finetune_seed_dir(tmp_path, 0, 0) == tmp_path
    assert finetune_seed_dir(tmp_path, 2, 0) == tmp_path / "finetune_seeds" / "2"
    assert finetune_seed_dir(tmp_path, 0, 3) == tmp_path / "finetune_seeds" / "0"


def test_each_row_is_one_fine_tuning_with_the_paired_test_against_none_of_the_same_seed(tmp_path):
    results = tmp_path / "results"
    rng = np.random.default_rng(7)

    def draw(seed, col):  # every seed's runs differ, so a p-value against another seed's `none` would show
        return [float(v) for v in rng.choice([0.0, 0.3, 1.0] if col.startswith("vqa") else [0.0, 1.0], N)]

    outcomes = make_finetune_seed_evals(results, draw, draw)
    csv_path = write_finetune_seed_table(results, results / "tables", SEEDS, 0, SETTINGS, "synthetic")
    rows = read_rows(csv_path)
    assert [(r["setting"], int(r["finetune_seed"])) for r in rows] == [(s, seed) for seed in SEEDS for s in SETTINGS]
    for row in rows:
        seed, setting = int(row["finetune_seed"]), row["setting"]
        for col in columns():
            mine = outcomes[(seed, setting, col.name)]
            assert float(row[col.name]) == pytest.approx(100 * np.mean(mine), abs=1e-9)
            if setting == "none":
                assert row[f"{col.name}_p_vs_none"] == ""
                continue
            base = outcomes[(seed, "none", col.name)]
            expected = (paired_bootstrap(mine, base) if col.name.startswith("vqa")
                        else mcnemar_exact([v > 0 for v in mine], [v > 0 for v in base]))
            assert float(row[f"{col.name}_p_vs_none"]) == pytest.approx(expected, abs=1e-12)


def test_the_markdown_counts_the_seeds_ahead_and_those_that_meet_the_default_run_target(tmp_path):
    results = tmp_path / "results"
    half = N // 2

    def full(seed, col):
        if seed == 0:  # right wherever none is, and on 12 more: ahead everywhere, McNemar p < 0.001
            return [1.0] * (half + 12) + [0.0] * (half - 12)
        if seed == 2 and col == "vqa_test_dev":  # behind on VQA
            return [1.0] * (half - 1) + [0.0] * (half + 1)
        return [1.0] * (half + 1) + [0.0] * (half - 1)  # one example ahead: p = 1

    make_finetune_seed_evals(results, full)
    csv_path = write_finetune_seed_table(results, results / "tables", SEEDS, 0, SETTINGS, "synthetic")
    md = csv_path.with_suffix(".md").read_text(encoding="utf-8")
    titles = {c.name: c.title for c in columns()}
    assert f"- {titles['vcr_q2a_val']}: VL-BERT BASE ahead on 3 of 3 seeds, with p < 0.05 on 1." in md
    assert f"- {titles['vqa_test_dev']}: VL-BERT BASE ahead on 2 of 3 seeds, with p < 0.05 on 1." in md
    assert "with p < 0.05 on at least two (the default run's target): on 1 of 3 seeds (0)." in md
    assert "| VL-BERT BASE | 0 | 80.0 (p<0.001) |" in md
    assert "| w/o pre-training | mean ± std | 50.0 ± 0.0 |" in md


def test_fewer_than_three_seeds_or_a_missing_eval_is_an_error_and_nothing_is_half_written(tmp_path):
    results = tmp_path / "results"
    make_finetune_seed_evals(results, lambda seed, col: [1.0] * N)
    with pytest.raises(ValueError, match=r"at least 3 distinct seeds, got \[0, 1\]"):
        write_finetune_seed_table(results, results / "tables", [0, 1], 0, SETTINGS, "synthetic")
    with pytest.raises(ValueError, match="needs 'none' and a pre-trained setting"):
        write_finetune_seed_table(results, results / "tables", SEEDS, 0, ["full"], "synthetic")
    missing = results / "finetune_seeds/2/eval/vqa/full/full/val.json"
    missing.unlink()
    with pytest.raises(FileNotFoundError, match=f"eval JSON {missing} is missing"):
        write_finetune_seed_table(results, results / "tables", SEEDS, 0, SETTINGS, "synthetic")
    assert not (results / "tables/finetune_seeds.csv").exists()


def test_the_target_fine_tunes_the_default_runs_pre_trained_models_again_per_seed(tmp_path):
    proc = snakemake(tmp_path, "-n", "--cores", "1", "results/tables/finetune_seeds.csv",
                     "--configfile", str(CI_CONFIG), str(REPO / "config/seeds.yaml"), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    counts = planned_rules(proc.stdout + proc.stderr)
    finetune_tasks = len({type(task_of_eval(c.eval_task)) for c in columns()})  # RefCOCO+: one task, two tracks
    # seed 0 is the config's seed: the default run's own fine-tunings; seeds 1 and 2 fine-tune again,
    # from the same pre-training (no pre-training runs for them)
    assert counts["pretrain"] == len(SETTINGS) and "pretrain_seed" not in counts
    assert counts["finetune"] == len(SETTINGS) * finetune_tasks
    assert counts["finetune_fseed"] == 2 * len(SETTINGS) * finetune_tasks
    assert counts["evaluate_fseed"] == 2 * len(SETTINGS) * len(columns())
    assert counts["finetune_seeds_table"] == 1
    job = next(block for block in proc.stdout.split("\n\n")
               if "rule finetune_fseed:" in block and "results/finetune_seeds/2/finetune/vqa/full/full/" in block)
    assert "results/pretrain/full/model.safetensors" in job
    # without the seeds config the target says what it needs
    proc = snakemake(tmp_path, "-n", "--cores", "1", "results/tables/finetune_seeds.csv",
                     "--configfile", str(CI_CONFIG), timeout=300)
    assert proc.returncode != 0 and "config/seeds.yaml" in proc.stdout + proc.stderr
