"""Caption-based image retrieval (Flickr30k): the world's files, recall@K, the 4-way training batch, fine-tune +
predict + score on a tiny world with both model families, and zero-shot scores from the pre-training heads."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from test_tasks import FAMILIES, MODEL_CFG, save_tiny_pretrained
from test_world import SEED, SOURCES, TINY_WORLD

from vlbert_core.tasks.registry import get_task, task_of_eval
from vlbert_core.tasks.retrieval import (
    FlickrCaption,
    FlickrImage,
    RetrievalSplit,
    load_split,
    rank_images,
    recall_at_k,
    score_retrieval,
    true_image_ranks,
)
from vlbert_core.world import generate_world
from vlbert_core.world.flickr import karpathy_tokens

FLICKR_SOURCES = {"split_json": "syn/flickr30k/dataset_flickr30k.json",
                  "captions": "syn/flickr30k/results_20130124.token",
                  "images": "syn/flickr30k/flickr30k-images"}
FLICKR_IMAGES = {"train": 6, "val": 1, "test": 4}
IMAGE_SIZE = TINY_WORLD["image_size"]
ROI_BOXES = [[8, 8, 60, 60], [64, 40, 120, 110], [0, 70, 50, 128]]
HPARAMS = {"epochs": 1, "batch_size": 4, "lr": 1e-3, "optimizer": "adamw", "warmup_steps": 1, "max_text_len": 32,
           "hard_negatives": 2, "max_examples": 8}


def _write_rois(path: Path, keys: list[str]) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from vlbert_core.rois import ROI_SCHEMA

    n = len(ROI_BOXES)
    values = {"status": "ok", "error": "", "image_w": IMAGE_SIZE, "image_h": IMAGE_SIZE, "num_boxes": n,
              "boxes": np.asarray(ROI_BOXES, dtype=np.float32).flatten().tolist(),
              "scores": np.linspace(0.9, 0.6, n).tolist(), "class_ids": [1] * n,
              "class_scores": np.full(n * 3, 1 / 3).tolist(), "num_classes": 3}
    rows = {name: [key if name == "key" else values[name] for key in keys] for name in ROI_SCHEMA.names}
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table(rows, schema=ROI_SCHEMA), path)


@pytest.fixture(scope="module")
def flickr_world(module_tmp_path):
    """The tiny world of tests/world/test_world.py with Flickr30k (6 train, 1 val, 4 test images), RoI parquets of its
    train and test images, and a tiny pre-trained model of each family."""
    import torch

    root = module_tmp_path / "flickr_world"
    root.mkdir()
    summary = generate_world({**TINY_WORLD, "flickr_images": FLICKR_IMAGES}, {**SOURCES, "flickr30k": FLICKR_SOURCES},
                             root, SEED, summary_path=Path("syn/world.json"))
    sources = {key: str(root / path) for key, path in FLICKR_SOURCES.items()}
    task = get_task("retrieval")
    rois = {}
    for split in ("train", "test"):
        rois[split] = root / f"rois/flickr30k/{split}.parquet"
        _write_rois(rois[split], list(task.roi_image_paths(split, sources)))
    torch.set_num_threads(1)
    for family in FAMILIES:
        save_tiny_pretrained(root / family, family)
    return root, sources, rois, summary


# ---- the world's files ---------------------------------------------------------------------------------------

def test_the_world_writes_flickr30k_in_the_published_formats(flickr_world):
    root, sources, _, summary = flickr_world
    data = json.loads(Path(sources["split_json"]).read_text())
    assert data["dataset"] == "flickr30k"
    images = data["images"]
    assert [sum(1 for image in images if image["split"] == s) for s in ("train", "val", "test")] == [6, 1, 4]
    assert summary["counts"]["flickr30k"]["test"] == {"images": 4, "captions": 20}
    token_lines = Path(sources["captions"]).read_text().splitlines()
    assert len(token_lines) == 5 * len(images)
    by_name = {}
    for line in token_lines:
        name, caption = line.split("\t")
        filename, k = name.split("#")
        by_name.setdefault(filename, []).append((int(k), caption))
    sentids = []
    for image in images:
        assert set(image) == {"filename", "imgid", "split", "sentences", "sentids"}
        assert (Path(sources["images"]) / image["filename"]).is_file()
        raws = [s["raw"] for s in image["sentences"]]
        assert len(raws) == 5 and len(set(raws)) == 5  # five different captions
        assert all(s["imgid"] == image["imgid"] for s in image["sentences"])
        assert image["sentids"] == [s["sentid"] for s in image["sentences"]]
        assert all(s["tokens"] == karpathy_tokens(s["raw"]) for s in image["sentences"])
        assert by_name[image["filename"]] == list(enumerate(raws))
        sentids += image["sentids"]
    assert len(set(sentids)) == len(sentids) and len({image["imgid"] for image in images}) == len(images)
    test = load_split(sources, "test")
    assert len(test.images) == 4 and len(test.captions) == 20


def test_flickr30k_changes_no_other_dataset_of_the_world(flickr_world, tmp_path):
    """Keyed streams: the world without Flickr30k has the same bytes in every other file, and the test images do
    not depend on how many training images there are."""
    root, _, _, _ = flickr_world
    generate_world(TINY_WORLD, SOURCES, tmp_path / "without", SEED, summary_path=Path("syn/world.json"))
    other = [p for p in (tmp_path / "without").rglob("*") if p.is_file() and p.suffix != ".tsv"]
    assert len(other) > 40
    for path in other:
        rel = path.relative_to(tmp_path / "without")
        if rel.name != "world.json":
            assert path.read_bytes() == (root / rel).read_bytes(), rel
    summary = json.loads((root / "syn/world.json").read_text())
    del summary["counts"]["flickr30k"]
    assert summary == json.loads((tmp_path / "without/syn/world.json").read_text())

    more_train = {**TINY_WORLD, "flickr_images": {**FLICKR_IMAGES, "train": 9}}
    generate_world(more_train, {**SOURCES, "flickr30k": FLICKR_SOURCES}, tmp_path / "more", SEED)

    def test_images(world_root):
        data = json.loads((world_root / FLICKR_SOURCES["split_json"]).read_text())
        return [(world_root / FLICKR_SOURCES["images"] / image["filename"]).read_bytes()
                for image in data["images"] if image["split"] == "test"]

    assert test_images(root) == test_images(tmp_path / "more")


def test_flickr_config_errors_name_the_key(tmp_path):
    sources = {**SOURCES, "flickr30k": FLICKR_SOURCES}
    with pytest.raises(KeyError, match=r"world\.flickr_images: missing"):
        generate_world(TINY_WORLD, sources, tmp_path, 0)
    with pytest.raises(ValueError, match=r"world\.flickr_images: unknown split\(s\) \['restval'\]"):
        generate_world({**TINY_WORLD, "flickr_images": {"train": 4, "test": 4, "restval": 2}}, sources, tmp_path, 0)
    with pytest.raises(ValueError, match=r"world\.flickr_images\.test: at least 2 images"):
        generate_world({**TINY_WORLD, "flickr_images": {"train": 4, "test": 1}}, sources, tmp_path, 0)


def test_loader_checks_the_split_against_the_captions_file(flickr_world, tmp_path):
    _, sources, _, _ = flickr_world
    lines = Path(sources["captions"]).read_text().splitlines()
    short = tmp_path / "short.token"
    short.write_text("\n".join(lines[:-1]) + "\n")  # the last test image loses a caption
    with pytest.raises(ValueError, match=r"does not go with .*1 images have another number of captions"):
        load_split({**sources, "captions": str(short)}, "test")
    with pytest.raises(ValueError, match=r"no image in split 'testA'"):
        load_split(sources, "testA")


# ---- recall@K on hand-made score matrices ----------------------------------------------------------------------

def _split(num_images: int, captions_of: list[int]) -> RetrievalSplit:
    images = [FlickrImage(10 + j, f"{10 + j}.jpg", "test") for j in range(num_images)]
    captions = [FlickrCaption(100 + i, 10 + own, f"caption {i}") for i, own in enumerate(captions_of)]
    return RetrievalSplit(images, captions)


def _rows(scores: np.ndarray) -> list[dict]:
    """Prediction rows of a [captions, images] matrix, one row per image (the fine-tune job's format)."""
    return [{"image_id": 10 + j, "caption_ids": [100 + i for i in range(scores.shape[0])],
             "scores": scores[:, j].tolist()} for j in range(scores.shape[1])]


def test_recall_at_k_counts_ties_against_the_true_image():
    # 3 captions x 12 images; caption i describes image i
    scores = np.zeros((3, 12))
    scores[0] = np.arange(12)[::-1]        # image 0 best: rank 1
    scores[1] = np.arange(12)              # image 1 second worst: 10 images above it -> rank 11
    scores[2, :] = 0.5                     # all tied: 11 others tie with image 2 -> rank 12
    ranks = true_image_ranks(scores, np.array([0, 1, 2]))
    assert ranks.tolist() == [1, 11, 12]
    assert [recall_at_k(ranks, k) for k in (1, 5, 10)] == pytest.approx([100 / 3, 100 / 3, 100 / 3])
    assert recall_at_k([1, 2, 6, 11], 5) == 50.0

    value, scored = score_retrieval(_rows(scores), _split(12, [0, 1, 2]), "hand-made")
    assert value == pytest.approx(100 / 3)
    assert [r["rank"] for r in scored] == [1, 11, 12]
    assert [r["hit_at_1"] for r in scored] == [True, False, False]
    assert scored[0]["top_images"] == list(range(10, 20))
    # on a tie the other images come first, in image id order, then the true one
    assert scored[2]["top_images"] == [10, 11] + list(range(13, 21))
    task = get_task("retrieval")
    assert task.secondary_metrics("retrieval", "test", scored) == {
        "recall_at_5": pytest.approx(100 / 3), "recall_at_10": pytest.approx(100 / 3), "num_images": 12}


def test_a_tie_with_one_other_image_ranks_second():
    scores = np.array([[0.9, 0.9, 0.1], [0.2, 0.8, 0.8]])
    ranks = true_image_ranks(scores, np.array([0, 1]))
    assert ranks.tolist() == [2, 2]
    value, scored = score_retrieval(_rows(scores), _split(3, [0, 1]), "tie")
    assert value == 0.0 and [r["top_images"][:2] for r in scored] == [[11, 10], [12, 11]]


def test_scoring_needs_every_pair_exactly_once():
    data = _split(3, [0, 1])
    rows = _rows(np.ones((2, 3)))
    with pytest.raises(ValueError, match=r"caption 100 with image 10 is predicted twice"):
        score_retrieval(rows + [{"image_id": 10, "caption_ids": [100], "scores": [1.0]}], data, "dup")
    with pytest.raises(ValueError, match=r"1 of 6 \(caption, image\) pairs missing, e.g. \[\(101, 12\)\]"):
        score_retrieval(rows[:2] + [{"image_id": 12, "caption_ids": [100], "scores": [1.0]}], data, "missing")
    with pytest.raises(ValueError, match=r"image_id 99 is not an image of the split"):
        score_retrieval(rows + [{"image_id": 99, "caption_ids": [100], "scores": [1.0]}], data, "unknown")
    with pytest.raises(ValueError, match=r"expected a finite number"):
        score_retrieval([{"image_id": 10, "caption_ids": [100], "scores": [float("nan")]}], data, "nan")


def test_the_task_is_registered_outside_the_tables():
    task = task_of_eval("retrieval")
    assert task.name == "retrieval" and task.eval_task_names() == ("retrieval",)
    assert task.eval_splits == ("test",) and task.metric == "recall_at_1"
    assert task.paper_table is None and task.ablation_columns == ()
    assert (task.example_key, task.outcome_field, task.paired_test) == (("caption_id",), "hit_at_1", "mcnemar")


# ---- training -----------------------------------------------------------------------------------------------------

def _tools(family_dir: Path):
    from vlbert_core.models.common.bert_init import load_tokenizer
    from vlbert_core.models.common.config import visual_pixel_format
    from vlbert_core.models.registry import from_pretrained
    from vlbert_core.tasks.samples import ImageLoader, Tokens

    encoder = from_pretrained(family_dir)
    return encoder, Tokens(load_tokenizer(encoder.config.bert_path)), \
        ImageLoader.from_settings(MODEL_CFG, visual_pixel_format(encoder.config))


def test_the_four_way_training_batch(flickr_world):
    import torch

    from vlbert_core.rois import read_rois
    from vlbert_core.tasks.finetune import FinetuneModel
    from vlbert_core.tasks.modeling.retrieval import four_way_loss

    root, sources, rois, _ = flickr_world
    encoder, tokens, images = _tools(root / "vlbert")
    task = get_task("retrieval")
    meta = {"hard_negatives": 2}
    data = task.build_data("train", meta, sources=sources, tokens=tokens, images=images, max_rois=4, max_text_len=32,
                           rois=read_rois(rois["train"]), rois_source="test")
    assert len(data) == 30 and data.num_images == 6
    torch.manual_seed(0)
    samples = [data.sample(i) for i in (0, 7, 12)]
    own = {c.sentid: c.imgid for c in load_split(sources, "train").captions}
    key_of = {image.imgid: image.key for image in load_split(sources, "train").images}
    for sample in samples:
        true, with_other_image, with_other_caption = sample["candidates"]
        caption = sample["caption_id"]
        assert (true["caption_id"], true["image_key"]) == (caption, key_of[own[caption]])
        assert with_other_image["caption_id"] == caption and with_other_image["image_key"] != true["image_key"]
        assert with_other_caption["image_key"] == true["image_key"]
        assert own[with_other_caption["caption_id"]] != own[caption]  # a caption of another image
        assert len(sample["hard"]) == 2 and {h["caption_id"] for h in sample["hard"]} == {caption}
        hard_keys = [h["image_key"] for h in sample["hard"]]
        assert len(set(hard_keys)) == 2 and true["image_key"] not in hard_keys
    batch, extras = data.collate(samples)
    assert batch.batch_size == 9 and extras["hard_batch"].batch_size == 6
    assert extras["image_keys"][::3] == [s["candidates"][0]["image_key"] for s in samples]

    model = FinetuneModel("retrieval", encoder, meta)
    model.train()
    loss, stats = four_way_loss(model, model.scores(batch, extras), extras)
    assert torch.isfinite(loss) and 0.0 <= stats["accuracy"] <= 1.0
    loss.backward()
    assert model.head.classifier.weight.grad is not None
    # the hard negative is the candidate the model, in eval mode, scores highest
    model.eval()
    with torch.no_grad():
        hard = model.scores(extras["hard_batch"], {"image_keys": extras["hard_image_keys"]})["logits"].view(3, 2)
        fixed = model.scores(batch, extras)["logits"].view(3, 3)
        picked = hard.max(dim=1).values
        eval_loss, _ = four_way_loss(model, {"logits": fixed.flatten()}, extras)
    expected = torch.nn.functional.cross_entropy(torch.cat([fixed, picked[:, None]], dim=1), torch.zeros(3).long())
    assert float(eval_loss) == pytest.approx(float(expected), rel=1e-5)


def test_too_few_training_images_for_the_negatives_is_an_error(flickr_world):
    from vlbert_core.rois import read_rois

    root, sources, rois, _ = flickr_world
    _, tokens, images = _tools(root / "vlbert")
    with pytest.raises(ValueError, match=r"6 training images; .*hard_negatives=5 .* at least 7"):
        get_task("retrieval").build_data("train", {"hard_negatives": 5}, sources=sources, tokens=tokens, images=images,
                                         max_rois=4, max_text_len=32, rois=read_rois(rois["train"]), rois_source="t")


# ---- fine-tune + predict + score, both families ---------------------------------------------------------------------

def _score(bundle_path: Path, sources: dict, out: Path) -> dict:
    from vlbert_core.tasks.scoring import evaluate_predictions

    return evaluate_predictions("retrieval", "test", bundle_path, sources, out / "test.json",
                                out / "test.predictions.json", setting="full", schedule="half", dataset="synthetic")


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.slow
def test_fine_tune_predict_and_score_retrieval(flickr_world, tmp_path, family):
    from vlbert_core.tasks.evaluate import predict_splits, write_prediction_bundle
    from vlbert_core.tasks.finetune import finetune, load_finetuned

    root, sources, rois, _ = flickr_world
    meta = finetune("retrieval", root / family, tmp_path / "ft", setting="full", schedule="half", schedule_factor=1.0,
                    hparams=HPARAMS, tune_frcnn=False, model_cfg=MODEL_CFG, sources=sources,
                    rois_paths=[str(rois["train"])], seed=0)
    assert meta["num_train_examples"] == 8 and meta["total_steps"] == 2 and meta["hard_negatives"] == 2
    rows = [json.loads(line) for line in (tmp_path / "ft/metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and all(np.isfinite(r["loss"]) and "accuracy" in r for r in rows)
    model, _ = load_finetuned(tmp_path / "ft")
    assert model.encoder.model_type == family and model.head.classifier.out_features == 1

    bundle = predict_splits(tmp_path / "ft", [("retrieval", "test")], sources=sources, model_cfg=MODEL_CFG,
                            rois_paths=[str(rois["test"])])
    predicted = bundle["retrieval/test"]
    assert sum(len(r["caption_ids"]) for r in predicted) == 20 * 4  # every test caption x every test image
    write_prediction_bundle(bundle, tmp_path / "predictions.json", model_dir=tmp_path / "ft")
    result = _score(tmp_path / "predictions.json", sources, tmp_path / "eval")
    assert (result["task"], result["metric"], result["split"], result["num_examples"]) == \
        ("retrieval", "recall_at_1", "test", 20)
    assert result["num_images"] == 4
    assert 0.0 <= result["value"] <= result["recall_at_5"] <= result["recall_at_10"] == 100.0  # 4 images: all in top 10
    scored = json.loads((tmp_path / "eval/test.predictions.json").read_text())
    assert len(scored) == 20 and result["value"] == pytest.approx(5.0 * sum(r["hit_at_1"] for r in scored))
    outcomes = get_task("retrieval").example_outcomes("retrieval", [tmp_path / "eval/test.predictions.json"])
    assert len(outcomes) == 20 and set(outcomes.values()) <= {0.0, 1.0}


def test_a_users_queries_get_the_scores_of_the_evaluation(flickr_world, tmp_path):
    """query_data builds the samples build_data builds: the same pair gets the same score; rank_images orders a
    list of images by it."""
    import torch

    from vlbert_core.rois import read_rois
    from vlbert_core.tasks.evaluate import predict_batches
    from vlbert_core.tasks.finetune import FinetuneModel

    root, sources, rois, _ = flickr_world
    encoder, tokens, images = _tools(root / "vlbert")
    task = get_task("retrieval")
    model = FinetuneModel("retrieval", encoder, {"hard_negatives": 2}).eval()
    torch.nn.init.normal_(model.head.classifier.weight)  # scores that differ between pairs
    test = load_split(sources, "test")
    records = read_rois(rois["test"])
    common = dict(tokens=tokens, images=images, max_rois=4, max_text_len=32, rois_source="t")
    eval_data = task.build_data("test", {}, sources=sources, rois=records, eval_task="retrieval", **common)
    expected = {}
    for indices, out, extras in predict_batches(model, eval_data, 16, "cpu", "eval"):
        for row in task.prediction_rows(model, eval_data, indices, out, extras, {}, "retrieval"):
            expected.update({(c, row["image_id"]): s for c, s in zip(row["caption_ids"], row["scores"])})
    # image-major pairs: the frozen RoI features are computed once per test image, reused for its 20 captions
    assert (model.feature_cache.misses, model.feature_cache.hits) == (4, 76)
    caption = test.captions[3]
    queries = [{"text": caption.text, "image": f"img{j}", "image_key": f"q{j}",
                "image_path": str(Path(sources["images"]) / image.filename)} for j, image in enumerate(test.images)]
    query_rois = {f"q{j}": records[image.key] for j, image in enumerate(test.images)}
    data = task.query_data(queries, {}, rois=query_rois, workdir=tmp_path, **common)
    answers = []
    for indices, out, extras in predict_batches(model, data, 3, "cpu", "query"):
        answers += task.query_results(model, data, indices, out, extras, {}, top_k=1)
    assert [a["score"] for a in answers] == pytest.approx(
        [expected[(caption.sentid, image.imgid)] for image in test.images], abs=1e-5)

    class Predictor:  # what rank_images asks of vlbert_core.predict.Predictor
        def predict(self, queries, top_k):
            return [{"image": q["image"], "text": q["text"], **a} for q, a in zip(queries, answers)]

    ranked = rank_images(Predictor(), caption.text, [q["image"] for q in queries], top_k=2)
    order = sorted(range(4), key=lambda j: (-answers[j]["score"], j))
    assert [r["image"] for r in ranked] == [f"img{j}" for j in order[:2]] and [r["rank"] for r in ranked] == [1, 2]
    with pytest.raises(ValueError, match=r"query #0: needs a non-empty text \(the caption\)"):
        task.query_data([{**queries[0], "text": " "}], {}, rois=query_rois, workdir=tmp_path, **common)


# ---- zero-shot retrieval from the pre-training alignment head -----------------------------------------------------

def _save_heads(directory: Path, setting: str, rel_loss: bool) -> None:
    """The pre-training heads of `setting` beside the tiny model, and a metrics.jsonl with or without the
    relation loss, as pre-training writes them."""
    from vlbert_core.models.common.heads import save_pretraining_heads
    from vlbert_core.models.registry import from_pretrained
    from vlbert_core.pretrain.objectives import pretraining_module
    from vlbert_core.pretrain.settings import get_setting

    module = pretraining_module(from_pretrained(directory), get_setting(setting))
    save_pretraining_heads(module.heads, directory)
    row = {"step": 1, "loss": 1.0, "mlm_loss": 1.0, **({"rel_loss": 0.7} if rel_loss else {})}
    (directory / "metrics.jsonl").write_text(json.dumps(row) + "\n")


@pytest.mark.parametrize("family,setting", [("vlbert", "c"), ("vilbert", "vilbert")])
@pytest.mark.slow
def test_zero_shot_retrieval_with_the_alignment_head(flickr_world, tmp_path, family, setting):
    import shutil

    import torch

    from vlbert_core.tasks.modeling.retrieval import alignment_readout, load_alignment_head, zero_shot_scores

    root, sources, rois, _ = flickr_world
    directory = tmp_path / family
    shutil.copytree(root / family, directory)
    _save_heads(directory, setting, rel_loss=True)
    bundle = zero_shot_scores(directory, tmp_path / "zero_shot.json", sources=sources, model_cfg=MODEL_CFG,
                              rois_paths=[rois["test"]], max_text_len=32, batch_size=3)
    rows = bundle["retrieval/test"]
    scores = [s for r in rows for s in r["scores"]]
    assert len(scores) == 80 and all(0.0 <= s <= 1.0 for s in scores)
    assert json.loads((tmp_path / "zero_shot.json").read_text())["predictions"] == bundle
    result = _score(tmp_path / "zero_shot.json", sources, tmp_path / "eval")
    assert result["num_examples"] == 20 and result["recall_at_10"] == 100.0

    # the first image's scores, by hand: the head on the family's readout, softmax, the "matched" index
    from vlbert_core.models.registry import from_pretrained

    model = from_pretrained(directory).eval()
    head, readout = load_alignment_head(directory, model)
    assert readout == alignment_readout(family) and readout.matched_index == {"vlbert": 1, "vilbert": 0}[family]
    assert isinstance(head, type(readout.build(model.config)))
    _, tokens, images = _tools(directory)
    from vlbert_core.rois import read_rois

    data = get_task("retrieval").build_data("test", {}, sources=sources, tokens=tokens, images=images,
                                            max_rois=MODEL_CFG["max_rois"], max_text_len=32,
                                            rois=read_rois(rois["test"]), rois_source="t", eval_task="retrieval")
    batch, _ = data.collate([data.sample(i) for i in range(2)])  # image 0 with captions 0 and 1
    with torch.no_grad():
        probs = torch.softmax(head(readout.vector(model.encode(batch))), dim=1)[:, readout.matched_index]
    assert rows[0]["caption_ids"][:2] == [c[0] for c in data.captions[:2]]
    assert rows[0]["scores"][:2] == pytest.approx(probs.tolist(), abs=1e-5)


@pytest.mark.parametrize("family,setting", [("vlbert", "full"), ("vilbert", "vilbert_none")])
def test_zero_shot_needs_a_trained_alignment_head(flickr_world, tmp_path, family, setting):
    import shutil

    from vlbert_core.tasks.modeling.retrieval import zero_shot_scores

    root, sources, rois, _ = flickr_world
    directory = tmp_path / family
    shutil.copytree(root / family, directory)
    run = dict(sources=sources, model_cfg=MODEL_CFG, rois_paths=[rois["test"]])
    with pytest.raises(ValueError, match=r"needs the pre-training head .* which has no heads\.safetensors"):
        zero_shot_scores(directory, **run)
    _save_heads(directory, setting, rel_loss=False)
    # VL-BERT's setting full saves no relationship head; ViLBERT saves an alignment head it never trained
    message = {"vlbert": r"head 'relationship' of the vlbert model .* which has \['mlm', 'roi_cls'\]: it was "
                         r"pre-trained without the caption-image relation objective",
               "vilbert": r"the 'alignment' head .* was never trained: .*metrics\.jsonl has no 'rel_loss'"}[family]
    with pytest.raises(ValueError, match=message):
        zero_shot_scores(directory, **run)


def test_the_command_line_ranks_a_folder_of_images_for_a_caption(flickr_world, tmp_path):
    import shutil

    import torch
    from conftest import TINY_DETECTOR_CFG

    from vlbert_core.detector import build_detector
    from vlbert_core.predict import PredictError
    from vlbert_core.predict.__main__ import main
    from vlbert_core.tasks.finetune import finetune

    root, sources, rois, _ = flickr_world
    finetune("retrieval", root / "vlbert", tmp_path / "ft", setting="full", schedule="half", schedule_factor=1.0,
             hparams=HPARAMS, tune_frcnn=False, model_cfg=MODEL_CFG, sources=sources, rois_paths=[str(rois["train"])],
             seed=0)
    torch.manual_seed(0)
    torch.save({"config": TINY_DETECTOR_CFG, "categories": [{"id": i, "name": f"c{i}"} for i in (1, 2, 3)],
                "num_classes": 3, "state_dict": build_detector(TINY_DETECTOR_CFG, num_classes=3).state_dict()},
               tmp_path / "detector.pt")
    folder = tmp_path / "photos"
    folder.mkdir()
    test = load_split(sources, "test")
    for image in test.images[:3]:
        shutil.copy(Path(sources["images"]) / image.filename, folder / image.filename)
    (folder / "notes.txt").write_text("not an image")
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"rois": {"score_threshold": 0.0, "min_boxes": 2, "max_boxes": 4, "nms_iou": 0.3,
                                           "batch_size": 2, "num_workers": 0}}))
    args = ["--model", str(tmp_path / "ft"), "--detector", str(tmp_path / "detector.pt"), "--config", str(config),
            "--rank-images", str(folder), "--text", test.captions[0].text, "--text", test.captions[7].text,
            "--top-k", "2", "--out", str(tmp_path / "ranked.json")]
    written = main(args)
    assert written["task"] == "retrieval" and json.loads((tmp_path / "ranked.json").read_text()) == written
    assert [r["text"] for r in written["results"]] == [test.captions[0].text, test.captions[7].text]
    for result in written["results"]:
        ranked = result["images"]
        assert [r["rank"] for r in ranked] == [1, 2] and ranked[0]["score"] >= ranked[1]["score"]
        assert {Path(r["image"]).parent for r in ranked} == {folder}
    with pytest.raises(PredictError, match="has no .jpg/.jpeg/.png image"):
        main([*args[:6], "--rank-images", str(tmp_path), "--text", "a caption"])
    with pytest.raises(PredictError, match="takes --text captions only"):
        main([*args[:8], "--image", "x.jpg", "--text", "a caption"])
