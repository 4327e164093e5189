"""Bring your own RoIs: a bottom-up-attention TSV imported into our RoI parquet, read back by the
readers the pipeline uses, and the rules a TSV source plans instead of the detector's."""

from __future__ import annotations

import base64
import io
import json
import re
import subprocess
import sys
import tarfile
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import yaml
from conftest import TINY_DETECTOR_CFG, load_script
from PIL import Image

from vlbert_core.images import DEFAULT_MAX_PIXELS as MAX_PIXELS
from vlbert_core.detector import (
    build_detector,
    classify_boxes,
    coco_image_id,
    import_bottom_up_rois,
    load_detector,
)
from vlbert_core.detector.bottom_up import BadTsvRow, normalise_image_id, parse_bottom_up_row
from vlbert_core.detector.images import decode_image
from vlbert_core.rois import read_rois, read_rois_metadata

REPO = Path(__file__).resolve().parents[2]
torch.set_num_threads(1)

TINY_CFG = TINY_DETECTOR_CFG
NUM_CLASSES = 3  # foreground; class-score vectors have 4 columns
ROIS_CFG = {"score_threshold": 0.5, "min_boxes": 10, "max_boxes": 100, "nms_iou": 0.3, "batch_size": 4}
FEATURE_DIM = 8


# ---------------------------------------------------------------- helpers


def b64(array: np.ndarray) -> str:
    return base64.b64encode(np.ascontiguousarray(array, dtype=np.float32).tobytes()).decode("ascii")


def random_boxes(rng: np.random.Generator, n: int, width: int, height: int) -> np.ndarray:
    x1 = rng.uniform(0, width * 0.6, n)
    y1 = rng.uniform(0, height * 0.6, n)
    w = rng.uniform(4, width * 0.4, n)
    h = rng.uniform(4, height * 0.4, n)
    return np.stack([x1, y1, np.minimum(x1 + w, width - 1), np.minimum(y1 + h, height - 1)], 1).astype(np.float32)


def tsv_line(image_id, width, height, boxes, cls_prob=None, num_boxes=None, features_dim=FEATURE_DIM) -> str:
    """One line as bottom-up-attention's generate_tsv.py writes it (csv excel dialect: CRLF)."""
    n = len(boxes) if num_boxes is None else num_boxes
    fields = [str(image_id), str(width), str(height), str(n), b64(boxes),
              b64(np.random.default_rng(0).standard_normal((len(boxes), features_dim)))]
    if cls_prob is not None:
        fields.append(b64(cls_prob))
    return "\t".join(fields) + "\r\n"


