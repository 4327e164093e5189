"""`convert vilbert` on the fine-tuned layout (the authors' VILBertForVLTasks: multi_task_model.bin with task
tokens, the per-task fine-tuned files): every key mapped or dropped with a reason, a missing or unknown key an
error naming it, nothing written on error. (That the converted heads compute the authors' numbers:
test_golden_vilbert.py.)"""

from __future__ import annotations

import json

import pytest
import torch

from vlbert_core.convert.accounting import ConversionError
from vlbert_core.convert.vilbert.checkpoint import (RELEASED_CONFIG, TASK_EMBEDDINGS, TASK_HEAD_MODULES,
                                                    VL_TASKS_LAYOUT, checkpoint_layout, convert_vilbert_state,
                                                    released_key_shapes, stand_in_state)
from vlbert_core.convert.vilbert.reference import SMALL_CONFIG, write_detector_stand_in
from vlbert_core.models import registry
from vlbert_core.tasks.modeling.vilbert_released import TASK_HEADS_FILE, ViLBertReleasedHeads, load_released_heads

torch.set_num_threads(1)
SMALL_BACKBONE = {"stage_widths": [4, 4, 4, 16], "blocks_per_stage": [1, 1, 1, 1], "block": "basic"}
TASK_TOKENS = {**SMALL_CONFIG, "task_specific_tokens": True}


def _convert(source, authors_config=SMALL_CONFIG):
    return convert_vilbert_state(source, source_name="stand-in", visual_backbone=SMALL_BACKBONE,
                                 authors_config=authors_config)


def test_the_released_fine_tuned_layout_has_the_26_task_head_keys_and_the_task_embeddings():
    pretrained = released_key_shapes(RELEASED_CONFIG)
    multi_task = released_key_shapes({**RELEASED_CONFIG, "task_specific_tokens": True}, VL_TASKS_LAYOUT)
    added = {k: v for k, v in multi_task.items() if k not in pretrained}
    assert set(pretrained) <= set(multi_task) and len(added) == 26 + 1
    assert added[TASK_EMBEDDINGS] == (20, 768)
    assert added["vil_prediction.logit_fc.0.weight"] == (2048, 1024)
    assert added["vil_prediction.logit_fc.3.weight"] == (3129, 2048)
    assert added["vil_prediction_gqa.logit_fc.3.weight"] == (1533, 2048)
    assert added["vil_binary_prediction.logit_fc.0.weight"] == (2048, 2048)
    assert added["vil_binary_prediction.logit_fc.3.weight"] == (2, 2048)
    assert added["vil_logit.weight"] == (1, 1024) and added["vil_tri_prediction.weight"] == (3, 1024)
    assert added["vision_logit.weight"] == (1, 1024) and added["linguisic_logit.weight"] == (1, 768)


@pytest.mark.parametrize("config", [SMALL_CONFIG, TASK_TOKENS], ids=["per-task", "multi-task"])
def test_every_fine_tuned_tensor_is_mapped_or_dropped_for_a_reason(config):
    source = stand_in_state(config, seed=0, layout=VL_TASKS_LAYOUT)
    assert checkpoint_layout(source) == VL_TASKS_LAYOUT
    converted = _convert(source)
    report = converted.report
    assert set(report.mapped) | set(report.dropped) == set(source) and not set(report.mapped) & set(report.dropped)
    assert len(report.dropped) == 1 + 4 * 2   # the tied decoder, q_dense1/2 of 2 layers: the same as pre-trained
    for theirs, _, _ in TASK_HEAD_MODULES:
        assert any(k.startswith(theirs + ".") for k in report.mapped), theirs
    assert converted.config.task_specific_tokens == config.get("task_specific_tokens", False)
    assert converted.config.task_heads == "vilbert_released" and converted.config.task_id is None
    if converted.config.task_specific_tokens:
        assert report.mapped[TASK_EMBEDDINGS] == "embeddings.task_embeddings.weight"
    with torch.device("meta"):
        spec_model = registry.model_class("vilbert")(converted.config)
    assert set(converted.task_heads) == set(ViLBertReleasedHeads(spec_model.head_spec()).state_dict())


