"""Your own classification task (`tasks.custom.<name>`): the row checks and their accounting, the
`[CLS]` head, the metrics, a fine-tune -> predict -> score round trip, and the workflow's plan."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from test_tasks import BOXES, MODEL_CFG, _scene, _write_rois, save_tiny_pretrained

from vlbert_core.tasks import registry
from vlbert_core.tasks.custom import CustomSpec, accuracy, macro_f1, read_checked_rows
from vlbert_core.tasks.custom_rows import check_rows

REPO = Path(__file__).resolve().parents[2]
DOWNLOAD = {"allow_file_urls": True, "retries": 0}


def _dataset(root: Path) -> dict:
    """Train (JSONL): 6 good rows (one by file:// URL), a missing image, a corrupt image, a label
    no other row has, a row without text. Val (CSV): 4 good rows, a missing image, a label train lacks."""
    for i in range(6):
        _scene(root / "images" / f"{i}.png", BOXES, i)
    (root / "images" / "corrupt.png").write_bytes(b"not an image")
    train = [{"image": f"images/{i}.png", "text": f"caption {i}", "label": "abc"[i % 3]} for i in range(6)]
    train[1]["image"] = (root / "images" / "1.png").as_uri()
    train += [{"image": "images/none.png", "text": "x", "label": "a"},
              {"image": "images/corrupt.png", "text": "x", "label": "a"},
              {"image": "images/0.png", "text": "x", "label": "zzz"},
              {"image": "images/0.png", "text": "", "label": "a"}]
    (root / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in train))
    val = ["image,text,label"] + [f"images/{i}.png,caption {i},{'abc'[i % 3]}" for i in range(4)]
    val += ["images/gone.png,x,a", "images/0.png,x,q"]
    (root / "val.csv").write_text("\n".join(val) + "\n")
    return {"train": str(root / "train.jsonl"), "val": str(root / "val.csv"), "download": DOWNLOAD}


def test_every_row_is_checked_and_accounted_for(tmp_path):
    spec = CustomSpec.from_config("mine", _dataset(tmp_path / "data"))
    summary = check_rows(spec, tmp_path / "out")
    assert summary["labels"] == ["a", "b", "c", "zzz"]  # no `labels:`: the usable train rows', in order
    assert summary["counts"] == {"train": {"ok": 7, "missing_image": 1, "unreadable_image": 1, "bad_row": 1},
                                 "val": {"ok": 4, "missing_image": 1, "unknown_label": 1}}
    train = read_checked_rows(tmp_path / "out/train.rows.jsonl")
    assert [r["line"] for r in train] == list(range(1, 11))  # every row, none dropped
    assert [r["status"] for r in train[6:]] == ["missing_image", "unreadable_image", "ok", "bad_row"]
    assert "none.png" in train[6]["reason"] and "lacks ['text']" in train[9]["reason"]
    downloaded = Path(train[1]["path"])  # the file:// row went through the downloader
    assert downloaded.parent == tmp_path / "out/images" and downloaded.read_bytes() == (tmp_path / "data/images/1.png").read_bytes()
    val = read_checked_rows(tmp_path / "out/val.rows.jsonl")
    assert val[-2]["line"] == 6 and val[-2]["status"] == "missing_image"
    assert val[-1]["status"] == "unknown_label" and "'q'" in val[-1]["reason"]


def test_a_given_label_list_makes_other_labels_unknown_and_an_empty_split_is_an_error(tmp_path):
    entry = {**_dataset(tmp_path / "data"), "labels": ["a", "b"]}
    summary = check_rows(CustomSpec.from_config("mine", entry), tmp_path / "out")
    assert summary["counts"]["train"]["unknown_label"] == 1 + 2  # zzz and the two "c" rows
    entry["labels"] = ["x", "y"]
    with pytest.raises(ValueError, match=r"the train file .*train.jsonl has no usable row"):
        check_rows(CustomSpec.from_config("mine", entry), tmp_path / "out2")
    assert not (tmp_path / "out2/train.rows.jsonl").exists()


def test_bad_files_and_entries_are_named(tmp_path):
    (tmp_path / "t.jsonl").write_text('{"image": "a.png"}\nnot json\n')
    with pytest.raises(ValueError, match=r"t.jsonl line 2: not valid JSON"):
        check_rows(CustomSpec.from_config("mine", {"train": str(tmp_path / "t.jsonl"), "val": "v.csv"}), tmp_path)
    (tmp_path / "v.csv").write_text("image,caption,label\n")
    with pytest.raises(ValueError, match=r"v.csv: the CSV header .* lacks the columns \['text'\]"):
        check_rows(CustomSpec.from_config("mine", {"train": str(tmp_path / "v.csv"), "val": "v.csv"}), tmp_path)
    with pytest.raises(ValueError, match=r"tasks.custom.mine: unknown keys \['epochs'\]"):
        CustomSpec.from_config("mine", {"train": "t.jsonl", "val": "v.csv", "epochs": 3})


def test_accuracy_and_macro_f1_against_hand_computed_values():
    gold = ["a", "a", "b", "b", "c"]
    predicted = ["a", "b", "b", "b", "a"]
    # a: tp 1 fp 1 fn 1 -> 2/4; b: tp 2 fp 1 fn 0 -> 4/5; c: tp 0 fn 1 -> 0; mean 0.4333...
    assert macro_f1(predicted, gold) == pytest.approx(100 * (0.5 + 0.8 + 0.0) / 3)
    assert accuracy(predicted, gold) == pytest.approx(60.0)
    assert macro_f1(["a", "b"], ["a", "b"]) == pytest.approx(100.0)


def test_the_head_classifies_the_pooled_vector_with_dropout_then_linear():
    import torch
    from torch import nn

    from vlbert_core.tasks.modeling.custom import ClsClassifierHead

    head = ClsClassifierHead(hidden_size=8, num_labels=3, dropout=0.1)
    assert [type(m) for m in head.children()] == [nn.Dropout, nn.Linear]
    head.eval()
    sequence, pooled = torch.randn(2, 5, 8), torch.randn(2, 8)
    output = type("Output", (), {"text_states": sequence, "pooled": pooled})()
    logits = head(output, None)
    assert logits.shape == (2, 3)
    assert torch.allclose(logits, head.classifier(pooled))
    sequence += 1  # only the pooled vector counts
    assert torch.allclose(head(output, None), logits)


@pytest.fixture()
def custom_task():
    yield
    for name in registry.config_task_names():
        registry.unregister(name)


def test_a_config_entry_registers_a_task_once(custom_task, tmp_path):
    entry = {"train": "t.jsonl", "val": "v.csv"}
    assert registry.register_config_tasks({"tasks": {"custom": {"mine": entry}}}) == ["custom_mine"]
    task = registry.get_task("custom_mine")
    assert registry.register_custom("mine", entry) is type(task)  # a job script registers it again
    assert registry.dataset_sources("custom_mine", {}) == {"rows": "results/custom/mine/{split}.rows.jsonl",
                                                         "labels": "results/custom/mine/labels.json"}
    assert "custom_mine" in registry.roi_datasets() and "custom_mine" not in registry.world_task_datasets()
    with pytest.raises(ValueError, match=r"already registered"):
        registry.register_custom("mine", {"train": "other.jsonl", "val": "v.csv"})


def test_the_custom_task_fine_tunes_predicts_and_scores(custom_task, tmp_path):
    from vlbert_core.tables.custom import write_custom_table
    from vlbert_core.tasks.evaluate import predict_splits, write_prediction_bundle
    from vlbert_core.tasks.finetune import finetune, load_finetuned
    from vlbert_core.tasks.scoring import evaluate_predictions

    entry = _dataset(tmp_path / "data")
    spec = CustomSpec.from_config("mine", entry)
    out = tmp_path / "out"
    check_rows(spec, out)
    registry.register_custom("mine", entry)
    sources = {"rows": str(out / "{split}.rows.jsonl"), "labels": str(out / "labels.json")}
    task = registry.get_task("custom_mine")
    rois = {}
    for split in ("train", "val"):
        paths = task.roi_image_paths(split, sources)
        _write_rois(tmp_path / f"rois/{split}.parquet", {key: BOXES for key in paths})
        rois[split] = [str(tmp_path / f"rois/{split}.parquet")]
    save_tiny_pretrained(tmp_path / "pretrained")
    hparams = {"epochs": 1, "batch_size": 3, "lr": 1e-3, "optimizer": "adamw", "max_text_len": 16}
    meta = finetune("custom_mine", tmp_path / "pretrained", tmp_path / "ft", setting="full", schedule="full",
                    schedule_factor=1.0, hparams=hparams, tune_frcnn=False, model_cfg=MODEL_CFG, sources=sources,
                    rois_paths=rois["train"])
    assert meta["labels"] == ["a", "b", "c", "zzz"] and meta["num_train_examples"] == 7 and meta["total_steps"] == 3
    model, _ = load_finetuned(tmp_path / "ft")
    assert model.head.classifier.out_features == 4

    bundle = predict_splits(tmp_path / "ft", [("custom_mine", "val")], sources=sources, model_cfg=MODEL_CFG,
                            rois_paths=rois["val"])
    write_prediction_bundle(bundle, tmp_path / "predictions.json", model_dir=tmp_path / "ft")
    result = evaluate_predictions("custom_mine", "val", tmp_path / "predictions.json", sources,
                                  tmp_path / "eval.json", tmp_path / "eval.predictions.json",
                                  setting="full", schedule="full", dataset="synthetic")
    scored = json.loads((tmp_path / "eval.predictions.json").read_text())
    assert [r["gold"] for r in scored] == ["a", "b", "c", "a"] and result["num_examples"] == 4
    assert result["value"] == pytest.approx(accuracy([r["label"] for r in scored], [r["gold"] for r in scored]))
    assert result["macro_f1"] == pytest.approx(macro_f1([r["label"] for r in scored], [r["gold"] for r in scored]))

    rows = write_custom_table(spec, {"full": tmp_path / "eval.json"}, out / "labels.json",
                              {split: out / f"{split}.rows.jsonl" for split in ("train", "val")}, tmp_path / "t.csv",
                              tmp_path / "t.md", dataset="synthetic", model_cfg={"bert_path": "x"})
    assert rows[0]["accuracy"] == result["value"] and rows[0]["rows_skipped"] == 5
    # train's ok labels a, b, c, a, b, c, zzz: a tie, broken by label order -> always "a" on val a, b, c, a
    assert rows[1]["setting"] == "majority label" and "always 'a'" in rows[1]["note"]
    assert rows[1]["accuracy"] == 50.0 and rows[1]["macro_f1"] == pytest.approx(100 * (2 / 3) / 3)
    notes = (tmp_path / "t.md").read_text()
    assert "10 rows, 7 ok, skipped 1 missing_image, 1 unreadable_image, 1 bad_row" in notes
    assert "6 rows, 4 ok, skipped 1 missing_image, 1 unknown_label" in notes
    assert np.isfinite(rows[0]["macro_f1"])


@pytest.mark.workflow
def test_the_example_config_plans_the_custom_table(tmp_path):
    """Dry run of config/own_data_example.yaml in an empty directory: the custom table's DAG plans,
    from the world's example data through RoIs, two fine-tunes and their evaluations."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    proc = subprocess.run(
        [sys.executable, "-m", "snakemake", "-s", str(REPO / "Snakefile"), "-d", str(tmp_path), "-n",
         "--cores", "1", "results/tables/custom_example.csv",
         "--configfile", str(REPO / "config" / "own_data_example.yaml")],
        capture_output=True, text=True, timeout=120, env=env,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    table = proc.stdout.split("Job stats:", 1)[1].split("\n\n", 1)[0]
    counts = {m.group(1): int(m.group(2)) for m in re.finditer(r"^(\w+)\s+(\d+)\s*$", table, re.MULTILINE)}
    assert {k: counts[k] for k in ("custom_example", "custom_rows", "extract_task_rois", "pretrain", "finetune",
                                   "evaluate", "custom_table")} == {
        "custom_example": 1, "custom_rows": 1, "extract_task_rois": 2, "pretrain": 2, "finetune": 2,
        "evaluate": 2, "custom_table": 1}
    assert "results/finetune/custom_example/none/full/model.safetensors" in proc.stdout
    assert not (tmp_path / "results").exists()


@pytest.mark.slow
def test_predict_answers_a_custom_model_as_the_evaluation_does(custom_task, tmp_path):
    """`python -m vlbert_core.predict` on a custom task's fine-tune: --config registers the task, the
    detector's RoIs go through the same samples and model, and each held-out row's top label (and its
    probability) is the evaluation's prediction for it."""
    import torch
    import yaml
    from conftest import TINY_DETECTOR_CFG

    from vlbert_core.detector import build_detector, extract_rois_with_detector
    from vlbert_core.models.common.bert_init import load_tokenizer
    from vlbert_core.predict import PredictError, Predictor
    from vlbert_core.predict.__main__ import main
    from vlbert_core.tasks.evaluate import predict_batches, predict_splits
    from vlbert_core.tasks.finetune import finetune, load_finetuned, read_task_rois
    from vlbert_core.tasks.samples import ImageLoader, Tokens

    select = {"score_threshold": 0.5, "min_boxes": 3, "max_boxes": 6, "nms_iou": 0.3, "batch_size": 2,
              "num_workers": 0}
    entry = _dataset(tmp_path / "data")
    out = tmp_path / "out"
    check_rows(CustomSpec.from_config("mine", entry), out)
    config = {"tasks": {"custom": {"mine": entry}}, "rois": select}
    registry.register_config_tasks(config)
    sources = {"rows": str(out / "{split}.rows.jsonl"), "labels": str(out / "labels.json")}
    task = registry.get_task("custom_mine")
    _write_rois(tmp_path / "rois/train.parquet", {key: BOXES for key in task.roi_image_paths("train", sources)})
    torch.manual_seed(0)
    detector = build_detector(TINY_DETECTOR_CFG, num_classes=3)
    torch.save({"config": TINY_DETECTOR_CFG, "categories": [{"id": i, "name": f"c{i}"} for i in (1, 2, 3)],
                "num_classes": 3, "state_dict": detector.state_dict()}, tmp_path / "detector.pt")
    val_paths = task.roi_image_paths("val", sources)
    extract_rois_with_detector(tmp_path / "detector.pt", sorted((k, str(p)) for k, p in val_paths.items()),
                               tmp_path / "rois/val.parquet", select)
    save_tiny_pretrained(tmp_path / "pretrained")
    finetune("custom_mine", tmp_path / "pretrained", tmp_path / "ft", setting="full", schedule="full",
             schedule_factor=1.0, hparams={"epochs": 2, "batch_size": 3, "lr": 1e-2, "optimizer": "adamw",
                                           "max_text_len": 16},
             tune_frcnn=False, model_cfg=MODEL_CFG, sources=sources, rois_paths=[str(tmp_path / "rois/train.parquet")],
             seed=0)
    expected = predict_splits(tmp_path / "ft", [("custom_mine", "val")], sources=sources, model_cfg=MODEL_CFG,
                              rois_paths=[str(tmp_path / "rois/val.parquet")])["custom_mine/val"]
    model, meta = load_finetuned(tmp_path / "ft")
    records, rois_source = read_task_rois([str(tmp_path / "rois/val.parquet")])
    data = task.build_data("val", meta, sources=sources, tokens=Tokens(load_tokenizer(model.encoder.config.bert_path)),
                           images=ImageLoader(MODEL_CFG["image_max_side"]), max_rois=MODEL_CFG["max_rois"],
                           max_text_len=meta["max_text_len"], rois=records, rois_source=rois_source)
    probabilities = torch.cat([torch.softmax(o["logits"], dim=1)
                               for _, o, _ in predict_batches(model, data, meta["batch_size"], "cpu", "val")])

    rows = [r for r in read_checked_rows(out / "val.rows.jsonl") if r["status"] == "ok"]
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    written = main(["--model", str(tmp_path / "ft"), "--task", "custom_mine", "--detector", str(tmp_path / "detector.pt"),
                    "--config", str(tmp_path / "config.yaml"), *[a for r in rows for a in ("--image", r["path"], "--text", r["text"])],
                    "--top-k", "2"])
    results = written["results"]
    assert written["task"] == "custom_mine" and len(results) == len(expected) == 4
    assert [r["label"] for r in results] == [row["label"] for row in expected]
    for result, row_probabilities in zip(results, probabilities):
        assert [a["label"] for a in result["labels"]] == [meta["labels"][j] for j in row_probabilities.argsort(
            descending=True, stable=True)[:2].tolist()]
        assert [a["probability"] for a in result["labels"]] == pytest.approx(
            row_probabilities.sort(descending=True).values[:2].tolist(), abs=1e-6)

    registry.unregister("custom_mine")  # without the config that declares it, the model's task is unknown
    with pytest.raises(PredictError, match=r"custom_mine model, a task that is not registered.*--config"):
        Predictor(tmp_path / "ft")
    with pytest.raises(ValueError, match=r"query #0: the text is \d+ word pieces"):
        Predictor(tmp_path / "ft", config=config, detector=tmp_path / "detector.pt").predict(
            [{"image": rows[0]["path"], "text": "word " * 40}])
    # a URL under this task's own downloader settings: its errors name its config key
    no_files = {"tasks": {"custom": {"mine": {**entry, "download": {"retries": 0}}}}, "rois": select}
    registry.unregister("custom_mine")
    with pytest.raises(PredictError, match=r"tasks\.custom\.mine\.download\.allow_file_urls is false"):
        Predictor(tmp_path / "ft", config=no_files, detector=tmp_path / "detector.pt").predict(
            [{"image": Path(rows[0]["path"]).as_uri(), "text": "caption 0"}])


def test_a_download_option_error_names_the_entry(tmp_path):
    entry = {**_dataset(tmp_path / "data"), "download": {"bogus": 1}}
    with pytest.raises(ValueError, match=r"config tasks\.custom\.mine\.download: missing keys \[\], unknown keys \['bogus'\]"):
        check_rows(CustomSpec.from_config("mine", entry), tmp_path / "out")
