"""config/rehearsal.yaml: the real-data path (paper architecture, published layouts, workflow-made stand-ins of
the published weights, their conversion, init_from) on the synthetic world. The whole DAG is timed in
docs/rehearsal.md; here the config is checked, the whole DAG planned, and its released-model branch run."""

import json

import pytest
import torch
from snakemake.utils import validate
from test_config import REPO, SCHEMA, load, merged
from test_workflow import TARGET, planned_rules, snakemake

pytestmark = pytest.mark.workflow

REHEARSAL = REPO / "config" / "rehearsal.yaml"
# the released architecture's model options, which the rehearsal must share with config/paper_base.yaml
RELEASED_MODEL_KEYS = ["geometry_dim", "frozen_stages", "freeze_bn", "visual_scale_text_init", "visual_scale_object_init",
                       "standardise_appearance", "geometry_encoding", "end_visual_term", "text_only_visual_norm",
                       "text_only_layout", "masked_roi_input", "roi_sampling_ratio", "roi_cls_layer_norm", "visual_head_dilation",
                       "visual_stem_pool", "task_heads"]


def rehearsal_config() -> dict:
    config = merged(load("rehearsal.yaml"))
    validate(config, SCHEMA)
    return config


def test_rehearsal_has_the_paper_architecture_and_the_real_layouts():
    config, paper = rehearsal_config(), merged(load("paper_base.yaml"))
    assert {k: config["model"][k] for k in RELEASED_MODEL_KEYS} == {k: paper["model"][k] for k in RELEASED_MODEL_KEYS}
    # the sources are paper_base's paths under resources/rehearsal/ (no real resources/ is ever written)
    def rehearsal_path(path):
        return path.replace("resources/", "resources/rehearsal/", 1)

    for name in ("books", "wiki"):
        assert config["sources"][name] == rehearsal_path(paper["sources"][name])
    for name in ("vqa", "vcr", "refcoco", "detector"):
        assert config["sources"][name] == {k: rehearsal_path(v) for k, v in paper["sources"][name].items()}
    assert config["sources"]["cc"]["train"] == rehearsal_path(paper["sources"]["cc"]["train"])
    # every weight comes from a workflow-made stand-in of a published file, through its converter
    stand_ins, conversions = config["stand_ins"], config["convert"]
    detector = conversions[config["detector"]["weights"]]
    released = conversions[config["pretrain"]["init_from"]]
    assert detector["converter"] == "bottom-up" and released["converter"] == "vl-bert"
    for entry in (detector, released):
        assert entry["input"] in stand_ins
    assert released["visual_weights"] in stand_ins and released["bert_path"] == config["model"]["bert_path"]
    bert = stand_ins[config["model"]["bert_path"]]
    assert bert["kind"] == "bert" and bert["bert_layers"] == config["model"]["num_hidden_layers"]
    assert stand_ins[released["input"]]["bert_layers"] == config["model"]["num_hidden_layers"]


def test_rehearsal_plans_the_whole_dag_from_stand_ins_to_the_tables(tmp_path):
    proc = snakemake(tmp_path, "-n", "--cores", "1", TARGET, "--configfile", str(REHEARSAL), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    counts = planned_rules(proc.stdout + proc.stderr)
    settings = len(rehearsal_config()["pretrain"]["settings"])
    assert counts["stand_in"] == 3 and counts["stand_in_bert"] == 1
    assert counts["convert_weights"] == 1 and counts["convert_vlbert"] == 1
    assert "train_detector" not in counts  # detector.weights is the converted detector
    assert counts["pretrain"] == settings  # the released model is fine-tuned without pre-training
    assert counts["finetune"] == 4 * settings + 4 * 3  # Table 4 at half; none, full and released at full


def test_released_model_is_fine_tuned_from_workflow_made_stand_ins(tmp_path):
    """The rehearsal's released-model branch, end to end: stand-ins of the published files -> the three
    converters -> the converted detector's RoIs -> VQA fine-tuned from init_from -> its evaluation."""
    target = "results/eval/vqa/released/full/val.json"
    proc = snakemake(tmp_path, "--cores", "2", target, "--configfile", str(REHEARSAL), timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    counts = planned_rules(out)
    assert counts == {"stand_in": 3, "stand_in_bert": 1, "world": 1, "convert_weights": 1, "convert_vlbert": 1,
                      "extract_task_rois": 2, "finetune": 1, "evaluate": 1}, counts
    config = rehearsal_config()
    detector = torch.load(tmp_path / config["detector"]["weights"], weights_only=True)
    assert detector["num_classes"] == 1600  # the published class count, not cut
    assert detector["config"]["backbone"]["depth"] == 101 and detector["config"]["min_size"] == 128
    released = json.loads((tmp_path / config["pretrain"]["init_from"] / "config.json").read_text())
    assert (released["hidden_size"], released["num_attention_heads"], released["intermediate_size"],
            released["vocab_size"], released["num_hidden_layers"]) == (768, 12, 3072, 30522, 2)
    record = json.loads((tmp_path / target).read_text())
    assert record["num_examples"] > 0 and 0.0 <= record["value"] <= 100.0
    assert (tmp_path / record["predictions"]).exists()
