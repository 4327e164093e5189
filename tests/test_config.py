"""The config schema fills defaults and rejects bad values, naming the key, before any job runs."""

import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from snakemake.utils import validate

REPO = Path(__file__).resolve().parents[1]
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
        ({"rois": {"min_boxes": 0}}, "min_boxes"),
        ({"pretrain": {"settings": ["a", "zz"]}}, "settings"),
        ({"cc": {"resize": {"mode": "stretch"}}}, "mode"),
        ({"unknown_section": 1}, "unknown_section"),
    ],
)
def test_bad_value_is_rejected_with_the_key_named(override, key):
    with pytest.raises(Exception) as err:
        validate(merged(override), SCHEMA)
    assert key in str(err.value)


def test_bad_value_fails_before_any_job_runs(tmp_path):
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump({"finetune": {"vqa": {"lr": -0.1}}}))
    proc = subprocess.run(
        [sys.executable, "-m", "snakemake", "-s", str(REPO / "Snakefile"), "-d", str(tmp_path),
         "--configfile", str(tmp_path / "bad.yaml"), "--cores", "1", "results/tables/table4_ablation.csv"],
        capture_output=True, text=True, timeout=120,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "Error validating config file" in out
    assert "['finetune']['vqa']['lr']" in out
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
