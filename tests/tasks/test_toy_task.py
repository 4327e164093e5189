"""A fifth task, defined in this file only: image-caption matching on a tiny world.

It registers itself in `vlbert_core.tasks.registry` and is fine-tuned, predicted and scored through
the same code as VQA, VCR and RefCOCO+ (`finetune`, `evaluate.predict_splits`,
`scoring.evaluate_predictions`), with no edit under vlbert_core/ or workflow/.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from test_tasks import BOXES, FAMILIES, MODEL_CFG, _scene, save_tiny_pretrained

from vlbert_core.tasks import registry
from vlbert_core.tasks.base import Task, TaskHeads, TaskLoss, check_prediction_ids, split_path

CAPTIONS = ["a red thing on the left", "two boxes and a ball", "nothing but sky"]


def _read_pairs(path: str) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


class CaptionMatchData:
    """<Caption, Image> with the image's ground-truth boxes; target: does the caption match."""

    def __init__(self, pairs: list[dict], images_dir: str, tokens, images, *, max_rois: int, max_text_len: int):
        self.pairs, self.images_dir = pairs, Path(images_dir)
        self.tokens, self.images = tokens, images
        self.max_rois, self.max_text_len = max_rois, max_text_len

    def __len__(self) -> int:
        return len(self.pairs)

    def sample(self, i: int) -> dict:
        from vlbert_core.tasks.samples import image_and_boxes

        pair = self.pairs[i]
        image, boxes = image_and_boxes(self.images, self.images_dir / pair["image"], np.asarray(BOXES),
                                       self.max_rois, None, f"toy pair {i}")
        ids = self.tokens.ids(pair["caption"])[: self.max_text_len - 2]
        return {"sequence": self.tokens.sequence(ids, None, len(boxes)), "image": image,
                "boxes": boxes, "match": float(pair["match"]), "image_key": pair["image"]}

    def collate(self, samples: list[dict]):
        import torch

        from vlbert_core.models.common.batch import collate_samples

        return collate_samples(samples), {"match": torch.tensor([s["match"] for s in samples]),
                                          "image_keys": [s["image_key"] for s in samples]}


class CaptionMatchTask(Task):
    name = "toy_caption_match"
    dataset = "toy"
    metric = "accuracy"

    def build_data(self, split, meta, *, sources, tokens, images, max_rois, max_text_len, rois, rois_source,
                   eval_task=None, max_examples=None):
        pairs = _read_pairs(split_path(sources["pairs"], split))
        return CaptionMatchData(pairs[:max_examples] if max_examples else pairs, sources["images"], tokens,
                                images, max_rois=max_rois, max_text_len=max_text_len)

    def build_heads(self, spec, meta):
        from torch import nn

        return TaskHeads(nn.Linear(spec.pooled_width, 1))

    def scores(self, model, output, batch):
        return {"logits": model.head(output.pooled).squeeze(-1)}

    def loss(self, model, out, extras, meta):
        import torch.nn.functional as F

        loss = F.binary_cross_entropy_with_logits(out["logits"], extras["match"])
        accuracy = ((out["logits"] > 0).float() == extras["match"]).float().mean()
        return TaskLoss(loss, {"accuracy": accuracy.item()})

    def prediction_rows(self, model, data, indices, out, extras, meta, eval_task):
        return [{"pair_id": data.pairs[i]["pair_id"], "match": bool(logit > 0)}
                for i, logit in zip(indices, out["logits"].tolist())]

    def score(self, eval_task, split, rows, sources, where):
        truth = {p["pair_id"]: bool(p["match"]) for p in _read_pairs(split_path(sources["pairs"], split))}
        check_prediction_ids([r["pair_id"] for r in rows], list(truth), "pair_id", where)
        scored = [{**r, "correct": r["match"] == truth[r["pair_id"]]} for r in rows]
        return 100.0 * sum(r["correct"] for r in scored) / len(scored), scored


@pytest.fixture()
def toy_task():
    registry.register(CaptionMatchTask)
    yield CaptionMatchTask
    registry.unregister(CaptionMatchTask.name)


@pytest.fixture(scope="module")
def toy_world(module_tmp_path):
    """Two images per split, each with a matching and a non-matching caption; a tiny pre-trained model."""
    root = module_tmp_path / "toy"
    root.mkdir()
    sources = {"pairs": str(root / "pairs_{split}.jsonl"), "images": str(root / "images")}
    for split, first in (("train", 0), ("val", 10)):
        lines = []
        for i in range(2):
            image = f"{split}_{i}.jpg"
            _scene(root / "images" / image, BOXES, first + i)
            for j, match in ((i, 1), (i + 1, 0)):
                lines.append(json.dumps({"pair_id": f"{split}-{i}-{j}", "image": image,
                                         "caption": CAPTIONS[j], "match": match}))
        Path(sources["pairs"].format(split=split)).write_text("\n".join(lines) + "\n")
    for family in FAMILIES:
        save_tiny_pretrained(root / family, family)
    return root, sources


