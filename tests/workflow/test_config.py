"""The config schema fills defaults and rejects bad values, naming the key, before any job runs."""

import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from snakemake.utils import validate

pytestmark = pytest.mark.workflow

REPO = Path(__file__).resolve().parents[2]
SCHEMA = str(REPO / "config" / "schema.yaml")


def load(name):
    return yaml.safe_load((REPO / "config" / name).read_text())


def test_default_config_is_valid_and_gets_defaults():
    config = load("config.yaml")
    del config["rois"]["nms_iou"]
    validate(config, SCHEMA)
    assert config["rois"]["nms_iou"] == 0.3
    assert config["finetune"]["vqa"]["momentum"] == 0.9


def merged(override: dict) -> dict:
    """config.yaml with `override` merged in, the way Snakemake merges a --configfile."""
    def merge(base, extra):
        for key, value in extra.items():
            base[key] = merge(base.get(key, {}), value) if isinstance(value, dict) else value
        return base

    return merge(load("config.yaml"), override)


@pytest.mark.parametrize(
    "override, key",
    [
        ({"pretrain": {"steps": -1}}, "steps"),
        ({"finetune": {"vqa": {"optimizer": "adam"}}}, "optimizer"),
        ({"finetune": {"sentence_readout": "mean"}}, "sentence_readout"),
        ({"rois": {"min_boxes": 0}}, "min_boxes"),
        ({"pretrain": {"settings": ["a", "zz"]}}, "settings"),
        ({"cc": {"resize": {"mode": "stretch"}}}, "mode"),
        ({"cc": {"download": {"allow_file_urls": "yes"}}}, "allow_file_urls"),
        ({"unknown_section": 1}, "unknown_section"),
    ],
)
def test_bad_value_is_rejected_with_the_key_named(override, key):
    with pytest.raises(Exception) as err:
        validate(merged(override), SCHEMA)
    assert key in str(err.value)


def test_file_urls_are_read_only_where_the_config_says_so():
    """The world's TSVs are file:// URLs; a real TSV must not make the downloader read local files."""
    world = load("config.yaml")
    del world["cc"]["download"]["allow_file_urls"]
    validate(world, SCHEMA)
    assert world["cc"]["download"]["allow_file_urls"] is False, "the schema's default refuses file:// URLs"
    assert merged(load("ci.yaml"))["cc"]["download"]["allow_file_urls"] is True
    assert load("config.yaml")["cc"]["download"]["allow_file_urls"] is True
    for name in ("paper_base.yaml", "paper_large.yaml"):
        assert load(name)["cc"]["download"]["allow_file_urls"] is False, name


