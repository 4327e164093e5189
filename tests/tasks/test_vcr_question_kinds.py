"""benchmarks/diagnostics/vcr_question_kinds.py: each VCR question's kind read back from its words agrees with the
kind the world generator made it as; per-kind accuracy and the McNemar pairing with `none` on a fabricated run."""

import json

import pytest
from conftest import load_benchmark

from vlbert_core.world import sample_scene
from vlbert_core.world.generate import np_rng, py_rng
from vlbert_core.world.language import vcr_items


def test_question_kind_agrees_with_the_generator_on_every_kind():
    kinds = load_benchmark("diagnostics/vcr_question_kinds")
    seen = set()
    for i in range(60):
        scene = sample_scene(np_rng(3, "test-vcr-kinds", i), 128)
        for item in vcr_items(scene, py_rng(3, "test-vcr-kinds", i), 4):
            assert kinds.question_kind(item.question) == item.kind, item.question
            seen.add(item.kind)
    assert seen == set(kinds.KINDS)


def test_question_kind_refuses_a_question_of_no_known_kind():
    with pytest.raises(ValueError, match="none of the world's VCR kinds"):
        load_benchmark("diagnostics/vcr_question_kinds").question_kind(["Why", "is", [0], "smiling", "?"])


def _write_job(run, task, setting, schedule, predictions, losses):
    job = run / "results" / "finetune" / task / setting / schedule
    job.mkdir(parents=True)
    (job / "predictions.json").write_text(json.dumps({"predictions": {f"{task}/val": predictions}}))
    (job / "metrics.jsonl").write_text("".join(json.dumps({"answer_loss": v}) + "\n" for v in losses))


def test_task_table_scores_each_kind_and_pairs_each_setting_with_none_of_its_schedule(tmp_path):
    kinds = load_benchmark("diagnostics/vcr_question_kinds")
    questions = [(["What", "color", "is", [0], "?"], 0), (["What", "is", [0], "?"], 1),
                 (["What", "is", [0], "next", "to", "?"], 2), (["Is", [0], "bigger", "than", [1], "?"], 3)] * 5
    vcr = tmp_path / "resources" / "synthetic" / "vcr"
    vcr.mkdir(parents=True)
    vcr.joinpath("val.jsonl").write_text("".join(
        json.dumps({"annot_id": f"val-{i}", "question": q, "answer_label": label, "rationale_label": 0}) + "\n"
        for i, (q, label) in enumerate(questions)))
    labels = [label for _, label in questions]
    _write_job(tmp_path, "vcr_q2a", "none", "full", [{"annot_id": f"val-{i}", "prediction": 0} for i in range(20)],
               [1.4] * 12)
    # full is right on the colour and kind questions only
    _write_job(tmp_path, "vcr_q2a", "full", "full",
               [{"annot_id": f"val-{i}", "prediction": label if label < 2 else (label + 1) % 4}
                for i, label in enumerate(labels)], [1.4] * 6 + [0.2] * 6)
    text = kinds.task_table(tmp_path, "vcr_q2a")
    rows = {line.split(" | ")[0].strip("| "): line for line in text.splitlines() if line.startswith("| none/")
            or line.startswith("| full/")}
    # none always answers 0: right on the colour questions only (columns: kind, colour, next_to, bigger)
    assert rows["none/full"].startswith("| none/full | 12 | 25.0 |  | 0 | 100 | 0 | 0 |")
    # the 5 kind questions are the only disagreements, all won by full: exact McNemar p = 2 * 0.5**5;
    # answer loss over steps 1-2, 6-7 and 11-12
    assert rows["full/full"] == (f"| full/full | 12 | 50.0 | {kinds.format_p_value(2 * 0.5 ** 5)} | 100 | 100 | 0 | 0 "
                                 "| 1.400 / 0.800 / 0.200 |")


def test_predictions_of_a_question_not_in_the_split_are_an_error(tmp_path):
    kinds = load_benchmark("diagnostics/vcr_question_kinds")
    vcr = tmp_path / "resources" / "synthetic" / "vcr"
    vcr.mkdir(parents=True)
    vcr.joinpath("val.jsonl").write_text(json.dumps(
        {"annot_id": "val-0", "question": ["What", "is", [0], "?"], "answer_label": 0, "rationale_label": 0}) + "\n")
    _write_job(tmp_path, "vcr_q2a", "none", "full", [{"annot_id": "val-9", "prediction": 0}], [1.4])
    with pytest.raises(ValueError, match="'val-9' is not a val question"):
        kinds.task_table(tmp_path, "vcr_q2a")
