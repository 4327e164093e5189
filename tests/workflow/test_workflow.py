"""End to end: the real workflow on config/ci.yaml (the smallest world) in a temporary directory."""

import base64
import csv
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.workflow

REPO = Path(__file__).resolve().parents[2]
CI_CONFIG = REPO / "config" / "ci.yaml"
TARGET = "results/tables/table4_ablation.csv"
REPORT = "results/report/index.html"
COMPARISON = "results/tables/model_comparison.csv"
ALL_RULES = {"world", "partition_cc", "download_cc", "shard_text", "train_detector", "extract_rois", "pretrain",
             "finetune", "evaluate", "tables"}


def snakemake(workdir: Path, *args: str, timeout: int = 1500) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "snakemake", "-s", str(REPO / "Snakefile"), "-d", str(workdir), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


def planned_rules(dry_run_output: str) -> dict[str, int]:
    """Rule → job count from the 'Job stats' table of a dry run."""
    stats = dry_run_output.split("Job stats:", 1)[1]
    counts = {}
    for line in stats.splitlines():
        m = re.match(r"^(\w+)\s+(\d+)\s*$", line.strip())
        if m and m.group(1) != "total":
            counts[m.group(1)] = int(m.group(2))
    return counts


def start_ci_run(workdir: Path) -> subprocess.Popen:
    """The end-to-end run of config/ci.yaml (Table 4, the report, the model comparison: ~170 jobs), in the
    background; Snakemake's console goes to ci_run.stderr beside `workdir`. tests/conftest.py starts it before
    the session's first test, so that it runs beside the other test modules rather than after them."""
    workdir.mkdir(parents=True)
    with open(workdir.parent / "ci_run.stderr", "w") as console:
        return subprocess.Popen([sys.executable, "-m", "snakemake", "-s", str(REPO / "Snakefile"), "-d", str(workdir),
                                 "--configfile", str(CI_CONFIG), "--cores", "2", TARGET, REPORT, COMPARISON],
                                stdout=subprocess.DEVNULL, stderr=console)


@pytest.fixture(scope="module")
def ci_run(request, module_tmp_path):
    from conftest import CI_RUN

    workdir, proc = request.config.stash.get(CI_RUN, (None, None))
    if proc is None:   # not started before the first test (tests/conftest.py): start it now
        workdir = module_tmp_path / "ci_run"
        proc = start_ci_run(workdir)
    try:
        proc.wait(timeout=1800)
    except subprocess.TimeoutExpired:
        proc.terminate()
        raise
    if proc.returncode != 0:
        logs = "\n".join(f"== {p}\n{p.read_text()[-3000:]}" for p in sorted(workdir.glob("logs/**/*.log"))[-5:])
        console = (workdir.parent / "ci_run.stderr").read_text()
        pytest.fail(f"workflow failed:\n{console[-6000:]}\n{logs}")
    failed_before = request.session.testsfailed
    yield workdir
    if workdir.parent != module_tmp_path and request.session.testsfailed == failed_before:
        shutil.rmtree(workdir.parent, ignore_errors=True)   # as module_tmp_path's own directory is


def test_a_finished_run_ends_with_where_the_results_are(ci_run):
    tables = [f"results/tables/{t}.{ext}" for t in ("table1_vcr", "table2_vqa", "table3_refcoco", "table4_ablation")
              for ext in ("csv", "md")]
    tables += [f"results/tables/{t}.{ext}" for t in ("model_comparison", "retrieval") for ext in ("csv", "md")]
    lines = (ci_run.parent / "ci_run.stderr").read_text().rstrip().splitlines()
    start = lines.index(f"Results (in {ci_run}):")
    assert [line.strip() for line in lines[start + 1:start + 14]] == [*tables, REPORT]
    # only Snakemake's own two closing lines (complete log, elapsed time) come after
    assert len(lines) - (start + 14) <= 2


def test_every_training_job_wrote_tensorboard_event_files(ci_run):
    from test_tensorboard import assert_events_match_metrics

    jobs = sorted(ci_run.glob("results/pretrain/*/metrics.jsonl")) + sorted(
        ci_run.glob("results/finetune/*/*/*/metrics.jsonl"))
    done = planned_rules((ci_run.parent / "ci_run.stderr").read_text())
    assert len(jobs) == done["pretrain"] + done["finetune"] > 0
    for metrics in jobs:
        assert_events_match_metrics(metrics.parent)