@pytest.mark.parametrize("family", FAMILIES)
def test_a_task_defined_outside_the_package_fine_tunes_and_evaluates(toy_task, toy_world, tmp_path, family):
    from vlbert_core.tasks.evaluate import predict_splits, write_prediction_bundle
    from vlbert_core.tasks.finetune import finetune, load_finetuned
    from vlbert_core.tasks.scoring import evaluate_predictions

    root, sources = toy_world
    assert toy_task.name in registry.task_names()
    hparams = {"epochs": 2, "batch_size": 2, "lr": 1e-3, "optimizer": "adamw", "warmup_steps": 1, "max_text_len": 16}
    meta = finetune(toy_task.name, root / family, tmp_path / "ft", setting="full", schedule="half",
                    schedule_factor=1.0, hparams=hparams, tune_frcnn=False, model_cfg=MODEL_CFG, sources=sources)
    assert meta["num_train_examples"] == 4 and meta["total_steps"] == 4
    rows = [json.loads(line) for line in (tmp_path / "ft/metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and all(np.isfinite(r["loss"]) and "accuracy" in r for r in rows)
    model, _ = load_finetuned(tmp_path / "ft")
    assert model.task.name == toy_task.name and model.head.out_features == 1
    assert model.encoder.model_type == family

    bundle = predict_splits(tmp_path / "ft", [(toy_task.name, "val")], sources=sources, model_cfg=MODEL_CFG)
    write_prediction_bundle(bundle, tmp_path / "predictions.json", model_dir=tmp_path / "ft")
    result = evaluate_predictions(toy_task.name, "val", tmp_path / "predictions.json", sources,
                                  tmp_path / "eval.json", tmp_path / "eval.predictions.json",
                                  setting="full", schedule="half", dataset="toy")
    scored = json.loads((tmp_path / "eval.predictions.json").read_text())
    assert sorted(r["pair_id"] for r in scored) == ["val-0-0", "val-0-1", "val-1-1", "val-1-2"]
    assert result["metric"] == "accuracy" and result["num_examples"] == 4
    assert result["value"] == pytest.approx(25.0 * sum(r["correct"] for r in scored))
    assert json.loads((tmp_path / "eval.json").read_text()) == result


def test_unknown_task_names_list_the_registered_ones(toy_task):
    with pytest.raises(ValueError, match=r"unknown fine-tuning task 'gqa'.*toy_caption_match"):
        registry.get_task("gqa")
    with pytest.raises(ValueError, match=r"unknown eval task 'gqa_val'.*refcoco_det"):
        registry.task_of_eval("gqa_val")

    class Clash(CaptionMatchTask):
        name = "vqa_clone"
        eval_tasks = ("vqa",)

    with pytest.raises(ValueError, match=r"names \['vqa'\] are already registered"):
        registry.register(Clash)


def test_config_validation_asks_the_registry(toy_task):
    import yaml
    from snakemake.utils import validate

    repo = Path(__file__).resolve().parents[2]
    config = yaml.safe_load((repo / "config" / "config.yaml").read_text())
    validate(config, str(repo / "config" / "schema.yaml"))
    config["sources"]["toy"] = {"pairs": "pairs_{split}.jsonl", "images": "images"}
    with pytest.raises(ValueError, match=r"no section for the registered tasks \['toy_caption_match'\]"):
        registry.check_finetune_config(config["finetune"], config["sources"])
    config["finetune"]["toy_caption_match"] = dict(config["finetune"]["refcoco"])
    registry.check_finetune_config(config["finetune"], config["sources"])
    config["finetune"]["gqa"] = dict(config["finetune"]["refcoco"])
    with pytest.raises(ValueError, match=r"unknown tasks \['gqa'\]; registered tasks: .*'vqa'.*'toy_caption_match'"):
        registry.check_finetune_config(config["finetune"], config["sources"])
    del config["finetune"]["gqa"], config["finetune"]["vqa"]["num_answers"]
    with pytest.raises(ValueError, match=r"finetune.vqa lacks keys \['num_answers'\]"):
        registry.check_finetune_config(config["finetune"], config["sources"])
