"""Pre-training: masking rates, the data streams, the Table 4 switches, the loop and its resume."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import MINILM, NUM_FG_CLASSES
from test_tensorboard import assert_events_match_metrics

from vlbert_core.detector import load_detector
from vlbert_core.images import DEFAULT_MAX_PIXELS
from vlbert_core.models.common.batch import collate_samples
from vlbert_core.models.common.bert_init import load_tokenizer
from vlbert_core.models.common.inputs import IMG, build_input_sequence
from vlbert_core.models.vlbert.embeddings import APPEARANCE_STD_FLOOR
from vlbert_core.models.vlbert.model import VLBertModel
from vlbert_core.pretrain import SETTINGS, get_setting, pretrain
from vlbert_core.pretrain.data import (
    CaptionImageStream, DataStream, PretrainBatches, StreamConfig, TextStream, pair_shards_with_rois,
    read_cc_samples, read_held_out_captions, text_chunks,
)
from vlbert_core.models.vlbert.config import build_vlbert_config
from vlbert_core.models.vlbert.pretraining import VLBertForPretraining
from vlbert_core.pretrain.loop import APPEARANCE_STATS_IMAGES
from vlbert_core.pretrain.masking import IGNORE_INDEX, MaskingVocab, mask_rois, whole_word_mask, word_groups
from vlbert_core.pretrain.visual_clue import sign_test_p, strided_word_variants, visual_clue_check

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(MINILM)


def model_cfg(world) -> dict:
    return {"bert_path": world["bert"], "num_hidden_layers": 1, "geometry_dim": 16, "max_rois": 4,
            "image_max_side": 48, "frozen_stages": 2, "freeze_bn": True}


def pretrain_cfg(**overrides) -> dict:
    cfg = {"steps": 4, "cc_batch_size": 2, "text_batch_size": 2, "lr_per_sample": 1e-4, "weight_decay": 0.01,
           "warmup_steps": 1, "clip_grad": 1.0, "max_text_len": 16, "max_caption_len": 12, "checkpoint_every": 2,
           "streams_per_rank": 1, "stream_workers": False, "held_out_per_shard": 1}
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
    # box 0 is the whole (48 x 32) image, [0, 0, W - 1, H - 1]; RoIs are rescaled from the 2x RoI frame, cut to
    # max_rois - 1 and clamped to the image's last pixel
    torch.testing.assert_close(s["boxes"][0], torch.tensor([0.0, 0.0, 47.0, 31.0]))
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
    batches = PretrainBatches([DataStream(cc, text, 3, 3)])
    for _ in range(5):
        next(batches)
    state = json.loads(json.dumps(batches.state()))  # the state survives serialisation
    expected = [next(batches) for _ in range(3)]
    cc2, text2 = _streams(world, tokenizer, "d")
    resumed = PretrainBatches([DataStream(cc2, text2, 3, 3)])
    resumed.load_state(state)
    for a, b in zip(expected, (next(resumed) for _ in range(3))):
        assert torch.equal(a.inputs.input_ids, b.inputs.input_ids)
        assert torch.equal(a.mlm_labels, b.mlm_labels)
        assert torch.equal(a.inputs.images, b.inputs.images)
        assert torch.equal(a.roi_selected, b.roi_selected)
    assert expected[0].inputs.has_image.tolist() == [True] * 3 + [False] * 3


def _stream(world, tokenizer, setting, stream, num_streams, held_out_per_shard=0, per_step=2):
    cfg = StreamConfig(max_caption_len=12, max_text_len=16, max_rois=4, image_max_side=48, seed=0, stream=stream,
                       num_streams=num_streams, held_out_per_shard=held_out_per_shard)
    vocab = MaskingVocab.from_tokenizer(tokenizer)
    cc = CaptionImageStream(pair_shards_with_rois(world["cc"], world["rois"]), tokenizer, vocab, cfg,
                            get_setting(setting), NUM_FG_CLASSES + 1)
    text = TextStream(world["text"], tokenizer, vocab, cfg) if get_setting(setting).text_corpus else None
    return DataStream(cc, text, per_step, per_step)


def _rows(batch):
    """Each sample of a batch without its padding: (ids, MLM labels, image or None)."""
    rows = []
    for i in range(batch.mlm_labels.shape[0]):
        valid = batch.inputs.attention_mask[i]
        image = batch.inputs.images[i] if bool(batch.inputs.has_image[i]) else None
        rows.append((batch.inputs.input_ids[i][valid], batch.mlm_labels[i][valid], image))
    return rows


def _assert_same_rows(got, want):
    assert len(got) == len(want)
    for (ids_a, labels_a, image_a), (ids_b, labels_b, image_b) in zip(got, want):
        assert torch.equal(ids_a, ids_b) and torch.equal(labels_a, labels_b)
        assert (image_a is None) == (image_b is None) and (image_a is None or torch.equal(image_a, image_b))


def test_streams_split_the_shards_and_one_process_can_run_all_of_them(world, tokenizer):
    # Stream s of 2 reads shards[s::2] of each source.
    first, second = _stream(world, tokenizer, "d", 0, 2), _stream(world, tokenizer, "d", 1, 2)
    assert {next(first.cc)["key"][:2] for _ in range(8)} == {"s0"}
    assert {next(second.cc)["key"][:2] for _ in range(8)} == {"s1"}
    assert first.text.shards == world["text"][:1] and second.text.shards == world["text"][1:]
    with pytest.raises(ValueError, match="cannot feed 3 data streams"):
        _stream(world, tokenizer, "d", 2, 3)
    # One process running streams 0 and 1 builds, step after step, the union of what two ranks running
    # one stream each build: the global batch does not depend on the world size.
    both = PretrainBatches([_stream(world, tokenizer, "d", 0, 2), _stream(world, tokenizer, "d", 1, 2)])
    rank0 = PretrainBatches([_stream(world, tokenizer, "d", 0, 2)])
    rank1 = PretrainBatches([_stream(world, tokenizer, "d", 1, 2)])
    assert both.samples_per_batch == 8 and rank0.samples_per_batch == 4
    for _ in range(4):
        _assert_same_rows(_rows(next(both)), _rows(next(rank0)) + _rows(next(rank1)))


def test_stream_workers_give_the_same_batches_and_states(world, tokenizer):
    def batches(workers):
        return PretrainBatches([_stream(world, tokenizer, "c", s, 2) for s in range(2)], workers=workers)

    in_process, in_workers = batches(False), batches(True)
    for _ in range(3):
        _assert_same_rows(_rows(next(in_workers)), _rows(next(in_process)))
    assert in_workers.state() == in_process.state()
    resumed = batches(True)
    resumed.load_state(in_workers.state())
    _assert_same_rows(_rows(next(resumed)), _rows(next(in_process)))


def test_held_out_captions_never_reach_pre_training(world, tokenizer):
    stream = _stream(world, tokenizer, "b", 0, 1, held_out_per_shard=2).cc
    trained = {next(stream)["key"] for _ in range(7)}   # one epoch: 12 rows - 4 held out - 1 failed
    assert trained == {f"s{s}i{i}" for s in range(2) for i in range(2, 6)} - {"s1i5"}
    assert stream.epoch == 0 and next(stream)["key"] in trained and stream.epoch == 1
    cfg = StreamConfig(max_caption_len=12, max_text_len=16, max_rois=4, image_max_side=48, seed=0)
    held_out = read_held_out_captions(pair_shards_with_rois(world["cc"], world["rois"]), 2, cfg)
    assert [h["key"] for h in held_out] == ["s0i0", "s0i1", "s1i0", "s1i1"]
    assert held_out[1]["caption"] == "a green box beside a box" and held_out[0]["image"].shape == (3, 32, 48)
    torch.testing.assert_close(held_out[0]["boxes"][0], torch.tensor([0.0, 0.0, 47.0, 31.0]))


def test_strided_word_variants_mask_every_word_once(tokenizer):
    ids = tokenizer("a giraffe beside extraordinarily big boxes", add_special_tokens=False)["input_ids"]
    tokens = tokenizer.convert_ids_to_tokens(ids)
    groups = word_groups(tokens)
    assert len(groups) == 6 and len(ids) > 6
    variants = strided_word_variants(ids, tokens, tokenizer.mask_token_id, stride=4)
    assert len(variants) == 4
    for j, (masked, labels) in enumerate(variants):
        want = [i for group in groups[j::4] for i in group]    # words j and j + 4
        assert [i for i, m in enumerate(masked) if m == tokenizer.mask_token_id] == want
        assert [(i, label) for i, label in enumerate(labels) if label != IGNORE_INDEX] == [(i, ids[i]) for i in want]
    assert len(strided_word_variants(ids, tokens, tokenizer.mask_token_id, stride=7)) == 6   # one word each


class _SeesPixels(torch.nn.Module):
    """Stand-in model for the visual-clue check: each token's hidden state is 1 if its image has any pixel."""

    def visual_features(self, images):
        seen = images.images.abs().flatten(1).sum(1)                       # [C]
        return seen[:, None, None].expand(-1, images.boxes.shape[1], 1)   # [C, R, 1]

    def forward(self, batch, roi_features):
        sees = (roi_features.abs().flatten(1).sum(1) > 0).float()         # [N]
        return SimpleNamespace(text_states=sees[:, None, None].expand(-1, batch.input_ids.shape[1], 1))


