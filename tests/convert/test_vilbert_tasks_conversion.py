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


# ---- --task: a fine-tuned directory of one task, what vlbert_core.predict answers with ----------------------------

# the small config with BERT's vocabulary, so that a real tokenizer indexes its word embeddings
PREDICT_CONFIG = {**SMALL_CONFIG, "vocab_size": 30522, "max_position_embeddings": 40}
SELECT = {"score_threshold": 0.0, "min_boxes": 3, "max_boxes": 5, "nms_iou": 0.7, "batch_size": 1, "num_workers": 0}


@pytest.fixture(scope="module")
def released_files(tmp_path_factory):
    """A multi-task stand-in (task tokens, every head) of PREDICT_CONFIG, its config, a BERT directory (config and
    vocabulary), a detector stand-in, 3,129 answers, an image, and the checkpoint converted whole."""
    import shutil

    from PIL import Image

    from vlbert_core.convert.stand_in import uncased_vocab_path
    from vlbert_core.convert.vilbert.checkpoint import convert_vilbert

    root = tmp_path_factory.mktemp("released_vilbert")
    source = stand_in_state({**PREDICT_CONFIG, "task_specific_tokens": True}, seed=1, layout=VL_TASKS_LAYOUT)
    torch.save(source, root / "multi_task_model.bin")
    (root / "config.json").write_text(json.dumps(PREDICT_CONFIG))
    write_detector_stand_in(root / "detector.pt", 16, 7)
    bert = root / "bert"
    bert.mkdir()
    (bert / "config.json").write_text(json.dumps({"model_type": "bert", "vocab_size": 30522}))
    shutil.copyfile(uncased_vocab_path(), bert / "vocab.txt")
    (root / "answers.txt").write_text("".join(f"answer_{i}\n" for i in range(3129)))
    generator = torch.Generator().manual_seed(0)
    pixels = (torch.rand(48, 64, 3, generator=generator) * 255).to(torch.uint8).numpy()
    Image.fromarray(pixels).save(root / "image.jpg")
    convert_vilbert(root / "multi_task_model.bin", root / "whole", detector=root / "detector.pt",
                    bert_path=str(bert), config_path=root / "config.json")
    return root, source


def _convert_task(root, task: str, out: str, *extra: str) -> int:
    from vlbert_core.convert.__main__ import main as convert_main

    return convert_main(["vilbert", str(root / "multi_task_model.bin"), str(root / out), "--bert-path",
                         str(root / "bert"), "--detector", str(root / "detector.pt"), "--config",
                         str(root / "config.json"), "--task", task, *extra])


@pytest.mark.parametrize("task, released", [("vqa", "vqa"), ("refcoco", "region_score"), ("retrieval", "pair_score")])
def test_a_task_directory_holds_the_model_the_tasks_token_and_the_released_head(released_files, task, released):
    from vlbert_core.models.vilbert.config import task_token_id
    from vlbert_core.tasks.finetune import load_finetuned

    root, source = released_files
    extra = ("--answers", str(root / "answers.txt")) if task == "vqa" else ()
    assert _convert_task(root, task, task, *extra) == 0
    model, meta = load_finetuned(root / task)
    whole = registry.from_pretrained(root / "whole")
    assert meta["name"] == task and model.encoder.config.task_id == task_token_id(task)
    encoder_state = model.encoder.state_dict()
    assert all(torch.equal(encoder_state[k], v) for k, v in whole.state_dict().items())
    released_state = getattr(load_released_heads(whole.head_spec(), root / "whole"), released).state_dict()
    head_state = model.head.state_dict()
    assert set(head_state) == set(released_state)
    assert all(torch.equal(head_state[k], v) for k, v in released_state.items())
    report = json.loads((root / task / "conversion_report.json").read_text())
    assert report["num_mapped"] + report["num_dropped"] == len(source)
    assert "another task" in report["dropped"]["vil_tri_prediction.weight"]
    assert "another task" in report["dropped"]["cls.bi_seq_relationship.weight"]


def test_predict_answers_with_a_converted_vqa_and_refcoco_model(released_files):
    from vlbert_core.predict import Predictor

    root, _ = released_files
    for task in ("vqa", "refcoco"):
        if not (root / task).exists():
            extra = ("--answers", str(root / "answers.txt")) if task == "vqa" else ()
            _convert_task(root, task, task, *extra)
    image = str(root / "image.jpg")
    vqa = Predictor(root / "vqa", task="vqa", detector=root / "detector.pt", select=SELECT)
    answers = vqa.predict([{"image": image, "text": "what is it?"}], top_k=2)[0]["answers"]
    assert len(answers) == 2 and all(a["answer"].startswith("answer_") for a in answers)
    boxes = [[2.0, 2.0, 30.0, 20.0], [10.0, 5.0, 60.0, 40.0], [0.0, 20.0, 25.0, 47.0]]
    refcoco = Predictor(root / "refcoco", task="refcoco", detector=root / "detector.pt", select=SELECT)
    chosen = refcoco.predict([{"image": image, "text": "the left one", "boxes": boxes}])[0]
    assert chosen["box"] in boxes and chosen["num_candidates"] == 3


