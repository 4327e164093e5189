"""Table 4 over training seeds: the mean ± std aggregation, and the plan of its target."""

import csv
import json
from pathlib import Path

import numpy as np
import pytest
from test_workflow import CI_CONFIG, REPO, planned_rules, snakemake

from vlbert_core.tables import table_specs
from vlbert_core.stats import mcnemar_exact, paired_bootstrap
from vlbert_core.tables.seeds import TABLE4_CLAIMS, check_claims, paper_columns, seed_results_dir, write_seed_table
from vlbert_core.tasks.registry import task_of_eval

pytestmark = pytest.mark.workflow

SETTINGS = ["none", "a", "b", "c", "d", "full"]
SEEDS = [0, 1, 2]
COLUMNS = table_specs()["table4_ablation"].measured_columns()


NUM_EXAMPLES = 24


def write_predictions(path: Path, eval_task: str, rng: np.random.Generator, p_right: float) -> list[float]:
    """A scored predictions file as `evaluate` writes it; returns the per-example outcomes the paired tests read."""
    if eval_task.startswith("vqa"):
        scores = rng.choice([0.0, 0.3, 0.6, 1.0], NUM_EXAMPLES, p=[1 - p_right, 0.0, 0.0, p_right])
        rows = [{"question_id": i, "answer": "yes", "accuracy": float(v)} for i, v in enumerate(scores)]
        outcomes = [r["accuracy"] for r in rows]
    else:
        right = rng.random(NUM_EXAMPLES) < p_right
        key = (lambda i: {"annot_id": f"val-{i}"}) if eval_task.startswith("vcr") else (
            lambda i: {"ref_id": i, "sent_id": 100 + i})
        rows = [{**key(i), "correct": bool(c)} for i, c in enumerate(right)]
        outcomes = [float(c) for c in right]
    path.write_text(json.dumps(rows))
    return outcomes


def make_seed_evals(results: Path, default_seed: int = 0, outcomes: dict | None = None) -> dict[tuple, float]:
    """An eval JSON per seed x setting x Table 4 column, with distinct values, and its predictions file (the
    per-example outcomes go into `outcomes` by the same key); returns the values by key."""
    values = {}
    rng = np.random.default_rng(7)
    for seed in SEEDS:
        for s, setting in enumerate(SETTINGS):
            for c, col in enumerate(COLUMNS):
                value = 20.0 + s + c / 3 + seed * (1.5 + s / 7)
                path = (seed_results_dir(results, seed, default_seed) / "eval" / col.eval_task / setting / "half"
                        / f"{col.eval_split}.json")
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(json.dumps({"task": col.eval_task, "value": value, "split": col.eval_split,
                                            "num_examples": NUM_EXAMPLES, "setting": setting,
                                            "predictions": str(path.with_suffix(".predictions.json"))}))
                right = write_predictions(path.with_suffix(".predictions.json"), col.eval_task, rng, 0.3 + 0.1 * s)
                values[(seed, setting, col.name)] = value
                if outcomes is not None:
                    outcomes[(seed, setting, col.name)] = right
    return values


def test_the_default_seed_is_the_default_run_and_other_seeds_have_their_own_tree(tmp_path):
    assert seed_results_dir(tmp_path, 0, 0) == tmp_path
    assert seed_results_dir(tmp_path, 2, 0) == tmp_path / "seeds" / "2"
    assert seed_results_dir(tmp_path, 0, 7) == tmp_path / "seeds" / "0"