def test_the_default_run_benchmark_times_the_step_parts_of_a_finished_run(ci_run):
    """benchmarks/default_run.py hooks into the real training loops: a renamed batch source there must fail here."""
    cmd = [sys.executable, str(REPO / "benchmarks" / "default_run.py"), str(ci_run), "--configfile", str(CI_CONFIG),
           "--steps", "2", "--threads", "1"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Pre-training, setting d:" in proc.stdout and "Fine-tuning vqa from setting d:" in proc.stdout
    assert proc.stdout.count("| **step** |") == 2


def test_dry_run_of_the_default_config_plans_every_stage(tmp_path):
    proc = snakemake(tmp_path, "-n", "--cores", "1", TARGET, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    counts = planned_rules(proc.stdout + proc.stderr)
    assert ALL_RULES <= set(counts), f"missing rules: {ALL_RULES - set(counts)}"
    assert counts["pretrain"] == 6
    assert counts["finetune"] == 4 * 6 + 4 * 2  # Table 4 at half schedule, Tables 1–3 at full


def test_table4_has_six_settings_and_five_measured_columns(ci_run):
    with open(ci_run / TARGET, newline="") as f:
        rows = [r for r in csv.DictReader(f) if r["source"] == "measured"]
    assert [r["setting"] for r in rows] == ["none", "a", "b", "c", "d", "full"]
    # the paper's four, and the VQA questions with a word no training question has
    columns = ["vcr_q2a_val", "vcr_qa2r_val", "vqa_test_dev", "vqa_held_out_concepts", "refcoco_det_val"]
    for row in rows:
        for col in columns:
            record = json.loads((ci_run / row[f"{col}_eval"]).read_text())
            assert float(row[col]) == record["value"]
            assert int(row[f"{col}_examples"]) == record["num_examples"] > 0
            assert (ci_run / record["predictions"]).exists()


def test_the_model_comparison_pairs_the_two_families_over_the_seeds(ci_run):
    from vlbert_core.tables.seeds import seed_results_dir
    from vlbert_core.tasks.registry import comparison_columns

    with open(ci_run / COMPARISON, newline="") as f:
        rows = {r["setting"]: r for r in csv.DictReader(f)}
    assert [(s, r["family"]) for s, r in rows.items()] == [("none", "VL-BERT"), ("c", "VL-BERT"),
                                                           ("vilbert_none", "ViLBERT"), ("vilbert", "ViLBERT")]
    seeds = yaml.safe_load(CI_CONFIG.read_text())["compare"]["seeds"]
    for setting, row in rows.items():
        assert row["seeds"] == " ".join(map(str, seeds))
        assert int(row["parameters"]) > 0 and (float(row["pretrain_train_s"]) > 0) == (setting in ("c", "vilbert"))
        for col in comparison_columns():
            values = [float(v) for v in row[f"{col.name}_values"].split()]
            for seed, value in zip(seeds, values):
                root = seed_results_dir(ci_run / "results", seed, default_seed=0)  # config.yaml's seed
                record = json.loads((root / f"eval/{col.eval_task}/{setting}/half/{col.eval_split}.json").read_text())
                assert value == record["value"]
            p = row[f"{col.name}_p_vs_vlbert"]
            assert (p != "") == setting.startswith("vilbert") and (p == "" or 0.0 <= float(p) <= 1.0)
    assert int(rows["vilbert"]["parameters"]) > int(rows["c"]["parameters"])  # a second stream and co-attention
    vilbert_model = json.loads((ci_run / "results/pretrain/vilbert/config.json").read_text())
    assert vilbert_model["model_type"] == "vilbert"
    assert (ci_run / "results/tables/model_comparison.md").read_text().count("| ViLBERT |") == 2
    # retrieval: R@1/5/10 fine-tuned for every setting, zero-shot from the image-caption heads of c and vilbert
    with open(ci_run / "results/tables/retrieval.csv", newline="") as f:
        retrieval = {r["setting"]: r for r in csv.DictReader(f)}
    assert list(retrieval) == [*rows, "chance"]
    # the chance row ranks the test images at random: R@K = K / N, R@1 the eval JSON's baseline
    chance = retrieval.pop("chance")
    baseline = json.loads((ci_run / "results/eval/retrieval/none/half/test.json").read_text())["baseline"]
    assert float(chance["finetuned_r1_mean"]) == pytest.approx(baseline) and \
        float(chance["finetuned_r10_mean"]) == pytest.approx(min(100.0, 10 * baseline))
    for setting, row in retrieval.items():
        assert 0.0 <= float(row["finetuned_r1_mean"]) <= float(row["finetuned_r10_mean"]) <= 100.0
        assert (row["zero_shot_r1_mean"] != "") == (setting in ("c", "vilbert"))
    zero_shot = json.loads((ci_run / "results/zero_shot/retrieval/vilbert/test.json").read_text())
    assert zero_shot["schedule"] == "zero_shot" and zero_shot["value"] == float(
        retrieval["vilbert"]["zero_shot_r1_values"].split()[0])


def test_all_four_tables_are_written(ci_run):
    for name in ["table1_vcr", "table2_vqa", "table3_refcoco", "table4_ablation"]:
        assert (ci_run / f"results/tables/{name}.csv").stat().st_size > 0
        assert (ci_run / f"results/tables/{name}.md").stat().st_size > 0


def test_the_report_shows_every_plot_and_each_image_exists(ci_run):
    from vlbert_core.report import PLOTS

    report = ci_run / REPORT
    sources = re.findall(r'<img src="([^"]+)"', report.read_text(encoding="utf-8"))
    assert sorted(sources) == sorted(filename for filename, _ in PLOTS.values())
    for src in sources:
        assert (report.parent / src).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", src


def assert_outputs_are_vqa_or_tables(dry_run_output: str) -> None:
    """Every output a dry run plans belongs to a VQA fine-tune, a VQA evaluation (its held-out concepts too) or the
    tables."""
    for line in re.findall(r"^\s+output: (.+)$", dry_run_output, flags=re.M):
        for path in line.split(", "):
            assert path.startswith(("results/finetune/vqa/", "results/eval/vqa/",
                                    "results/eval/vqa_held_out_concepts/", "results/tables/")), path


def test_second_run_has_nothing_to_do(ci_run):
    proc = snakemake(ci_run, "-n", "--configfile", str(CI_CONFIG), "--cores", "1", TARGET, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Nothing to be done" in proc.stdout + proc.stderr


def dry_run_with_edited_config(ci_run: Path, tmp_path: Path, edit) -> str:
    """The output of `snakemake -n` against the finished run, with config/ci.yaml changed by edit(config)
    (re-dumped, so only the values differ)."""
    edited = yaml.safe_load(CI_CONFIG.read_text())
    edit(edited)
    (tmp_path / "edited.yaml").write_text(yaml.safe_dump(edited))
    proc = snakemake(ci_run, "-n", "--configfile", str(tmp_path / "edited.yaml"), "--cores", "1", TARGET,
                     timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout + proc.stderr


def test_editing_the_vqa_learning_rate_reruns_only_vqa_and_tables(ci_run, tmp_path):
    def double_vqa_lr(config):
        config["finetune"]["vqa"]["lr"] = config["finetune"]["vqa"]["lr"] * 2

    out = dry_run_with_edited_config(ci_run, tmp_path, double_vqa_lr)
    counts = planned_rules(out)
    assert set(counts) == {"finetune", "evaluate", "tables"}, counts
    assert_outputs_are_vqa_or_tables(out)
    assert counts["finetune"] == 6 + 2  # every setting at half, none and full at full


def edited_copy(tmp_path: Path, relative: str, edit) -> Path:
    """A copy of the workflow and library with one file edited, to dry-run against a finished run."""
    copy = tmp_path / "edited_repo"
    ignore = shutil.ignore_patterns("__pycache__", ".snakemake")
    for name in ("workflow", "config", "vlbert_core"):
        shutil.copytree(REPO / name, copy / name, ignore=ignore)
    shutil.copy(REPO / "Snakefile", copy / "Snakefile")
    path = copy / relative
    path.write_text(edit(path.read_text(encoding="utf-8")), encoding="utf-8")
    return copy


def test_editing_the_vqa_head_code_reruns_only_vqa_and_tables(ci_run, tmp_path):
    copy = edited_copy(tmp_path, "vlbert_core/tasks/modeling/vqa.py",
                       lambda s: s.replace("inner = 2 * hidden_size", "inner = 3 * hidden_size"))
    cmd = [sys.executable, "-m", "snakemake", "-s", str(copy / "Snakefile"), "-d", str(ci_run), "-n",
           "--configfile", str(CI_CONFIG), "--cores", "1", TARGET]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout + proc.stderr
    counts = planned_rules(out)
    assert set(counts) == {"finetune", "evaluate", "tables"}, counts
    assert counts["finetune"] == 6 + 2
    assert_outputs_are_vqa_or_tables(out)


def test_adding_one_cc_shard_plans_that_shard_and_its_downstream_only(ci_run, tmp_path):
    def add_one_shard(config):
        assert config["cc"]["num_shards"]["train"] == 1
        config["cc"]["num_shards"]["train"] = 2

    out = dry_run_with_edited_config(ci_run, tmp_path, add_one_shard)
    counts = planned_rules(out)
    assert counts["download_cc"] == 1 and counts["extract_rois"] == 1
    assert "partition_cc" not in counts and "world" not in counts and "train_detector" not in counts
    outputs = " ".join(re.findall(r"^\s+output: (.+)$", out, flags=re.M))
    assert "results/shards/cc/train-00001.tar" in outputs and "results/rois/cc/train-00001.parquet" in outputs
    assert "train-00000" not in outputs, "no other shard is downloaded or extracted again"
    assert counts["pretrain"] == 6 and counts["finetune"] == 32  # everything downstream


def test_the_pipeline_runs_on_imported_bottom_up_rois(ci_run, tmp_path):
    """Bring your own RoIs, end to end: bottom-up-attention TSVs of the VQA images (generated here from the
    detector's boxes of the finished run) become rois.source for VQA; the workflow imports them and
    fine-tunes and evaluates VQA on them. Runs in a copy of the finished run, so the other tests see it unchanged."""
    import numpy as np

    from vlbert_core.detector import coco_image_id
    from vlbert_core.rois import read_rois, read_rois_metadata
    from vlbert_core.detector.bottom_up import TSV_FIELDS

    workdir = tmp_path / "run"
    # results/ and resources/ (GBs) hard-linked: every job writes its outputs under a new name and renames them,
    # so the finished run's files stay as they are; Snakemake's records, logs and benchmarks are copied.
    big = {"results", "resources"}
    shutil.copytree(ci_run, workdir, symlinks=True, ignore=lambda folder, names: big & set(names)
                    if Path(folder) == ci_run else set())
    for name in big:
        shutil.copytree(ci_run / name, workdir / name, symlinks=True, copy_function=os.link)
    rng = np.random.default_rng(0)
    sizes = {}
    for split in ("train", "val"):
        records = [r for r in read_rois(workdir / f"results/rois/vqa/{split}.parquet").values() if r.status == "ok"]
        sizes[split] = len(records)
        with open(tmp_path / f"vqa_{split}.tsv", "w", newline="") as tsv:
            for r in records:
                # bottom-up boxes are pixel indices of the image: x2 <= image_w - 1
                boxes = np.minimum(r.boxes, [r.image_w - 1, r.image_h - 1, r.image_w - 1, r.image_h - 1])
                features = rng.standard_normal((len(boxes), 16)).astype(np.float32)
                fields = [coco_image_id(r.key), str(r.image_w), str(r.image_h), str(len(boxes)),
                          base64.b64encode(boxes.astype(np.float32).tobytes()).decode(),
                          base64.b64encode(features.tobytes()).decode()]
                assert len(fields) == len(TSV_FIELDS)
                tsv.write("\t".join(fields) + "\r\n")
    override = tmp_path / "bottom_up.yaml"
    override.write_text(yaml.safe_dump({"rois": {"source": {"vqa": str(tmp_path / "vqa_{split}.tsv")}}}))
    target = "results/eval/vqa/full/half/val.json"

    proc = snakemake(workdir, "--configfile", str(CI_CONFIG), str(override), "--cores", "2", target)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    counts = planned_rules(out)
    assert counts == {"import_task_rois": 2, "finetune": 1, "evaluate": 1}, counts
    for split in ("train", "val"):
        meta = read_rois_metadata(workdir / f"results/rois/vqa/{split}.parquet")
        assert str(tmp_path / f"vqa_{split}.tsv") in json.dumps(meta), meta
        imported = read_rois(workdir / f"results/rois/vqa/{split}.parquet")
        assert sum(r.status == "ok" for r in imported.values()) == sizes[split]
    record = json.loads((workdir / target).read_text())
    assert record["num_examples"] > 0 and 0.0 <= record["value"] <= 100.0  # VQA accuracy in %
    assert (workdir / record["predictions"]).exists()