def test_task_conversion_errors_write_nothing(released_files, tmp_path):
    from vlbert_core.convert.__main__ import main as convert_main

    root, _ = released_files
    with pytest.raises(ConversionError, match="3,129 answers"):
        _convert_task(root, "vqa", "no_answers")
    (tmp_path / "few.txt").write_text("yes\nno\n")
    with pytest.raises(ConversionError, match="the file given lists 2"):
        _convert_task(root, "vqa", "few_answers", "--answers", str(tmp_path / "few.txt"))
    torch.save(stand_in_state(SMALL_CONFIG, seed=0), tmp_path / "pretrained_model.bin")
    (tmp_path / "config.json").write_text(json.dumps(SMALL_CONFIG))
    with pytest.raises(ConversionError, match="has no task heads"):
        convert_main(["vilbert", str(tmp_path / "pretrained_model.bin"), str(tmp_path / "out"), "--bert-path", "",
                      "--detector", str(root / "detector.pt"), "--config", str(tmp_path / "config.json"),
                      "--task", "refcoco"])
    assert not any((root / name).exists() for name in ("no_answers", "few_answers"))
    assert not (tmp_path / "out").exists()


def test_fine_tuning_from_a_converted_multi_task_model_takes_the_tasks_token_and_head(released_files):
    """tasks.finetune: load_encoder gives the model the task's token (the authors' id), and the RefCOCO+ and
    retrieval heads start from the released ones; VQA's starts new (its rows are the authors' answers)."""
    from vlbert_core.tasks.finetune import FinetuneModel, load_encoder, start_from_released_head

    root, _ = released_files
    whole = root / "whole"
    released = load_released_heads(registry.from_pretrained(whole).head_spec(), whole)
    meta = {"answers": ["yes", "no"], "mask_id": 103, "whole_image_candidate": False, "hard_negatives": 3}
    for task, token, head in (("refcoco", 10, released.region_score), ("retrieval", 8, released.pair_score),
                              ("vqa", 1, None)):
        encoder = load_encoder(whole, tune_frcnn=False, task_heads=None, sentence_readout="cls", task=task)
        assert encoder.config.task_id == token and encoder.config.task_heads == "vilbert_released"
        model = FinetuneModel(task, encoder, meta)
        assert start_from_released_head(model, whole) == (head is not None)
        if head is not None:
            assert all(torch.equal(model.head.state_dict()[k], v) for k, v in head.state_dict().items())
    with pytest.raises(ValueError, match="no task token of the authors' multi-task ViLBERT for task 'custom'"):
        load_encoder(whole, tune_frcnn=False, task_heads=None, sentence_readout="cls", task="custom")
    # with this project's head layout (model.task_heads: project) the released heads do not fit: the head starts new
    project = load_encoder(whole, tune_frcnn=False, task_heads="project", sentence_readout="cls", task="refcoco")
    assert not start_from_released_head(FinetuneModel("refcoco", project, meta), whole)


# ---- the ViLBERT paper's single-task release (jiasenlu/vilbert_beta) --------------------------------------------

def test_a_vilbert_beta_checkpoint_converts_with_its_weight_norm_folded():
    from vlbert_core.convert.vilbert.checkpoint import BETA_LAYOUT

    source = stand_in_state(SMALL_CONFIG, seed=0, layout=BETA_LAYOUT)
    assert checkpoint_layout(source) == BETA_LAYOUT and source["vil_prediction.main.0.weight_g"].dim() == 0
    converted = _convert(source)
    report = converted.report
    assert set(report.mapped) | set(report.dropped) == set(source) and not set(report.mapped) & set(report.dropped)
    assert "folded into the weight" in report.dropped["vil_prediction.main.3.weight_g"]
    assert converted.config.task_heads == "vilbert_beta_released" and not converted.config.task_specific_tokens
    direction, scale = source["vil_prediction.main.3.weight_v"], source["vil_prediction.main.3.weight_g"]
    folded = converted.task_heads["vqa.classifier.linear.weight"]
    assert torch.allclose(folded, scale * direction / direction.norm()) and torch.isclose(folded.norm(), scale)
    assert set(converted.task_heads) == {f"{head}.{part}" for head, parts in (
        ("vqa.classifier", ("dense.weight", "dense.bias", "linear.weight", "linear.bias")),
        ("pair_score.classifier", ("weight", "bias")), ("region_score.mlp.linear", ("weight", "bias")),
        ("word_score.linear", ("weight", "bias"))) for part in parts}
    # a task's own number of labels (vil_prediction's rows) is read off the checkpoint
    two_labels = stand_in_state(SMALL_CONFIG, seed=0, layout=BETA_LAYOUT) | {
        "vil_prediction.main.3.weight_v": torch.ones(2, 32), "vil_prediction.main.3.bias": torch.zeros(2)}
    assert _convert(two_labels).task_heads["vqa.classifier.linear.weight"].shape == (2, 32)
    no_scale = {k: v for k, v in source.items() if k != "vil_prediction.main.0.weight_g"}
    with pytest.raises(ConversionError, match=r"vil_prediction\.main\.0\.weight_v has no scalar"):
        _convert(no_scale)
    with pytest.raises(ConversionError, match=r"missing from the source: 'task_heads\.word_score\.linear\.bias'"):
        _convert({k: v for k, v in source.items() if k != "linguisic_logit.bias"})