def jpeg(width: int, height: int, seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 255, size=(height, width, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="JPEG")
    return buffer.getvalue()


def write_shard(path: Path, images: dict[str, bytes]) -> None:
    """A CC shard as data.writer writes it: KEY.jpg, KEY.txt, KEY.json per sample."""
    with tarfile.open(path, "w") as tar:
        for key, data in images.items():
            for ext, payload in (("jpg", data), ("txt", b"a caption"), ("json", b"{}")):
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size = len(payload)
                tar.addfile(info, io.BytesIO(payload))


@pytest.fixture(scope="module")
def detector_file(tmp_path_factory) -> Path:
    """A detector checkpoint in train_detector's format (untrained: the import needs its class space
    and box head, not its accuracy)."""
    torch.manual_seed(0)
    model = build_detector(TINY_CFG, NUM_CLASSES)
    path = tmp_path_factory.mktemp("detector") / "model.pt"
    torch.save({"config": TINY_CFG, "categories": [{"id": i, "name": f"c{i}"} for i in (1, 2, 3)],
                "num_classes": NUM_CLASSES, "state_dict": model.state_dict()}, path)
    return path


# ---------------------------------------------------------------- CC shard, class scores from our detector


def test_cc_shard_tsv_round_trip_with_bad_rows_accounted(detector_file, tmp_path):
    rng = np.random.default_rng(0)
    ours_w, ours_h = 64, 48          # the shard's (resized) JPEGs
    tsv_w, tsv_h = 128, 96           # the frame the researcher's detector saw: 2x, same aspect
    keys = [f"train-{i:09d}" for i in range(10)]
    images = {key: jpeg(ours_w, ours_h, i) for i, key in enumerate(keys)}
    images[keys[7]] = b"\xff\xd8 not a jpeg"
    write_shard(tmp_path / "train-00000.tar", images)

    good = random_boxes(rng, 12, tsv_w, tsv_h)
    many = random_boxes(rng, 120, tsv_w, tsv_h)
    outside = good.copy()
    outside[3] = [100, 50, 140, 90]   # x2 = 140 > 128
    lines = [
        tsv_line(keys[0], tsv_w, tsv_h, good),
        tsv_line(keys[1], tsv_w, tsv_h, many),
        "\t".join(tsv_line(keys[2], tsv_w, tsv_h, good).split("\t")[:5]) + "\r\n",   # no features field
        tsv_line(keys[3], tsv_w, tsv_h, good[:11], num_boxes=12),                   # 11 boxes, says 12
        tsv_line(keys[4], tsv_w, tsv_h, outside),
        tsv_line(keys[5], tsv_w, tsv_h, good[:5]),                                   # too few
        # keys[6]: no line at all
        tsv_line(keys[7], tsv_w, tsv_h, good),                                       # our image is corrupt
        tsv_line(keys[8], 100, 100, random_boxes(rng, 12, 100, 100)),              # square: another image
        tsv_line(keys[9], tsv_w, tsv_h, good),
        tsv_line(keys[9], tsv_w, tsv_h, good),                                       # repeated image_id
        tsv_line("train-000099999", tsv_w, tsv_h, good),                             # another shard's image
        "\tnothing here\r\n",                                                        # no image_id
    ]
    tsv = tmp_path / "cc_train.tsv"
    tsv.write_text("".join(lines), newline="")
    out = tmp_path / "rois" / "cc" / "train-00000.parquet"

    load_script("extract_rois").main(SimpleNamespace(
        input=SimpleNamespace(tar=str(tmp_path / "train-00000.tar"), tsv=str(tsv), model=str(detector_file)),
        output=SimpleNamespace(parquet=str(out)),
        params=SimpleNamespace(rois=ROIS_CFG, device="cpu", max_image_pixels=MAX_PIXELS), threads=1, log=[str(tmp_path / "import.log")],
    ))

    records = read_rois(out)
    assert list(records) == keys  # one row per shard image, in shard order
    status = {key: r.status for key, r in records.items()}
    assert status == {keys[0]: "ok", keys[1]: "ok", keys[2]: "bad_tsv_row", keys[3]: "bad_tsv_row",
                      keys[4]: "bad_tsv_row", keys[5]: "too_few_boxes", keys[6]: "missing_in_tsv",
                      keys[7]: "decode_error", keys[8]: "size_mismatch", keys[9]: "bad_tsv_row"}
    errors = {key: r.error for key, r in records.items()}
    # each error names the TSV, the line and the image_id, then the reason
    assert re.match(r".*cc_train\.tsv: line 3: image_id train-000000002: 5 fields", errors[keys[2]])
    assert "line 4: image_id train-000000003: boxes decodes to 44 float32, expected num_boxes x 4 = 48" in errors[keys[3]]
    assert "line 5: image_id train-000000004: box 3 [100.0, 50.0, 140.0, 90.0] is outside the 128x96 image" in errors[keys[4]]
    assert "line 6: image_id train-000000005: 5 boxes, rois.min_boxes is 10" in errors[keys[5]]
    assert "no line with image_id train-000000006" in errors[keys[6]]
    assert errors[keys[7]].startswith(f"NotAnImage: image {keys[7]!r} cannot be decoded")
    assert "line 8: image_id train-000000008: 100x100 in the TSV" in errors[keys[8]] and "64x48" in errors[keys[8]]
    assert "lines [9, 10]: image_id train-000000009 is on several lines" in errors[keys[9]]

    first = records[keys[0]]
    assert (first.image_w, first.image_h, first.num_classes) == (ours_w, ours_h, NUM_CLASSES + 1)
    order = np.argsort(-first.scores, kind="stable")
    np.testing.assert_array_equal(first.scores, first.scores[order])  # sorted by score
    # the TSV's boxes, rescaled to our 64x48 image, in score order
    expected_boxes = good * 0.5
    matched = [int(np.argmin(np.abs(expected_boxes - box).sum(1))) for box in first.boxes]
    assert sorted(matched) == list(range(12))
    np.testing.assert_allclose(first.boxes, expected_boxes[matched], atol=1e-4)
    # class scores: our detector's box head on exactly those boxes
    model, _ = load_detector(detector_file)
    image = decode_image(images[keys[0]]).float() / 255
    direct = classify_boxes(model, [image], [torch.from_numpy(first.boxes)])[0].numpy()
    np.testing.assert_allclose(first.class_scores, direct, atol=2e-3)  # stored as float16
    np.testing.assert_allclose(first.scores, direct[:, 1:].max(1), atol=1e-5)
    np.testing.assert_array_equal(first.class_ids, direct[:, 1:].argmax(1) + 1)
    assert len(records[keys[1]].scores) == 100  # 120 given, capped at rois.max_boxes by score
    assert records[keys[1]].scores.min() >= np.sort(
        classify_boxes(model, [decode_image(images[keys[1]]).float() / 255],
                       [torch.from_numpy(many * 0.5)])[0].numpy()[:, 1:].max(1))[-100] - 1e-5

    meta = read_rois_metadata(out)
    assert meta["source"] == "bottom_up_tsv" and meta["class_scores"] == "detector box head"
    assert meta["rows_capped"] == 1 and meta["tsv_lines"] == 12 and meta["tsv_lines_other_images"] == 1
    assert meta["num_unattributed_bad_lines"] == 1 and meta["unattributed_bad_lines"][0].startswith("line 12")
    assert meta["status_counts"] == {"bad_tsv_row": 4, "decode_error": 1, "missing_in_tsv": 1, "ok": 2,
                                     "size_mismatch": 1, "too_few_boxes": 1}

    # pre-training's reader takes the ok rows and knows the others failed
    from vlbert_core.pretrain.data import usable_cc_rois

    entries, failures, num_classes = usable_cc_rois(out, keep_boxes=19)
    assert sorted(entries) == keys[:2] and num_classes == NUM_CLASSES + 1
    assert failures == {k: status[k] for k in keys[2:]}
    np.testing.assert_allclose(entries[keys[0]].boxes, first.boxes, atol=1e-6)
    assert entries[keys[1]].boxes.shape == (19, 4)


# ---------------------------------------------------------------- task images, class scores from cls_prob


def write_vqa_val(root: Path, images: dict[int, bytes]) -> dict[str, str]:
    """A VQA v2 val split (questions file + COCO-named images); returns config sources.vqa."""
    (root / "val2014").mkdir(parents=True)
    for image_id, data in images.items():
        (root / "val2014" / f"COCO_val2014_{image_id:012d}.jpg").write_bytes(data)
    questions = {"info": {}, "license": {}, "data_subtype": "val2014", "task_type": "Open-Ended",
                 "data_type": "mscoco",
                 "questions": [{"image_id": i, "question": "what is it?", "question_id": 10 * i} for i in images]}
    (root / "questions_val.json").write_text(json.dumps(questions))
    return {"questions": str(root / "questions_{split}.json"), "annotations": str(root / "annotations_{split}.json"),
            "images": str(root / "{split}2014")}


def test_vqa_tsv_with_cls_prob_round_trips_to_the_task_reader(detector_file, tmp_path):
    rng = np.random.default_rng(1)
    sources = write_vqa_val(tmp_path, {42: jpeg(80, 60, 42), 7: jpeg(60, 60, 7)})
    cls_prob = rng.dirichlet(np.ones(NUM_CLASSES + 1), size=15).astype(np.float32)
    boxes = random_boxes(rng, 15, 80, 60)
    # COCO ids, zero-padded as some feature files have them; image 7 is not in the file
    tsv = tmp_path / "coco_val.tsv"
    tsv.write_text(tsv_line("000042", 80, 60, boxes, cls_prob=cls_prob) + tsv_line(1234, 80, 60, boxes, cls_prob=cls_prob),
                   newline="")
    out = tmp_path / "rois" / "vqa" / "val.parquet"
    load_script("extract_task_rois").main(SimpleNamespace(
        input=SimpleNamespace(tsv=str(tsv), model=str(detector_file)),
        output=SimpleNamespace(parquet=str(out)),
        params=SimpleNamespace(dataset="vqa", split="val", rois=ROIS_CFG, device="cpu", sources=sources,
                              max_image_pixels=MAX_PIXELS),
        threads=1, log=[str(tmp_path / "import.log")], config={},
    ))
    from vlbert_core.tasks.common import rois_for_key
    from vlbert_core.tasks.finetune import read_task_rois

    records, source = read_task_rois([out])
    record = rois_for_key(records, "COCO_val2014_000000000042", source)
    order = np.argsort(-cls_prob[:, 1:].max(1), kind="stable")
    np.testing.assert_allclose(record.class_scores, cls_prob[order], atol=1e-3)   # float16 of the TSV's
    np.testing.assert_allclose(record.boxes, boxes[order], atol=1e-4)             # same frame: unscaled
    np.testing.assert_array_equal(record.class_ids, cls_prob[order, 1:].argmax(1) + 1)
    assert (record.image_w, record.image_h) == (80, 60)
    with pytest.raises(ValueError, match=r"COCO_val2014_000000000007.*missing_in_tsv.*no line with image_id 7"):
        rois_for_key(records, "COCO_val2014_000000000007", source)
    meta = read_rois_metadata(out)
    assert meta["class_scores"] == "tsv cls_prob" and meta["tsv_lines_other_images"] == 1


def test_cls_prob_outside_the_detectors_class_space_stops_the_import(detector_file, tmp_path):
    rng = np.random.default_rng(2)
    image = tmp_path / "COCO_val2014_000000000001.jpg"
    image.write_bytes(jpeg(40, 40, 0))
    tsv = tmp_path / "vg.tsv"
    tsv.write_text(tsv_line(1, 40, 40, random_boxes(rng, 12, 40, 40), cls_prob=np.full((12, 1601), 1 / 1601)))
    model, _ = load_detector(detector_file)
    with pytest.raises(ValueError, match=r"vg\.tsv: cls_prob .* 1601 classes, the detector 4"):
        import_bottom_up_rois(tsv, [(image.stem, str(image))], tmp_path / "out.parquet", ROIS_CFG, model,
                              image_id_of=coco_image_id)
    assert not (tmp_path / "out.parquet").exists()


def test_row_parsing_and_image_ids():
    boxes = np.array([[0, 0, 10, 10]] * 3, np.float32)
    fields = tsv_line(5, 20, 20, boxes).rstrip("\r\n").split("\t")
    row = parse_bottom_up_row(fields, line=1)
    assert (row.image_id, row.image_w, row.image_h, row.feature_dim, row.cls_prob) == ("5", 20, 20, FEATURE_DIM, None)
    with pytest.raises(BadTsvRow, match="not valid base64"):
        parse_bottom_up_row(fields[:4] + ["@@@@"] + fields[5:], line=1)
    with pytest.raises(BadTsvRow, match="not numbers"):
        parse_bottom_up_row([fields[0], "wide"] + fields[2:], line=1)
    assert normalise_image_id(" 000042 ") == "42" and normalise_image_id("train-000000042") == "train-000000042"
    assert coco_image_id("COCO_train2014_000000000042") == "42"
    with pytest.raises(ValueError, match="not a COCO file stem"):
        coco_image_id("val_0000042")


def test_a_tsv_that_is_not_bottom_up_is_refused(detector_file, tmp_path):
    tsv = tmp_path / "captions.tsv"
    tsv.write_text("a caption\thttp://example.com/a.jpg\n")
    image = tmp_path / "COCO_val2014_000000000001.jpg"
    image.write_bytes(jpeg(40, 40, 0))
    model, _ = load_detector(detector_file)
    with pytest.raises(ValueError, match=r"captions\.tsv: line 1 has 2 tab-separated fields"):
        import_bottom_up_rois(tsv, [(image.stem, str(image))], tmp_path / "out.parquet", ROIS_CFG, model,
                              image_id_of=coco_image_id)


# ---------------------------------------------------------------- the DAG


def planned_rules(output: str) -> dict[str, int]:
    stats = output.split("Job stats:", 1)[1]
    counts = {}
    for line in stats.splitlines():
        m = re.match(r"^(\w+)\s+(\d+)\s*$", line.strip())
        if m and m.group(1) != "total":
            counts[m.group(1)] = int(m.group(2))
        elif counts and not line.strip():
            break
    return counts


@pytest.mark.workflow
def test_dry_run_with_tsv_sources_and_detector_weights_plans_the_import_rules(tmp_path):
    (tmp_path / "features").mkdir()
    for name in ("cc_train_00000.tsv", "coco_val.tsv", "detector.pt"):
        (tmp_path / "features" / name).touch()
    override = {
        "detector": {"weights": "features/detector.pt"},
        "rois": {"source": {"cc": "features/cc_{split}_{shard}.tsv", "vqa": "features/coco_{split}.tsv"}},
    }
    (tmp_path / "byo.yaml").write_text(yaml.safe_dump(override))
    targets = ["results/rois/cc/train-00000.parquet", "results/rois/vqa/val.parquet",
               "results/rois/refcoco/val.parquet"]
    proc = subprocess.run(
        [sys.executable, "-m", "snakemake", "-s", str(REPO / "Snakefile"), "-d", str(tmp_path), "-n", "--cores", "1",
         *targets, "--configfile", str(tmp_path / "byo.yaml")],
        capture_output=True, text=True, timeout=300,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    counts = planned_rules(out)
    # CC and VQA RoIs are imported, RefCOCO+ (default source) detected, all with the given weights
    assert counts.get("import_rois") == 1 and counts.get("import_task_rois") == 1
    assert counts.get("extract_task_rois") == 1
    assert "extract_rois" not in counts and "train_detector" not in counts
    assert "features/cc_train_00000.tsv" in out and "features/detector.pt" in out
