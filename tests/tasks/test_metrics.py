"""The three fine-tuning metrics against their official definitions (docs/metrics.md).

Every expected number is worked out by hand from the official rules in the comment next to it:
VQA from GT-Vision-Lab/VQA `vqaEval.py`, RefCOCO+ and VCR from the released VL-BERT code.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from vlbert_core.tasks import registry
from vlbert_core.tasks import refcoco as refcoco_lib
from vlbert_core.tasks import vcr as vcr_lib
from vlbert_core.tasks import vqa as vqa_lib
from vlbert_core.tasks.scoring import evaluate_predictions

acc = vqa_lib.vqa_accuracy
OTHERS = ["cat", "cow", "pig", "hen", "owl", "ant", "bee", "elk", "fox"]  # nine different answers

# ---------------------------------------------------------------- VQA: unanimous vs split humans


def test_unanimous_humans_compare_the_prediction_as_written():
    assert acc("yes", ["yes"] * 10) == 1.0  # each human: 9 matching others -> min(1, 9/3) = 1
    # only whitespace is cleaned: "\n"/"\t" -> space, then strip
    assert acc(" yes\n", ["yes"] * 10) == 1.0
    assert acc("\tyes ", ["yes"] * 10) == 1.0
    # no lower-casing, no punctuation, no number or article step
    assert acc("Yes", ["yes"] * 10) == 0.0
    assert acc("yes.", ["yes"] * 10) == 0.0
    assert acc("2", ["two"] * 10) == 0.0
    assert acc("two", ["two"] * 10) == 1.0
    assert acc("a dog", ["dog"] * 10) == 0.0
    # humans that differ only by whitespace are unanimous after the clean-up
    assert acc("Yes", ["yes"] * 9 + ["yes\n"]) == 0.0
    # U+180E was whitespace in Python 2.7's Unicode tables: stripped there, so here too
    assert acc("\u180eyes", ["yes"] * 10) == 1.0
    assert vqa_lib.normalize_answer("red\u180edog") == "red dog"
    # a single human is unanimous too: 0 others -> min(1, 0/3) = 0 whatever the prediction
    assert acc("yes", ["yes"]) == 0.0


def test_split_humans_normalise_prediction_and_humans():
    # "Yes" and "yes." become "yes": 9 matches, any 9 others keep >= 8 -> 1.0
    assert acc("Yes", ["yes"] * 9 + ["no"]) == 1.0
    assert acc("yes.", ["yes"] * 9 + ["no"]) == 1.0
    # the humans are normalised too: "two" x9 and "2" are ten "2"s -> 1.0
    assert acc("2", ["two"] * 9 + ["2"]) == 1.0
    assert acc("dog", ["dog."] * 4 + ["cat"] * 6) == 1.0


def test_prediction_matching_one_two_or_three_humans():
    # one match: leaving it out -> 0, leaving out any of the 9 others -> 1/3: 9 * (1/3) / 10 = 0.3
    assert acc("red", ["red"] + OTHERS) == pytest.approx(0.3)
    # two: leaving out a "red" -> 1/3 (x2), another -> 2/3 (x8): (2/3 + 16/3) / 10 = 0.6
    assert acc("red", ["red"] * 2 + OTHERS[:8]) == pytest.approx(0.6)
    assert acc("yes.", ["yes"] * 2 + ["no"] * 8) == pytest.approx(0.6)
    # three: leaving out a "red" -> 2/3 (x3), another -> 1 (x7): (2 + 7) / 10 = 0.9
    assert acc("red", ["red"] * 3 + OTHERS[:7]) == pytest.approx(0.9)
    assert acc("purple", ["red"] * 3 + OTHERS[:7]) == 0.0


# ---------------------------------------------------------------- VQA: the normalisation steps


@pytest.mark.parametrize("raw, processed", [
    ("yes.", "yes"),          # a period not followed by a digit goes
    ("2.5", "2.5"),           # one followed by a digit stays
    ("1.5.", "1.5"),
    ("1,000", "1000"),        # a digit,digit comma anywhere: every mark is deleted, not spaced
    ("red-1,000", "red1000"),
    ("1, 2", "1 2"),          # ", " touches a space: deleted
    ("left-hand", "left hand"),  # touches no space: becomes a space
    ("x - y", "x  y"),        # " -" touches a space: deleted (split() later drops the double space)
    ("don't", "don't"),       # apostrophes and colons are not in the official list
    ("3:30", "3:30"),
    ("yes!?", "yes  "),
    ("." * 40, "." * 8),      # re.UNICODE (32) passed as `count`: only 32 periods go
    ("5.\u0663", "5\u0663"),  # \d is ASCII in the Python 2 pattern: "٣" is no digit, the period goes
    ("5,\u0663", "5 \u0663"),  # and "5,٣" has no digit,digit comma
])
def test_process_punctuation(raw, processed):
    assert vqa_lib.process_punctuation(raw) == processed


@pytest.mark.parametrize("raw, normalised", [
    ("Two", "2"), ("none", "0"), ("ten", "10"), ("eleven", "eleven"),
    ("a dog", "dog"), ("The Dog.", "dog"), ("an apple", "apple"), ("the", ""),
    ("dont", "don't"), ("Dont", "don't"), ("cant", "can't"),
    ("Im", "im"),                  # the key "Im" is never reached: words are lower-cased first
    ("somebody'd", "somebodyd"),   # the official table maps it that way round
    ("  red\tcar\n", "red car"),
    ("\u0130", "i"),               # Python 2 lower-cases one code point at a time
])
def test_normalize_answer(raw, normalised):
    assert vqa_lib.normalize_answer(raw) == normalised


def test_number_words_articles_contractions_and_commas_in_the_accuracy():
    # "two" -> "2": 3 of the humans -> 0.9 (see the three-match case); unanimous "2" -> as written
    assert acc("two", ["2"] * 3 + ["3"] * 7) == pytest.approx(0.9)
    assert acc("two", ["2"] * 10) == 0.0
    assert acc("a dog", ["dog"] * 3 + ["cat"] * 7) == pytest.approx(0.9)
    # 4 humans said "don't": every leave-one-out subset keeps >= 3 matches -> 1.0
    assert acc("dont", ["don't"] * 4 + ["no"] * 6) == 1.0
    # "1,000" and "1000" are the same after normalisation: 4 matches -> 1.0
    assert acc("1,000", ["1000"] * 2 + ["1,000"] * 2 + OTHERS[:6]) == 1.0
    assert acc("1000", ["1,000"] * 10) == 0.0


def test_empty_answers():
    assert acc("", ["yes"] * 10) == 0.0
    assert acc("   ", [""] * 10) == 1.0
    # humans who wrote "the" normalise to "": an empty prediction matches those 3 -> 0.9
    assert acc("", ["the"] * 3 + ["no"] * 7) == pytest.approx(0.9)
    # "?" becomes a space, then nothing: it matches the 2 empty answers -> 0.6
    assert acc("?", [""] * 2 + ["yes"] * 8) == pytest.approx(0.6)
    with pytest.raises(ValueError, match="at least one human answer"):
        acc("yes", [])
    with pytest.raises(TypeError, match="must be a string"):
        acc(2, ["2"] * 10)


def test_overall_accuracy_rounds_like_python2():
    # 100 * 1/3 = 33.333... -> 33.33
    assert vqa_lib.vqa_overall_accuracy([1.0, 0.0, 0.0]) == 33.33
    # 100 * 97 / 800 = 12.125 exactly: Python 2 rounds the half away from zero (Python 3: 12.12)
    assert vqa_lib.vqa_overall_accuracy([1.0] * 97 + [0.0] * 703) == 12.13
    # 100 * 107 / 4000 = 2.675 is stored as 2.67499999...: below the half, 2.67 in both
    assert vqa_lib.vqa_overall_accuracy([1.0] * 107 + [0.0] * 3893) == 2.67
    assert vqa_lib.round_half_away_from_zero(-0.125, 2) == -0.13
    with pytest.raises(ValueError, match="at least one question"):
        vqa_lib.vqa_overall_accuracy([])


def test_soft_targets_are_the_official_accuracy_of_each_vocabulary_answer():
    def question(qid, answers):
        return vqa_lib.VqaQuestion(qid, 1, "q?", "k", answers=answers, multiple_choice_answer="")

    questions = [question(1, ["two"] * 6 + ["2"] * 2 + ["3"] * 2), question(2, ["yes"] * 10),
                 question(3, ["Yes"] * 10), question(4, ["a dog"] * 3 + ["dog"] + ["cat"] * 6),
                 question(5, ["red"] + OTHERS), question(6, ["dont"] * 5 + ["no"] * 5),
                 question(7, ["3"] * 10), question(8, ["dog"] * 10)]
    vocab = vqa_lib.build_answer_vocab(questions, 100)
    assert all(vqa_lib.normalize_answer(a) == a for a in vocab)
    index = {a: i for i, a in enumerate(vocab)}
    for q in questions:
        brute_force = {index[a]: acc(a, q.answers) for a in vocab if acc(a, q.answers) > 0}
        assert vqa_lib.soft_targets(q, index) == brute_force
    # question 3: ten humans wrote "Yes"; the written answer "yes" does not score it
    assert vqa_lib.soft_targets(questions[2], index) == {}
    # question 1: "two" and "2" are eight "2"s -> 1.0; "3" x2 -> 0.6
    assert vqa_lib.soft_targets(questions[0], index) == {index["2"]: 1.0, index["3"]: pytest.approx(0.6)}


# ---------------------------------------------------------------- VQA: files and the results format


def _answers(values):
    return [{"answer": a, "answer_confidence": "yes", "answer_id": i + 1} for i, a in enumerate(values)]


def _write_vqa(tmp_path: Path, humans: dict[int, list[str]], train: dict[int, list[str]] | None = None) -> dict:
    """val from `humans`, train from `train` (default: the same questions)."""
    for split, split_humans in (("val", humans), ("train", train or humans)):
        questions = {"info": {}, "license": {}, "task_type": "Open-Ended", "data_type": "mscoco",
                     "data_subtype": f"{split}2014",
                     "questions": [{"image_id": 1, "question": "q?", "question_id": q} for q in split_humans]}
        # annotations in the reverse order: the official sum runs in this order
        annotations = {"info": {}, "license": {}, "data_subtype": f"{split}2014",
                       "annotations": [{"question_id": q, "image_id": 1, "question_type": "what",
                                        "answer_type": "other", "multiple_choice_answer": a[0],
                                        "answers": _answers(a)} for q, a in reversed(split_humans.items())]}
        (tmp_path / f"q_{split}.json").write_text(json.dumps(questions))
        (tmp_path / f"a_{split}.json").write_text(json.dumps(annotations))
    return {"questions": str(tmp_path / "q_{split}.json"), "annotations": str(tmp_path / "a_{split}.json")}


def test_vqa_predictions_file_is_the_official_results_format(tmp_path):
    humans = {11: ["yes"] * 10, 12: ["2"] * 3 + ["3"] * 7, 13: ["dog"] * 4 + ["cat"] * 6}
    sources = _write_vqa(tmp_path, humans, train={21: ["dog"] * 10, 22: ["dog"] * 10, 23: ["cat"] * 10})
    rows = [{"question_id": 11, "answer": "Yes"}, {"question_id": 12, "answer": "two"},
            {"question_id": 13, "answer": "a dog"}]
    (tmp_path / "bundle.json").write_text(json.dumps({"model_dir": "m", "predictions": {"vqa/val": rows}}))
    result = evaluate_predictions("vqa", "val", tmp_path / "bundle.json", sources, tmp_path / "eval.json",
                                  tmp_path / "val.predictions.json", setting="a", schedule="half",
                                  dataset="synthetic")
    # 11: unanimous "yes" vs "Yes" -> 0; 12: "two" -> "2", 3 matches -> 0.9; 13: "a dog" -> "dog",
    # 4 matches -> 1.0. round(100 * 1.9 / 3, 2) = 63.33 (normalising every prediction gave 96.67)
    assert result["value"] == 63.33
    assert json.loads((tmp_path / "eval.json").read_text())["value"] == 63.33
    # the baseline: always "dog", the most frequent train answer: right on question 13 only
    assert result["baseline"] == 33.33 and result["baseline_kind"].startswith("majority: always 'dog'")

    # what the official loadRes accepts: a JSON list of {"question_id", "answer"}, every question
    # of the annotations exactly once; each row also carries its question's accuracy (a key loadRes
    # ignores) for the tables' paired test
    submitted = json.loads((tmp_path / "val.predictions.json").read_text())
    assert isinstance(submitted, list)
    assert [{k: e[k] for k in ("question_id", "answer")} for e in submitted] == rows
    assert [e["accuracy"] for e in submitted] == [0.0, pytest.approx(0.9), 1.0]
    for entry in submitted:
        assert set(entry) == {"question_id", "answer", "accuracy"}
        assert type(entry["question_id"]) is int and isinstance(entry["answer"], str)
    annotations = json.loads((tmp_path / "a_val.json").read_text())["annotations"]
    assert sorted(e["question_id"] for e in submitted) == sorted(a["question_id"] for a in annotations)

    def run(bad_rows):
        (tmp_path / "bad.json").write_text(json.dumps({"model_dir": "m", "predictions": {"vqa/val": bad_rows}}))
        return evaluate_predictions("vqa", "val", tmp_path / "bad.json", sources, tmp_path / "e2.json",
                                    tmp_path / "p2.json", setting="a", schedule="half", dataset="synthetic")

    with pytest.raises(ValueError, match="prediction #1 .*question_id 12.* needs a string"):
        run([rows[0], {"question_id": 12, "answer": 2}, rows[2]])
    with pytest.raises(ValueError, match="prediction #0 has question_id '11'"):
        run([{"question_id": "11", "answer": "yes"}, *rows[1:]])
    with pytest.raises(ValueError, match="1 question_ids missing"):
        run(rows[:2])
    assert not (tmp_path / "p2.json").exists()


def test_held_out_concept_questions_are_those_with_a_word_no_training_question_has():
    def question(i, text):
        return vqa_lib.VqaQuestion(question_id=i, image_id=i, question=text, image_key=f"k{i}")

    train = [question(0, "What color is the circle?"), question(1, "Is there a square?"),
             question(2, "How many squares are there?")]
    held_out = [question(10, "what color is the square?"),     # every word asked in training
                question(11, "What color is the ring?"),       # "ring": never asked
                question(12, "how many rings are there?"),     # "rings": never asked, though "ring" is held out too
                question(13, "What COLOR is the circle ?")]    # case and punctuation as the official code cleans them
    subset = vqa_lib.held_out_concept_questions(held_out, train)
    assert [q.question_id for q in subset] == [11, 12]
    assert vqa_lib.held_out_concept_questions(held_out, held_out) == []


def test_vqa_loader_keeps_annotation_order_and_refuses_indistinct_human_records(tmp_path):
    sources = _write_vqa(tmp_path, {11: ["yes"] * 10, 12: ["no"] * 10})
    items = vqa_lib.load_vqa(tmp_path / "q_val.json", tmp_path / "a_val.json")
    assert [(q.question_id, q.annotation_index) for q in items] == [(11, 1), (12, 0)]
    # without distinct answer_ids the official leave-one-out would drop all equal records at once
    data = json.loads(Path(sources["annotations"].format(split="val")).read_text())
    data["annotations"][0]["answers"] = [{"answer": a, "answer_confidence": "yes"}
                                         for a in ["yes", "maybe", "no"] + OTHERS[:7]]
    (tmp_path / "a_val.json").write_text(json.dumps(data))
    vqa_lib.load_vqa(tmp_path / "q_val.json", tmp_path / "a_val.json")  # ten different answers
    data["annotations"][0]["answers"][1]["answer"] = "Yes."  # "Yes." and "yes" compare equal
    (tmp_path / "a_val.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"annotation #0 \(question 12\): answers #0 and #1 are the same"):
        vqa_lib.load_vqa(tmp_path / "q_val.json", tmp_path / "a_val.json")
    data["annotations"][0]["answers"] = [{"answer": 2, "answer_id": 1}]
    (tmp_path / "a_val.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match="answer #0 is .*expected a record with a string 'answer'"):
        vqa_lib.load_vqa(tmp_path / "q_val.json", tmp_path / "a_val.json")


# ---------------------------------------------------------------- RefCOCO+: the VL-BERT box convention


def test_box_iou_counts_pixels_inclusively():
    iou = refcoco_lib.box_iou
    assert iou([0, 0, 9, 9], [0, 0, 9, 9])[0, 0] == 1.0
    # boxes that touch share one pixel column: 1 * 11 / (121 + 121 - 11) = 11 / 231
    assert iou([0, 0, 10, 10], [10, 0, 20, 10])[0, 0] == pytest.approx(11 / 231)
    assert iou([0, 0, 10, 10], [10, 10, 20, 20])[0, 0] == pytest.approx(1 / 241)  # a corner pixel
    assert iou([0, 0, 10, 10], [11, 0, 21, 10])[0, 0] == 0.0  # one pixel apart
    # containment: 5 x 5 inside 10 x 10 pixels -> 25 / 100
    assert iou([0, 0, 9, 9], [2, 2, 6, 6])[0, 0] == 0.25
    # a zero-width box is one pixel wide
    assert iou([3, 3, 3, 3], [3, 3, 3, 3])[0, 0] == 1.0
    # COCO bbox 0,0,10,10 becomes 0,0,10,10 and counts 11 x 11 pixels, as in the authors' code:
    # against 0,0,10,4.6 that is 11 * 5.6 / 121 = 0.509 (continuous coordinates would give 0.46)
    assert iou(refcoco_lib.xywh_to_xyxy([0, 0, 10, 10]), [0, 0, 10, 4.6])[0, 0] == pytest.approx(5.6 / 11)
    matrix = iou(np.array([[0, 0, 1, 1], [1, 1, 2, 2]]), np.array([[0, 0, 1, 1], [5, 5, 6, 6], [1, 0, 2, 1]]))
    # row 2: vs 0,0,1,1 one pixel (1 / 7); vs 1,0,2,1 two pixels (2 / 6)
    assert matrix.shape == (2, 3) and matrix[1] == pytest.approx([1 / 7, 0.0, 2 / 6])


def test_refcoco_accuracy_counts_iou_of_exactly_one_half():
    # 20 x 10 vs 10 x 10 pixels sharing 100: 100 / 200 = 0.5 -> correct (IoU >= 0.5); 2 x 1 vs 1 x 1
    # likewise; the last pair is 11 * 5.6 / 121 = 0.509 -> correct; then one miss: 3 of 4 = 75 %
    predicted = np.array([[0, 0, 19, 9], [0, 0, 1, 0], [0, 0, 10, 4.6], [50, 50, 60, 60]])
    gt = np.array([[0, 0, 9, 9], [0, 0, 0, 0], [0, 0, 10, 10], [0, 0, 10, 10]])
    value, ious = refcoco_lib.refcoco_accuracy(predicted, gt)
    assert list(ious[:2]) == [0.5, 0.5] and value == 75.0
    # a RoI at exactly 0.5 is not a positive training target (label IoU > 0.5)
    assert not ious[0] > refcoco_lib.POSITIVE_IOU


def test_predicted_boxes_must_be_boxes():
    check = refcoco_lib.check_predicted_boxes
    assert check([[0, 0, 1, 1], (2, 2, 2, 2)], "p").shape == (2, 4)
    for bad in ([[5, 0, 1, 1]], [[0, 0, 1]], [[0, 0, float("nan"), 1]], [None], [["a", 0, 1, 1]]):
        with pytest.raises(ValueError, match="p: prediction #0 box"):
            check(bad, "p")


# ---------------------------------------------------------------- VCR


def test_vcr_q2a_qa2r_and_q2ar():
    answer_pred, rationale_pred = [0, 1, 2, 3], [1, 1, 0, 3]
    labels = [(0, 1), (1, 2), (2, 0), (0, 3)]
    q2a = vcr_lib.vcr_correct(answer_pred, [a for a, _ in labels])
    qa2r = vcr_lib.vcr_correct(rationale_pred, [r for _, r in labels])
    assert q2a == [True, True, True, False] and qa2r == [True, False, True, True]
    assert vcr_lib.vcr_accuracy(q2a) == 75.0 and vcr_lib.vcr_accuracy(qa2r) == 75.0
    # Q->AR needs both: questions 1 and 3 -> 50 % (not 75 % x 75 %)
    q2ar = vcr_lib.vcr_q2ar_correct(answer_pred, rationale_pred, labels)
    assert q2ar == [True, False, True, False] and vcr_lib.vcr_accuracy(q2ar) == 50.0
    assert vcr_lib.vcr_accuracy([True, False, False]) == pytest.approx(100 / 3)
    for bad in (4, -1, True, 1.0, None):
        with pytest.raises(ValueError, match="entry #1 has prediction"):
            vcr_lib.vcr_correct([0, bad], [0, 0], "VCR")
    with pytest.raises(ValueError, match="at least one question"):
        vcr_lib.vcr_accuracy([])


def test_vcr_q2ar_from_prediction_files(tmp_path):
    labels = [(0, 1), (1, 2), (2, 0), (0, 3)]
    for name, preds, column in (("q2a", [0, 1, 2, 3], 0), ("qa2r", [1, 1, 0, 3], 1)):
        rows = [{"annot_id": f"val-{i}", "label": lab[column], "prediction": p}
                for i, (p, lab) in enumerate(zip(preds, labels))]
        (tmp_path / f"{name}.json").write_text(json.dumps(rows))
    assert vcr_lib.q2ar_from_prediction_files(tmp_path / "q2a.json", tmp_path / "qa2r.json") == (50.0, 4)
    # per question, for the tables' paired test: right only when both are (val-0 and val-2)
    task = registry.task_of_eval("vcr_q2ar")
    assert task.outcome_eval_tasks("vcr_q2ar") == ("vcr_q2a", "vcr_qa2r")
    assert task.example_outcomes("vcr_q2ar", [tmp_path / "q2a.json", tmp_path / "qa2r.json"]) == {
        ("val-0",): 1.0, ("val-1",): 0.0, ("val-2",): 1.0, ("val-3",): 0.0}


def test_scored_vcr_rows_carry_per_example_correctness(tmp_path):
    from vlbert_core.tasks.vcr import score_vcr

    jsonl = tmp_path / "val.jsonl"
    item = {"objects": ["person"], "question": ["why", [0]], "answer_choices": [["a"]] * 4,
            "rationale_choices": [["r"]] * 4, "img_fn": "x.jpg", "metadata_fn": "x.json",
            "answer_label": 2, "rationale_label": 1}
    jsonl.write_text("\n".join(json.dumps({**item, "annot_id": f"val-{i}"}) for i in range(2)) + "\n")
    value, rows = score_vcr([{"annot_id": "val-0", "prediction": 2}, {"annot_id": "val-1", "prediction": 0}],
                            str(jsonl), "q2a", "test")
    assert value == 50.0 and [r["correct"] for r in rows] == [True, False]
    (tmp_path / "scored.json").write_text(json.dumps(rows))
    assert registry.get_task("vcr_q2a").example_outcomes("vcr_q2a", [tmp_path / "scored.json"]) == {
        ("val-0",): 1.0, ("val-1",): 0.0}
    (tmp_path / "bad.json").write_text(json.dumps([{"annot_id": "val-0"}]))
    with pytest.raises(ValueError, match=r"bad.json row #0: no usable KeyError\('correct'\)"):
        registry.get_task("vcr_q2a").example_outcomes("vcr_q2a", [tmp_path / "bad.json"])


def test_refcoco_ground_truth_chance_is_the_share_of_right_candidates_per_expression():
    def expression(ref_id, image_id, box):
        return refcoco_lib.RefExpression(ref_id=ref_id, sent_id=ref_id, ann_id=ref_id, image_id=image_id, split="val",
                                         sentence="the dog", category_id=1, image_key=str(image_id), image_w=100,
                                         image_h=100, gt_box=np.array(box, dtype=np.float64))

    boxes = {1: np.array([[0, 0, 9, 9], [1, 1, 9, 9], [50, 50, 59, 59], [70, 70, 79, 79]], dtype=np.float64),
             2: np.array([[0, 0, 9, 9], [50, 50, 59, 59]], dtype=np.float64)}
    data = refcoco_lib.RefcocoData(expressions=[expression(1, 1, [0, 0, 9, 9]), expression(2, 2, [50, 50, 59, 59])],
                                   image_boxes=boxes, image_ann_ids={}, image_files={})
    # image 1: two of four candidates overlap the target at IoU >= 0.5 (81 / 100); image 2: one of two
    assert refcoco_lib.candidate_chance(data, boxes) == pytest.approx(100 * (2 / 4 + 1 / 2) / 2)
    # the detected track's candidates are other boxes: here image 1 has one right box of two
    detected = {1: np.array([[0, 0, 9, 9], [60, 60, 69, 69]], dtype=np.float64), 2: boxes[2]}
    assert refcoco_lib.candidate_chance(data, detected) == pytest.approx(100 * (1 / 2 + 1 / 2) / 2)
    task = refcoco_lib.RefcocoTask()
    assert task.baseline_reads_rois("refcoco_det") and not task.baseline_reads_rois("refcoco_gt")
    with pytest.raises(ValueError, match="needs the split's RoI parquets"):
        task.baseline("refcoco_det", "val", {"refs": "r", "instances": "i"})


def test_vcr_baselines_are_chance_over_the_candidates():
    assert vcr_lib.VcrQ2ATask().baseline("vcr_q2a", "val", {}).value == 25.0
    assert vcr_lib.VcrQA2RTask().baseline("vcr_qa2r", "val", {}).value == 25.0