def test_each_cell_is_the_mean_and_sample_std_over_the_seeds(tmp_path):
    results = tmp_path / "results"
    values = make_seed_evals(results)
    csv_path = write_seed_table(results, results / "tables", SEEDS, 0, SETTINGS, "synthetic")
    with open(csv_path, newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    assert [r["setting"] for r in rows] == SETTINGS
    for row in rows:
        assert row["seeds"] == "0 1 2"
        for col in COLUMNS:
            runs = [values[(seed, row["setting"], col.name)] for seed in SEEDS]
            assert [float(v) for v in row[f"{col.name}_values"].split()] == runs
            assert float(row[f"{col.name}_mean"]) == pytest.approx(np.mean(runs), abs=1e-12)
            assert float(row[f"{col.name}_std"]) == pytest.approx(np.std(runs, ddof=1), abs=1e-12)
    assert rows[0]["vcr_q2a_val_paper"] == "72.9"  # the paper's w/o pre-training, Table 4
    md = csv_path.with_suffix(".md").read_text(encoding="utf-8")
    none_runs = [values[(seed, "none", "vcr_q2a_val")] for seed in SEEDS]
    assert f"| 72.9 / {np.mean(none_runs):.1f} ± {np.std(none_runs, ddof=1):.1f} |" in md
    # every later setting is higher here, so "(c) <= (b)" is the one claim that fails
    assert "| sentence-image relationship prediction does not help: (c) <= (b) on average | **no** |" in md
    assert md.count("| yes |") == len(TABLE4_CLAIMS) - 1


def test_each_setting_is_compared_with_none_on_the_examples_of_every_seed_pooled(tmp_path):
    results = tmp_path / "results"
    outcomes: dict = {}
    values = make_seed_evals(results, outcomes=outcomes)
    csv_path = write_seed_table(results, results / "tables", SEEDS, 0, SETTINGS, "synthetic")
    with open(csv_path, newline="", encoding="utf-8") as f:
        rows = {r["setting"]: r for r in csv.DictReader(f)}
    assert all(rows["none"][f"{c.name}_pooled_p_vs_none"] == rows["none"][f"{c.name}_diff_vs_none"] == ""
               for c in COLUMNS)
    for setting in SETTINGS[1:]:
        for col in COLUMNS:
            # seed s of the setting against seed s of `none`, the seeds one after another
            ours = [x for seed in SEEDS for x in outcomes[(seed, setting, col.name)]]
            base = [x for seed in SEEDS for x in outcomes[(seed, "none", col.name)]]
            test = paired_bootstrap if col.eval_task.startswith("vqa") else mcnemar_exact
            assert float(rows[setting][f"{col.name}_pooled_p_vs_none"]) == test(ours, base), (setting, col.name)
            diff = np.mean([values[(seed, setting, col.name)] - values[(seed, "none", col.name)] for seed in SEEDS])
            assert float(rows[setting][f"{col.name}_diff_vs_none"]) == pytest.approx(diff, abs=1e-12)
    md = csv_path.with_suffix(".md").read_text(encoding="utf-8")
    assert "## Against w/o pre-training, every seed's examples pooled" in md
    full = rows["full"]
    ahead = sum(float(full[f"{c}_diff_vs_none"]) > 0 and float(full[f"{c}_pooled_p_vs_none"]) < 0.05
                for c in paper_columns())
    assert ahead > 0
    pooled_row = next(line for line in md.splitlines() if line.startswith("| VL-BERT BASE | +"))
    assert pooled_row.endswith(f" | {ahead} |")
    # one seed scored on other examples than `none`'s is an error naming the column
    path = results / "seeds/1/eval/refcoco_det/b/half/val.predictions.json"
    path.write_text(json.dumps(json.loads(path.read_text())[:-1]))
    with pytest.raises(ValueError, match=r"RefCOCO\+ detected val, seed 1: setting 'b' and setting 'none' were evaluated on "
                                         r"different examples"):
        write_seed_table(results, results / "tables2", SEEDS, 0, SETTINGS, "synthetic")


def test_fewer_than_three_seeds_or_a_missing_run_is_an_error(tmp_path):
    results = tmp_path / "results"
    make_seed_evals(results)
    with pytest.raises(ValueError, match=r"at least 3 distinct seeds, got \[0, 1\]"):
        write_seed_table(results, results / "tables", [0, 1], 0, SETTINGS, "synthetic")
    missing = results / "seeds/2/eval/vqa/c/half/val.json"
    missing.unlink()
    with pytest.raises(FileNotFoundError, match=f"eval JSON {missing} is missing"):
        write_seed_table(results, results / "tables", SEEDS, 0, SETTINGS, "synthetic")
    assert not (results / "tables/table4_seeds.csv").exists()  # nothing half-written


def test_the_seeds_target_plans_two_more_training_runs_per_setting_and_shares_the_world(tmp_path):
    proc = snakemake(tmp_path, "-n", "--cores", "1", "results/tables/table4_seeds.csv",
                     "--configfile", str(CI_CONFIG), str(REPO / "config/seeds.yaml"), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    counts = planned_rules(proc.stdout + proc.stderr)
    settings, columns = len(SETTINGS), len(COLUMNS)
    tasks = len({task_of_eval(col.eval_task).name for col in COLUMNS})  # VQA's two columns share its fine-tune
    # seed 0 is the config's seed: the default run's own jobs; seeds 1 and 2 train again
    assert counts["pretrain"] == settings and counts["pretrain_seed"] == 2 * settings
    assert counts["finetune_seed"] == 2 * settings * tasks and counts["evaluate_seed"] == 2 * settings * columns
    assert counts["world"] == counts["train_detector"] == counts["table4_seeds"] == 1
    assert "results/seeds/2/pretrain/full/model.safetensors" in proc.stdout
    # without the seeds config the target says what it needs
    proc = snakemake(tmp_path, "-n", "--cores", "1", "results/tables/table4_seeds.csv",
                     "--configfile", str(CI_CONFIG), timeout=300)
    assert proc.returncode != 0 and "config/seeds.yaml" in proc.stdout + proc.stderr


def claim_rows(**means: dict[str, float]) -> list[dict]:
    return [{"setting": s, **{f"{c}_mean": v for c, v in cols.items()}} for s, cols in means.items()]


def test_the_papers_claims_name_columns_of_table4():
    names = set(paper_columns())
    assert names == {"vcr_q2a_val", "vcr_qa2r_val", "vqa_test_dev", "refcoco_det_val"}  # not the held-out concepts
    for claim in TABLE4_CLAIMS:
        assert set(claim.columns or names) <= names, claim.text


def test_each_claim_is_checked_on_the_means():
    cols = ("vcr_q2a_val", "vcr_qa2r_val", "vqa_test_dev", "refcoco_det_val")
    base = dict.fromkeys(cols, 30.0)
    rows = claim_rows(
        none=base,
        a={**base, "refcoco_det_val": 33.0},
        b={**base, "refcoco_det_val": 32.0, "vcr_q2a_val": 31.0},  # (b) < (a) on RefCOCO+: claim fails
        c={**base, "vqa_test_dev": 29.0, "refcoco_det_val": 35.0},  # 29 < none on VQA; average above (b)
        d={**base, "vcr_q2a_val": 31.0, "vcr_qa2r_val": 30.5},
        full={**base, "vcr_q2a_val": 35.0},
    )
    checked = {c["claim"]: c for c in check_claims(rows)}
    holds = {text: c["holds"] for text, c in checked.items()}
    assert [holds[c.text] for c in TABLE4_CLAIMS] == [True, True, False, True, True, False, False, True]
    average = checked[TABLE4_CLAIMS[6].text]["detail"]
    assert average == "c − b: average difference +0.25"  # ((30-31) + 0 + (29-30) + (35-32)) / 4
    assert "refcoco_det_val -1.00" in checked[TABLE4_CLAIMS[5].text]["detail"]


def test_a_claim_on_a_setting_that_was_not_run_says_so():
    checked = check_claims(claim_rows(none={"vcr_q2a_val": 1.0}), TABLE4_CLAIMS[:1])
    assert checked[0]["holds"] is None and "not in the table" in checked[0]["detail"]