class _RedIfSeen(torch.nn.Module):
    """Stand-in MLM head: predicts "red" where the hidden state is 1, "blue" where it is 0."""

    def __init__(self, red: int, blue: int, vocab_size: int):
        super().__init__()
        self.red, self.blue, self.vocab_size = red, blue, vocab_size

    def forward(self, hidden):
        logits = torch.full((hidden.shape[0], self.vocab_size), -1.0)
        logits[:, self.red], logits[:, self.blue] = hidden[:, 0], 1 - hidden[:, 0]
        return logits


def test_visual_clue_check_pairs_the_two_conditions_token_by_token(tokenizer):
    red, blue = tokenizer.convert_tokens_to_ids(["red", "blue"])
    held_out = [{"caption": caption, "image": torch.ones(3, 8, 8), "boxes": torch.tensor([[0.0, 0.0, 8.0, 8.0]])}
                for caption in ("red red red blue", "red blue")]
    record = visual_clue_check(_SeesPixels(), _RedIfSeen(red, blue, tokenizer.vocab_size), held_out, tokenizer,
                               max_caption_len=16, device=torch.device("cpu"))
    assert record["captions"] == 2 and record["masked_words"] == 6
    assert record["with_image"] == {"mlm_acc": 4 / 6, "correct": 4, "masked_tokens": 6}
    assert record["blank_image"] == {"mlm_acc": 2 / 6, "correct": 2, "masked_tokens": 6}
    assert record["paired"] == {"right_only_with_image": 4, "right_only_blanked": 2, "sign_test_p": sign_test_p(4, 2)}