def test_a_missing_or_unknown_head_key_is_an_error_naming_it():
    source = stand_in_state(TASK_TOKENS, seed=0, layout=VL_TASKS_LAYOUT)
    missing = {k: v for k, v in source.items() if k != "vision_logit.bias"}
    with pytest.raises(ConversionError, match=r"missing from the source: 'task_heads\.region_score\.mlp\.linear\.bias'"):
        _convert(missing)
    with pytest.raises(ConversionError, match=r"no rule knows: 'vil_prediction\.logit_fc\.4\.weight'"):
        _convert({**source, "vil_prediction.logit_fc.4.weight": torch.zeros(2)})
    # one head key alone makes the checkpoint a fine-tuned one: the other heads' keys are then missing, named
    pretrained = stand_in_state(SMALL_CONFIG, seed=0)
    with pytest.raises(ConversionError, match=r"missing from the source: 'task_heads\.entailment\.linear\.bias'"):
        _convert({**pretrained, "vil_logit.weight": torch.zeros(1, 16), "vil_logit.bias": torch.zeros(1)})
    wrong = dict(source)
    wrong["vil_prediction.logit_fc.3.weight"] = torch.zeros(3000, 32)
    with pytest.raises(ConversionError, match=r"'vil_prediction\.logit_fc\.3\.weight' -> .* has shape \(3000, 32\)"):
        _convert(wrong)
    with pytest.raises(ConversionError, match=r"task_embeddings\.weight' has shape \(8, 32\)"):
        _convert({**source, TASK_EMBEDDINGS: torch.zeros(8, 32)})
    with pytest.raises(ConversionError, match="config says task_specific_tokens=False, the checkpoint's tensors "
                                              "task_specific_tokens=True"):
        _convert(source, authors_config={**SMALL_CONFIG, "task_specific_tokens": False})


def test_convert_command_writes_the_task_heads_and_nothing_on_error(tmp_path):
    from vlbert_core.convert.__main__ import main as convert_main

    source = stand_in_state(TASK_TOKENS, seed=0, layout=VL_TASKS_LAYOUT)
    torch.save(source, tmp_path / "multi_task_model.bin")
    broken = {k: v for k, v in source.items() if not k.startswith("vil_tri_prediction.")}
    torch.save(broken, tmp_path / "broken.bin")
    (tmp_path / "config.json").write_text(json.dumps(SMALL_CONFIG))
    write_detector_stand_in(tmp_path / "detector.pt", 16, 7)

    def command(checkpoint: str, out: str) -> list[str]:
        return ["vilbert", str(tmp_path / checkpoint), str(tmp_path / out), "--bert-path", "",
                "--detector", str(tmp_path / "detector.pt"), "--config", str(tmp_path / "config.json")]

    assert convert_main(command("multi_task_model.bin", "out")) == 0
    model = registry.from_pretrained(tmp_path / "out")
    assert model.config.task_specific_tokens and model.config.task_heads == "vilbert_released"
    heads = load_released_heads(model.head_spec(), tmp_path / "out")
    assert torch.equal(heads.vqa.classifier.mlp.linear.weight, source["vil_prediction.logit_fc.3.weight"])
    assert torch.equal(heads.region_score.mlp.linear.weight, source["vision_logit.weight"])
    assert torch.equal(model.embeddings.task_embeddings.weight, source[TASK_EMBEDDINGS])
    report = json.loads((tmp_path / "out" / "conversion_report.json").read_text())
    assert report["num_mapped"] + report["num_dropped"] == len(source)
    with pytest.raises(ConversionError, match=r"missing from the source: 'task_heads\.entailment\.linear\.bias'"):
        convert_main(command("broken.bin", "out2"))
    assert not (tmp_path / "out2").exists()
    assert not list(tmp_path.glob(".tmp-*"))
    (tmp_path / "out" / TASK_HEADS_FILE).unlink()
    with pytest.raises(FileNotFoundError, match=TASK_HEADS_FILE):
        load_released_heads(model.head_spec(), tmp_path / "out")


def test_convert_verify_takes_the_vilbert_layouts(capsys):
    from vlbert_core.convert.verify import main as verify_main

    with pytest.raises(SystemExit, match="the layout is the first argument"):
        verify_main(["vilbert-tasks", "--authors-repo", "x", "--layout", "pretrained"])
    with pytest.raises(SystemExit) as exit_info:
        verify_main(["vilbert-tasks", "--help"])
    assert exit_info.value.code == 0 and "--task-tokens" in capsys.readouterr().out
