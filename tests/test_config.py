"""The config schema fills defaults and rejects bad values, naming the key, before any job runs."""

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
def test_bad_value_fails_before_any_job_with_the_key_named(tmp_path, override, key):
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(override))
    proc = subprocess.run(
        [sys.executable, "-m", "snakemake", "-n", "-s", str(REPO / "Snakefile"), "-d", str(tmp_path),
         "--configfile", str(tmp_path / "bad.yaml"), "--cores", "1"],
        capture_output=True, text=True, timeout=120,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "Error validating config file" in out
    assert key in out
    assert not (tmp_path / "resources").exists() and not (tmp_path / "results").exists()