def test_bad_value_fails_before_any_job_runs(tmp_path):
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump({"finetune": {"vqa": {"lr": -0.1}}}))
    proc = subprocess.run(
        [sys.executable, "-m", "snakemake", "-s", str(REPO / "Snakefile"), "-d", str(tmp_path),
         "--configfile", str(tmp_path / "bad.yaml"), "--cores", "1", "results/tables/table4_ablation.csv"],
        capture_output=True, text=True, timeout=120,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    # one line naming the file and the key (vlbert_core/config_schema.py), not the schema (issue #56)
    assert f"configfile {tmp_path / 'bad.yaml'}: key finetune.vqa.lr: -0.1 is less than or equal to the minimum of 0" in out
    assert "Failed validating" not in out and "'properties'" not in out
    assert not (tmp_path / "resources").exists() and not (tmp_path / "results").exists()


def test_real_data_config_plans_fetch_and_hundreds_of_cc_shards_offline(tmp_path):
    """config/paper_base.yaml's data stage, dry run in an empty directory: nothing is downloaded."""
    proc = subprocess.run(
        [sys.executable, "-m", "snakemake", "-s", str(REPO / "Snakefile"), "-d", str(tmp_path), "-n",
         "--configfile", str(REPO / "config" / "paper_base.yaml"), "--cores", "1", "shards"],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    stats = proc.stdout.split("Job stats:", 1)[1]
    counts = {m.group(1): int(m.group(2)) for m in re.finditer(r"^(\w+)\s+(\d+)\s*$", stats, re.MULTILINE)}
    real = load("paper_base.yaml")
    assert counts["download_cc"] == real["cc"]["num_shards"]["train"] >= 100
    assert counts["partition_cc"] == 1 and counts["shard_text"] == 2
    fetched = {entry["path"] for entry in real["fetch"].values()}
    planned_fetches = set(re.findall(r"rule fetch:\n\s+output: (\S+)", proc.stdout))
    assert planned_fetches == fetched - {real["sources"]["cc"]["val"]}  # cc.splits is [train]
    assert counts["fetch"] == len(planned_fetches) and "world" not in counts
    assert not (tmp_path / "resources").exists() and not (tmp_path / "results").exists()


# ---- the paper-scale configs (config/paper_base.yaml, config/paper_large.yaml) -------------------------

PAPER_CONFIGS = ["paper_base.yaml", "paper_large.yaml"]
# Sections that must be the same in BASE and LARGE: the data, the detector and the schedules.
SHARED_PAPER_SECTIONS = ["dataset", "device", "fetch", "sources", "cc", "text", "detector", "rois",
                         "pretrain", "finetune"]


def hand_obtained_inputs(config: dict) -> list[str]:
    """The files of a real config that no rule makes and Snakemake needs for planning: the task
    annotation files (VQA v2, VCR, RefCOCO+; image folders are not rule inputs) and the detector
    checkpoint. The fetched sources are not among them: rule fetch plans those."""
    files = [config["detector"]["weights"]]
    splits = {"vqa": ["train", "val"], "vcr": ["train", "val"], "refcoco": ["train"]}
    for dataset, dataset_splits in splits.items():
        for key, path in config["sources"][dataset].items():
            if key != "images":
                files.extend(sorted({path.format(split=s) for s in dataset_splits}))
    return files


@pytest.mark.parametrize("name", PAPER_CONFIGS)
def test_paper_config_is_valid_and_has_the_paper_settings(name):
    config = merged(load(name))
    validate(config, SCHEMA)
    assert config["dataset"] == "real" and config["device"] == "cuda"
    assert config["detector"]["weights"] and (config["detector"]["min_size"], config["detector"]["max_size"]) == (600, 1000)
    assert (config["rois"]["score_threshold"], config["rois"]["min_boxes"], config["rois"]["max_boxes"]) == (0.5, 10, 100)
    assert config["model"]["max_rois"] == 101 and config["model"]["image_max_side"] == 1000
    assert config["model"]["num_hidden_layers"] == {"paper_base.yaml": 12, "paper_large.yaml": 24}[name]
    # the released visual input, not the embedded world's (config.yaml, merged below these files)
    assert (config["model"]["visual_scale_text_init"], config["model"]["visual_scale_object_init"]) == (0.0, 0.0)
    assert config["model"]["standardise_appearance"] is False and config["model"]["geometry_dim"] == 2048
    assert config["pretrain"]["settings"] == ["none", "a", "b", "c", "d", "full"]
    assert config["pretrain"]["max_text_len"] == 64
    assert config["pretrain"]["cc_batch_size"] == config["pretrain"]["text_batch_size"]  # 1:1 mixing
    # 10 epochs of the CC train rows at the released 16 GPUs x cc_batch_size CC samples a step
    rows, per_step = config["cc"]["expected_rows"]["train"], 16 * config["pretrain"]["cc_batch_size"]
    assert config["pretrain"]["steps"] == -(-10 * rows // per_step)
    assert config["finetune"]["schedules"] == {"full": 1.0, "half": 0.5}
    assert config["finetune"]["vqa"]["num_answers"] == 3129
    assert config["finetune"]["sentence_readout"] == "cls"  # released: the pooled [CLS] output
    assert config["finetune"]["vcr_q2a"]["optimizer"] == config["finetune"]["vcr_qa2r"]["optimizer"] == "sgd"
    # the released learning rates: LR per sample x the released batch
    assert config["finetune"]["vqa"]["lr"] == pytest.approx(6.25e-7 * 256)
    assert config["finetune"]["vcr_q2a"]["lr"] == pytest.approx(7.0e-5 * 64)
    assert config["finetune"]["refcoco"]["lr"] == pytest.approx(8.0e-7 * 32)


def test_paper_base_and_large_differ_only_in_the_model():
    base, large = load("paper_base.yaml"), load("paper_large.yaml")
    assert set(base) == set(large) == set(SHARED_PAPER_SECTIONS) | {"model"}
    for section in SHARED_PAPER_SECTIONS:
        assert base[section] == large[section], section
    assert base["model"]["bert_path"].endswith("bert-base-uncased")
    assert large["model"]["bert_path"].endswith("bert-large-uncased")


@pytest.fixture(scope="module")
def bytecode_cache(tmp_path_factory):
    """Where the dry-run subprocesses keep compiled modules. This environment sets
    PYTHONDONTWRITEBYTECODE, so every Snakemake process would compile its ~1,000 modules again
    (~6 s of CPU); sharing a cache outside the checkout makes the second dry run skip that."""
    return tmp_path_factory.mktemp("pycache")


@pytest.mark.parametrize("name", PAPER_CONFIGS)
def test_paper_config_plans_the_whole_table4_dag(name, tmp_path, bytecode_cache):
    """A dry run of Table 4 with the paper config plans every job, from the fetches to the table,
    given only the hand-obtained files (empty stand-ins here); nothing is downloaded or trained."""
    config = merged(load(name))
    fetched = {entry["path"] for entry in config["fetch"].values()}
    for path in hand_obtained_inputs(config):
        assert path not in fetched, path
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).touch()
    import os

    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env["PYTHONPYCACHEPREFIX"] = str(bytecode_cache)
    proc = subprocess.run(
        [sys.executable, "-m", "snakemake", "-s", str(REPO / "Snakefile"), "-d", str(tmp_path), "-n",
         "--configfile", str(REPO / "config" / name), "--cores", "1", "results/tables/table4_ablation.csv"],
        capture_output=True, text=True, timeout=300, env=env,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    table = proc.stdout.split("Job stats:", 1)[1].split("\n\n", 1)[0]
    counts = {m.group(1): int(m.group(2)) for m in re.finditer(r"^(\w+)\s+(\d+)\s*$", table, re.MULTILINE)}

    shards = config["cc"]["num_shards"]["train"]
    settings = len(config["pretrain"]["settings"])
    assert shards >= 100
    # Table 4: every setting x 4 tasks at the half schedule; Tables 1-3 (written by the same rule):
    # w/o pre-training and full x 4 tasks at the full schedule.
    finetunes = 4 * settings + 4 * 2
    # Table 4: VCR Q->A, QA->R, VQA, VQA held-out concepts, RefCOCO+ detected val per setting; Tables 1-3 per
    # paper setting: VCR Q->A, QA->R val, VQA val and its held-out concepts, RefCOCO+ GT and detected x
    # val/testA/testB.
    evaluations = 5 * settings + (2 + 2 + 6) * 2
    expected = {
        "fetch": len(fetched - {config["sources"]["cc"]["val"]}),  # cc.splits is [train]
        "partition_cc": 1,
        "download_cc": shards,
        "extract_rois": shards,
        "shard_text": 2,
        "extract_task_rois": 6,   # VQA train/val, RefCOCO+ train/val/testA/testB
        "pretrain": settings,
        "finetune": finetunes,
        "evaluate": evaluations,
        "derive_eval": 2,
        "tables": 1,
    }
    expected["total"] = sum(expected.values())
    assert counts == expected
    assert "world" not in counts and "train_detector" not in counts
    planned_fetches = set(re.findall(r"rule fetch:\n\s+output: (\S+)", proc.stdout))
    assert planned_fetches == fetched - {config["sources"]["cc"]["val"]}
    assert not any((tmp_path / path).exists() for path in fetched)
    assert not (tmp_path / "results").exists()


def _dry_run_paper_base_from(tmp_path, bytecode_cache, init_from: str, extra_yaml: str) -> str:
    """Snakemake's dry-run plan of Table 4 on config/paper_base.yaml plus `extra_yaml`, with empty stand-ins of
    the files a user obtains by hand and of the converted model directory `init_from`."""
    import os

    config = merged(load("paper_base.yaml"))
    for path in hand_obtained_inputs(config) + [f"{init_from}/model.safetensors", f"{init_from}/config.json"]:
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).touch()
    extra = tmp_path / "init_from.yaml"
    extra.write_text(extra_yaml)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env["PYTHONPYCACHEPREFIX"] = str(bytecode_cache)
    proc = subprocess.run(
        [sys.executable, "-m", "snakemake", "-s", str(REPO / "Snakefile"), "-d", str(tmp_path), "-n",
         "results/tables/table4_ablation.csv",
         "--configfile", str(REPO / "config" / "paper_base.yaml"), str(extra), "--cores", "1"],
        capture_output=True, text=True, timeout=300, env=env,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert not (tmp_path / "results").exists()
    return proc.stdout


def test_paper_base_with_init_from_fine_tunes_the_released_model_without_pretraining(tmp_path, bytecode_cache):
    """pretrain.init_from (a converted released VL-BERT): setting `released` is fine-tuned from it and
    evaluated for Tables 1-3, with no pretrain job of its own (empty stand-in files here)."""
    config = merged(load("paper_base.yaml"))
    init_from = "resources/weights/vl-bert-base-e2e"
    plan = _dry_run_paper_base_from(tmp_path, bytecode_cache, init_from, f"pretrain:\n  init_from: {init_from}\n")
    table = plan.split("Job stats:", 1)[1].split("\n\n", 1)[0]
    counts = {m.group(1): int(m.group(2)) for m in re.finditer(r"^(\w+)\s+(\d+)\s*$", table, re.MULTILINE)}
    settings = len(config["pretrain"]["settings"])
    assert counts["pretrain"] == settings                  # none for `released`
    assert counts["finetune"] == 4 * settings + 4 * 3      # Tables 1-3: none, full and released
    assert counts["evaluate"] == 5 * settings + (2 + 2 + 6) * 3
    assert counts["derive_eval"] == 3
    released_jobs = re.findall(r"rule finetune:\n\s+input: (\S+?),.*?\n\s+output: (\S+?),", plan)
    released = [inp for inp, out in released_jobs if "/released/" in out]
    assert len(released) == 4 and set(released) == {f"{init_from}/model.safetensors"}
    # the pre-training jobs start from BERT: none of them reads the released model
    pretrain_jobs = re.findall(r"rule pretrain:\n\s+input: ([^\n]+)", plan)
    assert len(pretrain_jobs) == settings and not any(init_from in inputs for inputs in pretrain_jobs)


def test_continue_init_from_pretrains_every_trained_setting_from_the_released_model(tmp_path, bytecode_cache):
    """pretrain.continue_init_from: settings a-d and full continue pre-training the init_from model (its
    heads.safetensors beside it), setting none stays the BERT initialisation."""
    init_from = "resources/weights/vl-bert-base-e2e"
    plan = _dry_run_paper_base_from(tmp_path, bytecode_cache, init_from,
                                    f"pretrain:\n  init_from: {init_from}\n  continue_init_from: true\n")
    jobs = re.findall(r"rule pretrain:\n\s+input: ([^\n]+)\n\s+output: results/pretrain/(\w+)/", plan)
    starts = {setting: f"{init_from}/model.safetensors" in inputs for inputs, setting in jobs}
    assert starts == {"none": False, "a": True, "b": True, "c": True, "d": True, "full": True}


def test_conda_environment_mirrors_pyproject():
    """envs/vlbert.yaml (for --software-deployment-method conda) installs exactly the project's dependencies."""
    import tomllib

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    env = yaml.safe_load((REPO / "envs" / "vlbert.yaml").read_text())["dependencies"]
    pip = next(entry["pip"] for entry in env if isinstance(entry, dict) and "pip" in entry)
    assert sorted(pip) == sorted(project)