def test_sign_test_p_matches_the_exact_binomial():
    # Reference values from scipy.stats.binomtest(wins, wins + losses).pvalue.
    assert sign_test_p(5, 0) == sign_test_p(0, 5) == pytest.approx(0.0625)
    assert sign_test_p(53, 27) == pytest.approx(0.004868154149559423)
    assert sign_test_p(11, 6) == pytest.approx(0.332305908203125)
    assert sign_test_p(0, 0) == sign_test_p(3, 3) == 1.0
    assert 0 < sign_test_p(2000, 1900) < 1


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
    from vlbert_core.pretrain.settings import ABLATION_SETTINGS, COMPARISON_PAIRS

    assert list(SETTINGS) == [*ABLATION_SETTINGS, "vilbert_none", "vilbert"]
    assert {SETTINGS[s].model_type for s in ABLATION_SETTINGS} == {"vlbert"}
    assert not SETTINGS["none"].trains and SETTINGS["full"].tune_frcnn
    assert [s for s in ABLATION_SETTINGS if SETTINGS[s].relationship] == ["c"]
    # each ViLBERT setting trains exactly the tasks of the VL-BERT setting it is compared with
    for vlbert, vilbert in COMPARISON_PAIRS:
        switches = {k: v for k, v in SETTINGS[vlbert].to_dict().items() if k not in ("name", "model_type")}
        assert switches == {k: v for k, v in SETTINGS[vilbert].to_dict().items() if k not in ("name", "model_type")}
        assert SETTINGS[vilbert].model_type == "vilbert"
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
    batch = next(PretrainBatches([DataStream(cc, text, 4, 4)]))
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


def _full_sequence_losses(module, batch) -> dict[str, torch.Tensor]:
    """The reference the heads are checked against: every head on every position of the sequence, then
    the losses and accuracies read off at the labelled positions only."""
    import torch.nn.functional as F

    from vlbert_core.pretrain.objectives import soft_cross_entropy

    inputs = batch.inputs
    hidden = module.model.encode(inputs).sequence_output
    out = {}
    mlm = module.heads.mlm                     # its decoder written out as the plain linear of BERT
    logits = F.linear(mlm.transform(hidden), module.model.word_embeddings().weight, mlm.bias)   # [B, L, vocab]
    row_has_image = inputs.has_image[:, None].expand_as(batch.mlm_labels)
    for name, rows in (("mlm", row_has_image), ("mlm_text", ~row_has_image)):
        labels = batch.mlm_labels.masked_fill(~rows, IGNORE_INDEX)
        count = (labels != IGNORE_INDEX).sum()
        per_token = F.cross_entropy(logits.transpose(1, 2), labels, reduction="none")   # 0 where ignored
        out[f"{name}_loss"] = per_token.sum() / count
        out[f"{name}_acc"] = ((logits.argmax(-1) == labels) & (labels != IGNORE_INDEX)).sum() / count
    roi_logits = module.heads.roi_cls(hidden)                                  # [B, L, classes]
    roi_targets = torch.gather(batch.roi_labels, 1, inputs.roi_index[..., None].expand(-1, -1, roi_logits.shape[-1]))
    is_target = (torch.gather(batch.roi_selected, 1, inputs.roi_index) & (inputs.element_kind == IMG)
                 & inputs.attention_mask)
    count = is_target.sum()
    per_roi = torch.where(is_target, soft_cross_entropy(roi_logits, roi_targets.clamp(min=1e-30)), 0.0)
    out["roi_loss"] = per_roi.sum() / count
    out["roi_acc"] = ((roi_logits.argmax(-1) == roi_targets.argmax(-1)) & is_target).sum() / count
    out["loss"] = out["mlm_loss"] + out["mlm_text_loss"] + out["roi_loss"]
    return out


