"""`python -m vlbert_core.predict` and its `Predictor` API on tiny fine-tuned models of the tasks' world
(tests/tasks/test_tasks.py): the three tasks' answers, the same answers as the evaluation's predictions,
image URLs on a loopback server, and the errors a user meets."""

from __future__ import annotations

import http.server
import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from conftest import REPO, TINY_DETECTOR_CFG
from PIL import Image
from test_tasks import HPARAMS, MODEL_CFG, save_tiny_pretrained, world  # noqa: F401  (world: the tasks' module fixture)

from vlbert_core.predict import PredictError, Predictor
from vlbert_core.predict.__main__ import main
from vlbert_core.tasks import vcr as vcr_lib
from vlbert_core.tasks import vqa as vqa_lib

SELECT = {"score_threshold": 0.5, "min_boxes": 3, "max_boxes": 6, "nms_iou": 0.3, "batch_size": 2,
          "num_workers": 0}
DOWNLOAD = {"timeout_s": 5, "retries": 0, "threads": 1, "max_bytes": 100_000}


@pytest.fixture(scope="module")
def runs(world, module_tmp_path):  # noqa: F811
    """A detector checkpoint, its RoIs of the eval splits (as rule extract_task_rois writes them), and a
    fine-tune of every task."""
    import torch

    from vlbert_core.detector import build_detector, extract_rois_with_detector
    from vlbert_core.tasks.finetune import finetune
    from vlbert_core.tasks.registry import get_task

    root, sources = world
    out = module_tmp_path / "runs"
    out.mkdir()
    torch.manual_seed(0)
    detector = build_detector(TINY_DETECTOR_CFG, num_classes=3)
    torch.save({"config": TINY_DETECTOR_CFG, "categories": [{"id": i, "name": f"c{i}"} for i in (1, 2, 3)],
                "num_classes": 3, "state_dict": detector.state_dict()}, out / "detector.pt")
    rois = {}
    for dataset, split in (("vqa", "val"), ("refcoco", "val")):
        paths = get_task(dataset).roi_image_paths(split, sources[dataset])
        rois[dataset] = out / f"rois/{dataset}/{split}.parquet"
        extract_rois_with_detector(out / "detector.pt", sorted((k, str(p)) for k, p in paths.items()),
                                   rois[dataset], SELECT)
    train_rois = {"vqa": [str(root / "rois/vqa/train.parquet")], "refcoco": [str(root / "rois/refcoco/train.parquet")]}
    for task in ("vqa", "refcoco", "vcr_q2a", "vcr_qa2r"):
        dataset = "vcr" if task.startswith("vcr") else task
        finetune(task, root / "pretrained", out / task, setting="full", schedule="half", schedule_factor=1.0,
                 hparams={**HPARAMS, "lr": 1e-2}, tune_frcnn=False, model_cfg=MODEL_CFG, sources=sources[dataset],
                 rois_paths=train_rois.get(task, []), seed=0)
    return out, rois


def _evaluation(model_dir: Path, eval_task: str, sources: dict, rois=()) -> list[dict]:
    from vlbert_core.tasks.evaluate import predict_splits

    bundle = predict_splits(model_dir, [(eval_task, "val")], sources=sources, model_cfg=MODEL_CFG,
                            rois_paths=[str(r) for r in rois])
    return bundle[f"{eval_task}/val"]


def _evaluation_scores(model_dir: Path, eval_task: str, sources: dict, rois=()):
    """The sigmoid scores the evaluation's samples get ([examples, answers or boxes]; -1 on non-candidates)."""
    import torch

    from vlbert_core.models.common.bert_init import load_tokenizer
    from vlbert_core.tasks.evaluate import predict_batches
    from vlbert_core.tasks.finetune import load_finetuned, read_task_rois
    from vlbert_core.tasks.samples import ImageLoader, Tokens

    model, meta = load_finetuned(model_dir)
    records, source = read_task_rois([str(r) for r in rois])
    data = model.task.build_data("val", meta, sources=sources, tokens=Tokens(load_tokenizer(model.encoder.config.bert_path)),
                                 images=ImageLoader(MODEL_CFG["image_max_side"]), max_rois=MODEL_CFG["max_rois"],
                                 max_text_len=meta["max_text_len"], rois=records, rois_source=source,
                                 eval_task=eval_task)
    scores = []
    for _, out, extras in predict_batches(model, data, meta["batch_size"], "cpu", "scores"):
        row = torch.sigmoid(out["logits"])
        scores.extend(row.masked_fill(~extras["candidate"], -1.0) if "candidate" in extras else row)
    return scores