def test_heads_on_labelled_positions_only_equal_the_full_sequence_computation(world, tokenizer):
    """The MLM head (objectives mlm and mlm_text) and the masked-RoI head run only on the positions that
    have a target; losses, accuracies and every gradient equal those of running them on the whole sequence."""
    from vlbert_core.detector import load_detector

    detector, meta = load_detector(world["detector"])
    config = build_vlbert_config(model_cfg(world), meta, tune_frcnn=False)
    torch.manual_seed(0)
    module = VLBertForPretraining(VLBertModel.from_bert(config, detector.state_dict()), get_setting("d")).eval()
    cc, text = _streams(world, tokenizer, "d")
    batch = next(PretrainBatches([DataStream(cc, text, 4, 4)]))
    labelled = batch.mlm_labels != IGNORE_INDEX
    assert labelled[batch.inputs.has_image].any() and labelled[~batch.inputs.has_image].any()
    # Every RoI with a detector label becomes a target (the masking picks few of 4), so the check sees many.
    batch.roi_selected.copy_(batch.roi_labels.sum(-1) > 0)
    assert int(batch.roi_selected.sum()) >= 4 and labelled.float().mean() < 0.5

    results, grads = [], []
    for compute in (module, lambda b: _full_sequence_losses(module, b)):
        module.zero_grad(set_to_none=True)
        out = compute(batch)
        out["loss"].backward()
        results.append({k: v.detach() for k, v in out.items()})
        grads.append({n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None})
    gathered, full = results
    assert set(gathered) == set(full)
    for key in full:
        torch.testing.assert_close(gathered[key], full[key].float(), rtol=1e-5, atol=1e-6, msg=key)
    assert set(grads[0]) == set(grads[1]) and "heads.roi_cls.classifier.weight" in grads[0]
    for name in grads[1]:
        torch.testing.assert_close(grads[0][name], grads[1][name], rtol=1e-4, atol=1e-6, msg=name)