def test_help_runs_as_a_module():
    result = subprocess.run([sys.executable, "-m", "vlbert_core.predict", "--help"], cwd=REPO,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "--model" in result.stdout and "--annotations" in result.stdout and "--draw" in result.stdout


@pytest.mark.slow
def test_vqa_answers_equal_the_evaluation(world, runs):  # noqa: F811
    root, sources = world
    out, rois = runs
    expected = _evaluation(out / "vqa", "vqa", sources["vqa"], [rois["vqa"]])
    questions = vqa_lib.load_vqa(sources["vqa"]["questions"].format(split="val"))
    images = Path(sources["vqa"]["images"].format(split="val"))
    queries = [{"image": str(images / f"{q.image_key}.jpg"), "text": q.question} for q in questions]
    predictor = Predictor(out / "vqa", task="vqa", detector=out / "detector.pt", select=SELECT)
    results = predictor.predict(queries, top_k=2)
    assert [r["answers"][0]["answer"] for r in results] == [row["answer"] for row in expected]
    # not only the answer: the scores of the same RoIs, samples and model
    for result, scores in zip(results, _evaluation_scores(out / "vqa", "vqa", sources["vqa"], [rois["vqa"]])):
        assert [a["score"] for a in result["answers"]] == pytest.approx(scores.sort(descending=True).values[:2].tolist(),
                                                                       abs=1e-6)
    for result, query in zip(results, queries):
        assert (result["image"], result["text"]) == (query["image"], query["text"])
        scores = [a["score"] for a in result["answers"]]
        assert len(scores) == 2 and scores == sorted(scores, reverse=True) and all(0 < s < 1 for s in scores)

    # the CLI: the same answer, printed and written as JSON
    written = main(["--model", str(out / "vqa"), "--detector", str(out / "detector.pt"),
                    "--config", str(_config(out)), "--image", queries[2]["image"], "--text", queries[2]["text"],
                    "--top-k", "9", "--out", str(out / "vqa.json")])
    assert json.loads((out / "vqa.json").read_text()) == written
    assert written["task"] == "vqa" and len(written["results"][0]["answers"]) == 3  # the vocabulary's size
    assert written["results"][0]["answers"][0]["answer"] == expected[2]["answer"]
    (out / "queries.jsonl").write_text("".join(json.dumps(q) + "\n" for q in queries[:2]))
    written = main(["--model", str(out / "vqa"), "--detector", str(out / "detector.pt"),
                    "--config", str(_config(out)), "--queries", str(out / "queries.jsonl")])
    assert [r["answers"] for r in written["results"]] == [r["answers"] for r in predictor.predict(queries[:2])]


def test_a_vilbert_model_answers_as_its_evaluation(world, runs, tmp_path):  # noqa: F811
    from vlbert_core.tasks.finetune import finetune

    root, sources = world
    out, rois = runs
    save_tiny_pretrained(tmp_path / "vilbert", "vilbert")
    finetune("vqa", tmp_path / "vilbert", tmp_path / "vqa", setting="vilbert", schedule="half", schedule_factor=1.0,
             hparams={**HPARAMS, "lr": 1e-2}, tune_frcnn=False, model_cfg=MODEL_CFG, sources=sources["vqa"],
             rois_paths=[str(root / "rois/vqa/train.parquet")], seed=0)
    expected = _evaluation(tmp_path / "vqa", "vqa", sources["vqa"], [rois["vqa"]])
    questions = vqa_lib.load_vqa(sources["vqa"]["questions"].format(split="val"))
    images = Path(sources["vqa"]["images"].format(split="val"))
    queries = [{"image": str(images / f"{q.image_key}.jpg"), "text": q.question} for q in questions]
    predictor = Predictor(tmp_path / "vqa", task="vqa", detector=out / "detector.pt", select=SELECT)
    assert predictor.model.encoder.model_type == "vilbert"
    results = predictor.predict(queries, top_k=2)
    assert [r["answers"][0]["answer"] for r in results] == [row["answer"] for row in expected]
    for result, scores in zip(results, _evaluation_scores(tmp_path / "vqa", "vqa", sources["vqa"], [rois["vqa"]])):
        assert [a["score"] for a in result["answers"]] == pytest.approx(scores.sort(descending=True).values[:2].tolist(),
                                                                       abs=1e-6)


def _config(out: Path) -> Path:
    path = out / "config.yaml"
    path.write_text(json.dumps({"rois": SELECT, "cc": {"download": DOWNLOAD}}))  # JSON is YAML
    return path


def test_refcoco_chooses_the_evaluation_box_and_draws_it(world, runs, tmp_path):  # noqa: F811
    from vlbert_core.tasks import refcoco as refcoco_lib

    root, sources = world
    out, rois = runs
    data = refcoco_lib.load_refcoco(sources["refcoco"]["refs"], sources["refcoco"]["instances"], "val")
    image = str(Path(sources["refcoco"]["images"]) / data.image_files[data.expressions[0].image_id])
    queries = [{"image": image, "text": e.sentence} for e in data.expressions]
    predictor = Predictor(out / "refcoco", task="refcoco", detector=out / "detector.pt", select=SELECT)

    detected = predictor.predict(queries)
    expected = _evaluation(out / "refcoco", "refcoco_det", sources["refcoco"], [rois["refcoco"]])
    assert [r["box"] for r in detected] == [row["box"] for row in expected]
    assert all(r["track"] == "det" and r["top"][0]["box"] == r["box"] for r in detected)
    for result, scores in zip(detected, _evaluation_scores(out / "refcoco", "refcoco_det", sources["refcoco"],
                                                           [rois["refcoco"]])):
        assert result["num_candidates"] == int((scores >= 0).sum()) >= SELECT["min_boxes"]
        assert [t["score"] for t in result["top"]] == pytest.approx(
            scores.sort(descending=True).values[: len(result["top"])].tolist(), abs=1e-6)

    # the user's own candidate boxes: the ground-truth track, here the image's instance boxes
    boxes = data.image_boxes[data.expressions[0].image_id].tolist()
    given = predictor.predict([{**q, "boxes": boxes} for q in queries], top_k=2)
    expected = _evaluation(out / "refcoco", "refcoco_gt", sources["refcoco"])
    assert [r["box"] for r in given] == [row["box"] for row in expected]
    assert all(r["track"] == "gt" and r["num_candidates"] == 3 and len(r["top"]) == 2 for r in given)

    written = main(["--model", str(out / "refcoco"), "--config", str(_config(out)), "--image", image,
                    "--text", queries[1]["text"], "--boxes", *[",".join(map(str, b)) for b in boxes],
                    "--draw", str(tmp_path / "chosen.png")])
    result = written["results"][0]
    assert result["box"] == given[1]["box"] and result["drawn"] == str(tmp_path / "chosen.png")
    with Image.open(tmp_path / "chosen.png") as drawn, Image.open(image) as original:
        assert drawn.format == "PNG" and drawn.size == original.size
        x1, y1 = (int(round(v)) for v in result["box"][:2])
        assert drawn.convert("RGB").getpixel((x1, y1)) == (255, 32, 32)


def test_vcr_ranks_as_the_evaluation_from_the_annotation_file_or_typed_objects(world, runs):  # noqa: F811
    root, sources = world
    out, _ = runs
    annotations = sources["vcr"]["annotations"].format(split="val")
    for task in ("vcr_q2a", "vcr_qa2r"):
        predictor = Predictor(out / task, task="vcr")
        queries = predictor.queries_from_file(annotations, images_dir=sources["vcr"]["images"])
        results = predictor.predict(queries)
        expected = _evaluation(out / task, task, sources["vcr"])
        assert [r["choice"] for r in results] == [row["prediction"] for row in expected]
        for result, row in zip(results, expected):
            assert [c["choice"] for c in result["ranking"]][0] == result["choice"]
            assert sorted(c["probability"] for c in result["ranking"]) == pytest.approx(sorted(row["probabilities"]),
                                                                                        abs=1e-5)

    # the same question typed by hand: objects by name and box, [i] refers to object i
    item = vcr_lib.load_vcr(annotations)[1]
    metadata = vcr_lib.load_vcr_metadata(Path(sources["vcr"]["images"]) / item.metadata_fn)

    def typed(tokens):
        return " ".join(f"[{','.join(map(str, t))}]" if isinstance(t, list) else t for t in tokens)

    args = ["--model", str(out / "vcr_qa2r"), "--task", "vcr", "--config", str(_config(out)),
            "--image", str(Path(sources["vcr"]["images"]) / item.img_fn), "--text", typed(item.question),
            "--objects", *[f"{n}:{','.join(map(str, b))}" for n, b in zip(metadata.names, metadata.boxes.tolist())],
            "--answer", typed(item.answer_choices[item.answer_label]),
            "--choices", *[typed(c) for c in item.rationale_choices]]
    result = main(args)["results"][0]
    from_file = Predictor(out / "vcr_qa2r").predict(
        Predictor(out / "vcr_qa2r").queries_from_file(annotations, key=item.annot_id,
                                                      images_dir=sources["vcr"]["images"]))[0]
    assert result["ranking"] == from_file["ranking"]
    assert result["ranking"][0]["text"] == vcr_lib.words_to_text(item.rationale_choices[result["choice"]],
                                                                 item.objects)


class _Images(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):  # keep the test output quiet
        pass


def test_image_urls_are_fetched_with_the_downloader(world, runs):  # noqa: F811
    root, sources = world
    out, _ = runs
    images = Path(sources["vqa"]["images"].format(split="val"))
    name = sorted(p.name for p in images.iterdir())[0]
    handler = lambda *a, **k: _Images(*a, directory=str(images), **k)  # noqa: E731
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        predictor = Predictor(out / "vqa", detector=out / "detector.pt", select=SELECT, download=DOWNLOAD)
        by_url, by_path = predictor.predict([{"image": f"{url}/{name}", "text": "Is it a dog?"},
                                             {"image": str(images / name), "text": "Is it a dog?"}])
        assert by_url["answers"] == by_path["answers"] and by_url["image"] == f"{url}/{name}"
        with pytest.raises(PredictError, match=rf"image {url}/missing.jpg cannot be fetched: .*404"):
            predictor.predict([{"image": f"{url}/missing.jpg", "text": "Is it a dog?"}])
        small = Predictor(out / "vqa", detector=out / "detector.pt", select=SELECT,
                          download={**DOWNLOAD, "max_bytes": 100})
        with pytest.raises(PredictError, match=rf"image {url}/{name} cannot be fetched: .*100"):
            small.predict([{"image": f"{url}/{name}", "text": "Is it a dog?"}])
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


def test_a_query_image_over_the_pixel_cap_is_refused_from_its_header(world, runs, tmp_path):  # noqa: F811
    """The one pixel cap (vlbert_core/images.py): the config's max_image_pixels, or the argument."""
    import time

    from test_image_caps import bomb_png

    from vlbert_core.images import ImageTooLarge

    root, sources = world
    out, _ = runs
    bomb = tmp_path / "huge.png"
    bomb.write_bytes(bomb_png(12_000, 12_000))
    predictor = Predictor(out / "vqa", detector=out / "detector.pt", select=SELECT)
    started = time.perf_counter()
    with pytest.raises(ImageTooLarge, match=f"image {bomb} is 12000x12000 = 144,000,000 pixels, over the cap of "
                                            "89,478,485 pixels \\(config key max_image_pixels\\)"):
        predictor.predict([{"image": str(bomb), "text": "Is it a dog?"}])
    assert time.perf_counter() - started < 1.0
    image = str(sorted(Path(sources["vqa"]["images"].format(split="val")).iterdir())[0])  # 48x40
    detector = out / "detector.pt"
    for capped in (Predictor(out / "vqa", detector=detector, select=SELECT, config={"max_image_pixels": 1000}),
                   Predictor(out / "vqa", detector=detector, select=SELECT, max_image_pixels=1000)):
        with pytest.raises(ImageTooLarge, match=f"image {image} is 48x40 = 1,920 pixels, over the cap of 1,000"):
            capped.predict([{"image": image, "text": "Is it a dog?"}])
    assert Predictor(out / "vqa", detector=out / "detector.pt", select=SELECT,
                     max_image_pixels=1920).predict([{"image": image, "text": "Is it a dog?"}])


def test_bad_input_is_an_error_naming_it(world, runs, tmp_path):  # noqa: F811
    root, sources = world
    out, _ = runs
    image = str(sorted(Path(sources["vqa"]["images"].format(split="val")).iterdir())[0])
    predictor = Predictor(out / "vqa", detector=out / "detector.pt", select=SELECT)
    with pytest.raises(PredictError, match=f"image {tmp_path}/nowhere.jpg does not exist"):
        predictor.predict([{"image": str(tmp_path / "nowhere.jpg"), "text": "Is it a dog?"}])
    (tmp_path / "notes.jpg").write_text("not an image")
    with pytest.raises(PredictError, match=f"image {tmp_path}/notes.jpg cannot be read as an image"):
        predictor.predict([{"image": str(tmp_path / "notes.jpg"), "text": "Is it a dog?"}])
    # max_text_len 24: the question gets 20 word pieces; longer is refused, not truncated
    with pytest.raises(ValueError, match=r"query #0: the question is 3\d word pieces; the model takes at most 20"):
        predictor.predict([{"image": image, "text": "is it a dog " * 8}])
    with pytest.raises(ValueError, match="query #0: needs a non-empty text"):
        predictor.predict([{"image": image, "text": " "}])
    with pytest.raises(PredictError, match="reads the detector's RoIs: give the detector checkpoint"):
        Predictor(out / "vqa").predict([{"image": image, "text": "Is it a dog?"}])
    with pytest.raises(PredictError, match=f"{out / 'refcoco'} holds a refcoco model .*not a vqa model"):
        Predictor(out / "refcoco", task="vqa")
    with pytest.raises(PredictError, match=f"{tmp_path} has no config.json"):
        Predictor(tmp_path, task="vqa")
    with pytest.raises(ValueError, match=r"query #0: needs 4 candidate answers"):
        Predictor(out / "vcr_q2a").predict([{"image": image, "text": "why ?", "choices": ["a", "b"],
                                             "objects": [{"name": "dog", "box": [1, 1, 9, 9]}]}])
    with pytest.raises(ValueError, match=r"object reference \[4\] out of range for 1 objects"):
        Predictor(out / "vcr_q2a").predict([{"image": image, "text": "why is [4] here ?", "choices": ["a"] * 4,
                                             "objects": [{"name": "dog", "box": [1, 1, 9, 9]}]}])
    with pytest.raises(PredictError, match="answers no box to draw"):
        predictor.predict([{"image": image, "text": "Is it a dog?"}], draw=[tmp_path / "x.png"])
    assert not (tmp_path / "x.png").exists()

    with pytest.raises(PredictError, match=f"{tmp_path} has no config.json"):
        main(["--model", str(tmp_path), "--image", image, "--text", "Is it a dog?"])

    # the command line says what is wrong in one line and exits non-zero
    result = subprocess.run([sys.executable, "-m", "vlbert_core.predict", "--model", str(tmp_path / "nowhere"),
                             "--image", image, "--text", "Is it a dog?"], cwd=REPO, capture_output=True, text=True,
                            timeout=120)
    assert (result.returncode, result.stderr.strip()) == \
        (1, f"python -m vlbert_core.predict: error: model directory {tmp_path}/nowhere does not exist")