def padded_encoder_pass(encoder, x: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """The encoder's layers on the padded batch as it is, every element through every projection: what
    VLBertEncoder computed before it packed the real elements (PackedLayout)."""
    attend = attention_mask[:, None, None, :]
    for layer in encoder.layers:
        x = layer(x, attend)
    return x


@pytest.mark.parametrize("setting", ["d", "full"])
def test_packed_encoder_equals_one_padded_pass(world, tokenizer, setting):
    """A batch of short <Caption, Image> rows and long <Text, ∅> rows: the encoder, which runs its projections
    on the real elements only, gives at every real element the outputs, and every parameter the gradient, of
    one padded pass (the tuned visual network's too in `full`)."""
    spec = get_setting(setting)
    detector, meta = load_detector(world["detector"])
    config = build_vlbert_config(model_cfg(world), meta, tune_frcnn=spec.tune_frcnn)
    torch.manual_seed(0)
    model = VLBertModel.from_bert(config, detector.state_dict()).eval()   # no dropout: the passes compare
    cc, text = _streams(world, tokenizer, setting)
    inputs = next(PretrainBatches([DataStream(cc, text, 4, 4)])).inputs
    lengths = inputs.attention_mask.sum(1)
    longest = sorted(int(lengths[rows].max()) for rows in (inputs.has_image, ~inputs.has_image))
    assert longest[0] < longest[1] == inputs.input_ids.shape[1]     # the caption rows carry padding

    packed_encoder = model.encoder.forward
    probe = torch.randn(*inputs.input_ids.shape, config.hidden_size, generator=torch.Generator().manual_seed(1))
    outputs, grads = [], []
    for encoder in (packed_encoder, lambda x, mask: padded_encoder_pass(model.encoder, x, mask)):
        model.encoder.forward = encoder
        model.zero_grad(set_to_none=True)
        hidden = model.encode(inputs).sequence_output
        (hidden * probe * inputs.attention_mask[..., None]).sum().backward()
        outputs.append(hidden.detach()[inputs.attention_mask])
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert not bool(outputs[0].eq(0).all(-1).any())
    torch.testing.assert_close(outputs[0], outputs[1], rtol=1e-5, atol=1e-5)
    assert set(grads[0]) == set(grads[1])
    assert any(n.startswith("visual_network.") for n in grads[0]) == spec.tune_frcnn
    for name in grads[1]:
        torch.testing.assert_close(grads[0][name], grads[1][name], rtol=1e-4, atol=1e-5, msg=name)


def test_packed_encoder_trains_to_the_weights_of_padded_passes(world, tokenizer):
    """Setting full (visual network tuned), three AdamW steps on batches mixing caption and text rows: the weights
    after them equal, within fp32 noise, those of the same steps with every element through every projection.
    Dropout is off (eval mode): it draws its masks for the packed elements, which is another random draw."""
    import copy

    spec = get_setting("full")
    detector, meta = load_detector(world["detector"])
    config = build_vlbert_config(model_cfg(world), meta, tune_frcnn=True)
    torch.manual_seed(0)
    start = VLBertForPretraining(VLBertModel.from_bert(config, detector.state_dict()), spec)
    cc, text = _streams(world, tokenizer, "full")
    batches = PretrainBatches([DataStream(cc, text, 3, 3)])
    steps = [next(batches) for _ in range(3)]
    trained = []
    for padded in (False, True):
        module = copy.deepcopy(start).eval()
        if padded:
            module.model.encoder.forward = lambda x, mask, enc=module.model.encoder: padded_encoder_pass(enc, x, mask)
        optimizer = torch.optim.AdamW([p for p in module.parameters() if p.requires_grad], lr=1e-3)
        for batch in steps:
            module(batch)["loss"].backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        trained.append(module.state_dict())
    moved = [k for k, v in trained[0].items() if v.is_floating_point() and not torch.equal(v, start.state_dict()[k])]
    assert any(k.startswith("model.visual_network.") for k in moved) and any(".encoder." in k for k in moved)
    for key, value in trained[1].items():
        torch.testing.assert_close(trained[0][key], value, rtol=1e-4, atol=1e-5, msg=key)


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
    model = VLBertModel.from_pretrained(tmp_path)
    from transformers import BertModel

    bert = BertModel.from_pretrained(world["bert"], local_files_only=True)
    torch.testing.assert_close(model.embeddings.word_embeddings.weight, bert.embeddings.word_embeddings.weight)
    assert not (tmp_path / "checkpoint.pt").exists()
    # The control of the visual-clue check: the visual term enters through zero-initialised LayerNorms, so
    # the untrained model predicts exactly the same with and without the image.
    clue = json.loads((tmp_path / "visual_clue.json").read_text())
    assert clue["captions"] == 2 and clue["masked_words"] == 12   # s0i0, s1i0 (held_out_per_shard=1)
    assert clue["with_image"]["masked_tokens"] == clue["blank_image"]["masked_tokens"] >= 12
    assert clue["with_image"]["correct"] == clue["blank_image"]["correct"]
    assert clue["paired"] == {"right_only_with_image": 0, "right_only_blanked": 0, "sign_test_p": 1.0}
    events = assert_events_match_metrics(tmp_path)
    assert events["visual_clue/masked_words"] == [(0, 12.0)] and events["train/steps"] == [(0, 0.0)]


def test_pretraining_measures_appearance_statistics_on_training_images(world, tokenizer, tmp_path):
    cfg = dict(model_cfg(world), standardise_appearance=True)
    pretrain("none", world["cc"], world["rois"], world["text"], world["detector"], cfg, pretrain_cfg(), str(tmp_path),
             seed=7, device="cpu")
    saved = VLBertModel.from_pretrained(tmp_path).embeddings.visual_feature
    # The statistics are those of the RoI features of the images right after the held-out ones (never the
    # held-out images the visual-clue check uses), measured with the detector-initialised visual network.
    detector, meta = load_detector(world["detector"])
    model = VLBertModel.from_bert(build_vlbert_config(cfg, meta, tune_frcnn=False), detector.state_dict()).eval()
    stream_cfg = StreamConfig(max_caption_len=12, max_text_len=16, max_rois=4, image_max_side=48, seed=7,
                              held_out_per_shard=1)
    pairs = pair_shards_with_rois(world["cc"], world["rois"])
    per_shard = -(-APPEARANCE_STATS_IMAGES // len(pairs))
    samples = read_cc_samples(pairs, 1, 1 + per_shard, stream_cfg)
    assert samples and not {s["key"] for s in samples} & {s["key"] for s in read_held_out_captions(pairs, 1, stream_cfg)}
    batch = collate_samples([{"sequence": build_input_sequence([], None, len(s["boxes"]), cls_id=1, sep_id=2, pad_id=0),
                              "image": s["image"], "boxes": s["boxes"]} for s in samples])
    with torch.no_grad():
        features = model.visual_features(batch)[batch.box_valid]
    torch.testing.assert_close(saved.appearance_mean, features.mean(0))
    torch.testing.assert_close(saved.appearance_std, features.std(0).clamp(min=APPEARANCE_STD_FLOOR))
    assert saved.standardise_appearance and not torch.allclose(saved.appearance_mean, torch.zeros_like(saved.appearance_mean))


def test_resume_matches_straight_run(world, tmp_path):
    straight, interrupted = tmp_path / "straight", tmp_path / "interrupted"
    assert _run(world, "full", straight)["resumed_from"] is None
    summary = _run(world, "full", interrupted, stop_after_step=2)
    assert summary["stopped"] and not (interrupted / "model.safetensors").exists()
    assert torch.load(interrupted / "checkpoint.pt", weights_only=True)["step"] == 2
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
    clue_a, clue_b = (json.loads((d / "visual_clue.json").read_text()) for d in (straight, interrupted))
    assert clue_a == clue_b and clue_a["setting"] == "full" and clue_a["captions"] == 2
    assert 0 <= clue_a["with_image"]["mlm_acc"] <= 1 and 0 <= clue_a["blank_image"]["mlm_acc"] <= 1
    paired = clue_a["paired"]
    assert (paired["right_only_with_image"] - paired["right_only_blanked"]
            == clue_a["with_image"]["correct"] - clue_a["blank_image"]["correct"])
    assert paired["sign_test_p"] == sign_test_p(paired["right_only_with_image"], paired["right_only_blanked"])
    # TensorBoard: the same scalars as metrics.jsonl and visual_clue.json, the interrupted run's steps 3-4
    # replaced by the resumed run's
    for out in (straight, interrupted):
        events = assert_events_match_metrics(out)
        assert events["visual_clue/with_image/mlm_acc"] == [(4, pytest.approx(clue_a["with_image"]["mlm_acc"]))]
        assert {"train/mlm_loss", "train/lr", "train/grad_norm", "train/samples_per_s"} <= events.keys()


def _heads(directory: Path) -> dict:
    from vlbert_core.models.common.heads import read_pretraining_heads
    from vlbert_core.models.vlbert.heads import HEAD_NAMES

    return read_pretraining_heads(directory, HEAD_NAMES)


def test_continued_pretraining_starts_from_the_saved_model_and_heads(world, tmp_path):
    """init_from: a model directory with its pre-training heads (heads.safetensors) continues as it was; with
    a zero learning rate a step changes nothing, so model and heads come out as they went in."""
    first = tmp_path / "b"
    _run(world, "b", first, cfg={"steps": 2})
    saved = _heads(first)
    assert set(saved) == {"mlm", "roi_cls"}                  # setting b: MLM and masked-RoI classification
    more = tmp_path / "d"
    summary = _run(world, "d", more, cfg={"steps": 1, "lr_per_sample": 0.0}, init_from=str(first))
    assert summary["steps"] == 1 and summary["final"]["mlm_loss"] > 0 and "roi_loss" in summary["final"]
    continued = _heads(more)
    for head in ("mlm", "roi_cls"):
        for key, value in saved[head].items():
            torch.testing.assert_close(continued[head][key], value, rtol=0, atol=0)
    a, b = VLBertModel.from_pretrained(first).state_dict(), VLBertModel.from_pretrained(more).state_dict()
    for key in a:
        torch.testing.assert_close(b[key], a[key], rtol=0, atol=0, msg=key)
    # setting none from a model: written as it is and measured (MLM accuracy on the held-out captions)
    measured = tmp_path / "measured"
    _run(world, "none", measured, init_from=str(first))
    clue = json.loads((measured / "visual_clue.json").read_text())
    assert clue["captions"] == 2 and 0 <= clue["with_image"]["mlm_acc"] <= 1
    assert json.loads((measured / "metrics.jsonl").read_text())["note"].startswith("not pre-trained further")


@pytest.mark.slow
def test_continued_pretraining_from_a_converted_released_checkpoint(world, tmp_path):
    """A converted released VL-BERT (cut down, its masked-RoI head sized to this world's detector classes)
    keeps its MLM and masked-RoI heads and continues pre-training with them: the released architecture (text-
    only rows as word pieces + [END], geometry by centre and size) runs a step."""
    import dataclasses

    from test_convert_vlbert import cut_down, load, write_released

    from vlbert_core.convert.__main__ import main as convert_main

    manifest = cut_down(load("vl-bert-base-e2e"))
    classes = NUM_FG_CLASSES + 1
    tensors = {k: ((classes, *shape[1:]) if "region_cls_pred" in k else shape, dtype)
               for k, (shape, dtype) in manifest.tensors.items()}
    write_released(dataclasses.replace(manifest, tensors=tensors), tmp_path / "e2e.model")
    assert convert_main(["vl-bert", str(tmp_path / "e2e.model"), str(tmp_path / "released"),
                         "--bert-path", str(world["bert"])]) == 0
    saved = _heads(tmp_path / "released")
    out = tmp_path / "continued"
    summary = _run(world, "full", out, cfg={"steps": 1, "lr_per_sample": 0.0}, init_from=str(tmp_path / "released"))
    assert summary["steps"] == 1 and math.isfinite(summary["final"]["loss"])
    assert json.loads((out / "config.json").read_text())["text_only_layout"] == "released"
    torch.testing.assert_close(_heads(out)["roi_cls"]["classifier.weight"], saved["roi_cls"]["classifier.weight"])


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

    spec = importlib.util.spec_from_file_location("pretrain_script", Path(__file__).parents[2] / "workflow/scripts/pretrain.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    out = tmp_path / "pretrain" / "b"
    smk = SimpleNamespace(
        input=_Namedlist(cc_shards=world["cc"], roi_parquets=world["rois"], text_shards=world["text"],
                         detector=world["detector"]),
        output=_Namedlist(model=str(out / "model.safetensors"), heads=str(out / "heads.safetensors"),
                          config=str(out / "config.json"), metrics=str(out / "metrics.jsonl"),
                          visual_clue=str(out / "visual_clue.json")),
        params=_Namedlist(setting="b", init_from=None, model=model_cfg(world), pretrain=pretrain_cfg(steps=1), seed=0,
                          max_image_pixels=DEFAULT_MAX_PIXELS,
                          device="cpu"),
        threads=1, log=[str(tmp_path / "log.txt")])
    script.main(smk)
    assert (out / "model.safetensors").is_file() and (out / "config.json").is_file()
    assert (out / "visual_clue.json").is_file() and set(_heads(out)) == {"mlm", "roi_cls"}
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 1 and {"mlm_loss", "roi_loss"} <= records[0].keys() and "rel_loss" not in records[0]
    assert "setting b done" in (tmp_path / "log.txt").read_text()


def test_command_line_entry_point(world, tmp_path):
    import yaml

    from vlbert_core.pretrain.__main__ import main

    base, override = tmp_path / "base.yaml", tmp_path / "override.yaml"
    base.write_text(yaml.safe_dump({"seed": 0, "device": "cpu", "max_image_pixels": DEFAULT_MAX_PIXELS,
                                    "model": model_cfg(world), "pretrain": {"settings": ["a"], **pretrain_cfg(steps=3)}}))
    override.write_text(yaml.safe_dump({"pretrain": {"steps": 1}}))
    out = tmp_path / "out"
    summary = main(["--setting", "a", "--config", str(base), "--config", str(override), "--cc-shards", *world["cc"],
                    "--roi-parquets", *world["rois"], "--detector", world["detector"], "--out", str(out),
                    "--threads", "1"])
    assert summary["steps"] == 1   # the later --config wins
    assert {p.name for p in out.iterdir()} >= {"model.safetensors", "config.json", "metrics.jsonl", "visual_clue.json",
                                               "pretrain.rank0.log"}
    with pytest.raises(FileNotFoundError, match="missing.yaml"):
        main(["--setting", "a", "--config", str(tmp_path / "missing.yaml"), "--cc-shards", "x", "--roi-parquets", "y",
              "--detector", "z", "--out", str(out)])


def test_visual_lr_scale_trains_the_tuned_visual_network_at_its_own_rate(world, tmp_path):
    """pretrain.visual_lr_scale: 0 leaves setting full's tuned stages at the detector's weights while the
    encoder trains; absent, they move (test_resume_matches_straight_run)."""
    from safetensors.torch import load_file

    _run(world, "full", tmp_path, cfg={"visual_lr_scale": 0.0})
    weights = load_file(str(tmp_path / "model.safetensors"))
    detector_state = torch.load(world["detector"], weights_only=False)["state_dict"]
    torch.testing.assert_close(weights["visual_network.body.layer2.0.conv1.weight"],
                               detector_state["backbone.layer2.0.conv1.weight"], rtol=0, atol=0)
    _run(world, "none", tmp_path / "none")  # the BERT-initialised model, untrained
    start = load_file(str(tmp_path / "none" / "model.safetensors"))
    encoder = [k for k in weights if k.startswith("encoder.") and k.endswith("weight") and weights[k].ndim == 2]
    assert encoder and not torch.equal(weights[encoder[0]], start[encoder[0]])


# ---- ViLBERT (the model comparison) -----------------------------------------------------------------------

VILBERT_SIZES = {"v_hidden_size": 24, "v_num_hidden_layers": 1, "v_num_attention_heads": 2, "v_intermediate_size": 32,
                 "bi_hidden_size": 20, "bi_num_attention_heads": 2, "t_biattention_id": [0], "v_biattention_id": [0]}


def test_vilbert_trains_its_two_objectives_on_the_same_batches(world, tokenizer):
    from vlbert_core.models.vilbert.config import build_vilbert_config
    from vlbert_core.models.vilbert.heads import ALIGNED_INDEX
    from vlbert_core.models.vilbert.model import ViLBertModel
    from vlbert_core.models.vilbert.pretraining import ViLBertForPretraining

    spec = get_setting("vilbert")
    detector, meta = load_detector(world["detector"])
    config = build_vilbert_config(dict(model_cfg(world), vilbert=VILBERT_SIZES), meta, tune_frcnn=False)
    assert config.appearance_dim == VLBertModel.from_bert(
        build_vlbert_config(model_cfg(world), meta, tune_frcnn=False), None).config.appearance_dim
    torch.manual_seed(0)
    module = ViLBertForPretraining(ViLBertModel.from_bert(config, detector.state_dict()), spec).train()
    cc, text = _streams(world, tokenizer, "c")   # VL-BERT's setting (c) makes the same batches
    batch = next(PretrainBatches([DataStream(cc, text, 4, 4)]))
    assert bool((batch.relationship_labels != IGNORE_INDEX).all())
    out = module(batch)
    assert {k for k in out if k.endswith("_loss")} == {"mlm_loss", "roi_loss", "rel_loss"}
    assert torch.isclose(out["loss"], out["mlm_loss"] + out["roi_loss"] + out["rel_loss"])
    out["loss"].backward()
    assert not [p for p in module.model.visual_network.parameters() if p.grad is not None]
    for head in (module.heads.mlm, module.heads.region, module.heads.alignment):
        assert any(p.grad is not None and bool(p.grad.abs().sum() > 0) for p in head.parameters())
    # the alignment loss is the cross-entropy towards ALIGNED_INDEX for matched pairs, the other index otherwise
    module.eval()
    with torch.no_grad():
        pooled = module.model.encode(batch.inputs).pooled
        logits = module.heads.alignment(pooled)
        target = torch.where(batch.relationship_labels == 1, ALIGNED_INDEX, 1 - ALIGNED_INDEX)
        torch.testing.assert_close(module(batch)["rel_loss"], F.cross_entropy(logits, target))
        # the region loss as the authors log it: KL(targets || prediction), the soft cross-entropy minus the
        # targets' entropy (kl_div over the selected regions, each target row normalised)
        out = module(batch)
        selected = batch.roi_selected & module.model.encode(batch.inputs).visual_mask
        region = module.heads.region(module.model.encode(batch.inputs).visual_states[selected]).float()
        targets = batch.roi_labels[selected] / batch.roi_labels[selected].sum(-1, keepdim=True)
        kl = F.kl_div(F.log_softmax(region, -1), targets, reduction="sum") / selected.sum()
        torch.testing.assert_close(out["roi_kl"], kl)
        assert float(out["roi_loss"] - out["roi_kl"]) > 0.1   # the targets' entropy
    with pytest.raises(ValueError, match="no <Text, ∅> input"):
        ViLBertForPretraining(module.model, get_setting("d"))


def test_vilbert_pretraining_writes_a_model_the_registry_loads(world, tmp_path):
    from vlbert_core.models.registry import from_pretrained
    from vlbert_core.models.vilbert.model import ViLBertModel

    cfg = dict(model_cfg(world), vilbert=VILBERT_SIZES)
    for setting in ("vilbert_none", "vilbert"):
        pretrain(setting, world["cc"], world["rois"], world["text"], world["detector"], cfg, pretrain_cfg(),
                 str(tmp_path / setting), seed=7, device="cpu")
        model = from_pretrained(tmp_path / setting)
        assert isinstance(model, ViLBertModel) and model.config.v_hidden_size == 24
        assert (tmp_path / setting / "heads.safetensors").is_file()
        clue = json.loads((tmp_path / setting / "visual_clue.json").read_text())
        assert clue["with_image"]["masked_tokens"] == clue["blank_image"]["masked_tokens"] > 0
    rows = [json.loads(line) for line in (tmp_path / "vilbert/metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3, 4]
    assert all({"mlm_loss", "roi_loss", "rel_loss"} <= set(r) for r in rows if "loss" in r)
    trained, untrained = from_pretrained(tmp_path / "vilbert"), from_pretrained(tmp_path / "vilbert_none")
    assert not torch.equal(trained.encoder.state_dict()[next(iter(trained.encoder.state_dict()))],
                           untrained.encoder.state_dict()[next(iter(untrained.encoder.state_dict()))])
