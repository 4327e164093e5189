"""Sentinels on the pre-training path (issue 54): defects that would leave the paper's tables unchanged in a world
where pre-training changes nothing, each caught here, and each check proven able to fail.

- Fine-tuning starts from its setting's pre-trained weights: at fine-tuning step 0 (the state the first optimiser
  step sees) every encoder tensor -- embeddings, encoder layers, the visual network (its tuned and frozen parts)
  and the model's buffers -- equals, bit for bit, the tensor of the pre-trained `model.safetensors`, and the
  encoder holds no tensor the file lacks. The tiny pre-trained model is perturbed away from its BERT / random
  initialisation, so a fine-tuning job that skipped the load, or started from BERT, would show. The companion
  tests break the load (a no-op load, or the BERT-initialised model in its place) and see the check fail.
- Masked language modelling trains on masked inputs: on the library's own pre-training batches, every word that
  carries an MLM label is an ordinary text position whose input is [MASK] or an ordinary random token, except the
  ~10 % kept unchanged (the replaced share is bounded near 90 %, binomially), and no unlabelled word is [MASK].
- Masked RoI classification trains on masked RoIs: of the RoIs that carry a class target, the ~90 % flagged masked
  are masked in what the model sees -- with `masked_roi_input: pixels` every pixel of the box is zero in the image
  that enters the CNN (observed at the CNN's input), with `feature` the appearance entering the visual embedding
  is the learned masked-RoI vector -- and the whole-image box is never chosen. The companion tests make the
  masking leave the inputs as they are and see the checks fail.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import NUM_FG_CLASSES
from test_tasks import HPARAMS, MODEL_CFG, TINY_VISUAL, _scene, _vqa_files, _write_rois, BOXES, DETECTED

from vlbert_core.models.common.inputs import IGNORE_INDEX, TEXT
from vlbert_core.models.common.pretrained import MODEL_FILE
from vlbert_core.utils import load_safetensors

torch.set_num_threads(1)


# ---- 1. fine-tuning starts from the pre-trained weights ---------------------------------------------------------

def _tiny_config(bert_path: str):
    from vlbert_core.models.common.bert_init import read_bert_config
    from vlbert_core.models.common.config import bert_fields_from_hf_config
    from vlbert_core.models.vlbert.config import VLBertConfig

    return VLBertConfig(**bert_fields_from_hf_config(read_bert_config(bert_path), 1), **TINY_VISUAL, geometry_dim=16,
                        bert_path=bert_path)


def _fresh_model(bert_path: str):
    """What a job that skipped pre-training starts from: BERT, every other tensor newly initialised (seeded)."""
    from vlbert_core.models.vlbert.model import VLBertModel

    torch.manual_seed(0)
    return VLBertModel.from_bert(_tiny_config(bert_path), None)


def save_perturbed_pretrained(directory: Path, bert_path: str) -> None:
    """A tiny 'pre-trained' model: the BERT-initialised one with every floating tensor moved (parameters by noise,
    buffers by a positive factor and offset so variances stay positive), so it equals no fresh model."""
    model = _fresh_model(bert_path)
    generator = torch.Generator().manual_seed(54)
    with torch.no_grad():
        for tensor in model.parameters():
            tensor.add_(0.05 * torch.randn(tensor.shape, generator=generator))
        for tensor in model.buffers():
            if tensor.is_floating_point():
                tensor.mul_(1 + 0.1 * torch.rand(tensor.shape, generator=generator))
                tensor.add_(0.01 + 0.01 * torch.rand(tensor.shape, generator=generator))
    model.save_pretrained(directory)


def assert_encoder_is_pretrained(encoder_state: dict[str, torch.Tensor], pretrained_dir: Path) -> None:
    """Every tensor of the fine-tuning encoder equals, bit for bit, the pre-trained model.safetensors' tensor of that
    name, and the two hold the same tensors."""
    saved = load_safetensors(pretrained_dir / MODEL_FILE)
    assert set(encoder_state) == set(saved), (
        f"encoder tensors not in the pre-trained file: {sorted(set(encoder_state) - set(saved))[:5]}; "
        f"file tensors not in the encoder: {sorted(set(saved) - set(encoder_state))[:5]}")
    differ = [k for k, v in saved.items()
              if encoder_state[k].dtype != v.dtype or not torch.equal(encoder_state[k].cpu(), v)]
    assert not differ, f"{len(differ)} of {len(saved)} encoder tensors at fine-tuning step 0 are not the " \
                       f"pre-trained ones, e.g. {differ[:5]}"


class _StepZeroReached(Exception):
    pass


@pytest.fixture(scope="module")
def vqa_job(world, tmp_path_factory):
    """(root, sources) of a 3-question VQA training split with its RoIs, and a perturbed pre-trained dir."""
    root = tmp_path_factory.mktemp("sentinel_vqa")
    (root / "vqa").mkdir()
    qpath, apath, _, _ = _vqa_files(root / "vqa", "train")
    for image_id in (1, 2):
        _scene(root / "coco/train2014" / f"COCO_train2014_{image_id:012d}.jpg", BOXES, image_id)
    _write_rois(root / "rois/train.parquet", {f"COCO_train2014_{i:012d}": DETECTED for i in (1, 2)})
    sources = {"questions": str(root / "vqa/v2_OpenEnded_mscoco_{split}2014_questions.json"),
               "annotations": str(root / "vqa/v2_mscoco_{split}2014_annotations.json"),
               "images": str(root / "coco/{split}2014")}
    save_perturbed_pretrained(root / "pretrained", world["bert"])
    # the perturbation is real: no floating tensor of the file is the fresh model's
    fresh = _fresh_model(world["bert"]).state_dict()
    saved = load_safetensors(root / "pretrained" / MODEL_FILE)
    assert all(not torch.equal(fresh[k], v) for k, v in saved.items() if v.is_floating_point())
    return root, sources


def encoder_at_step_zero(vqa_job, monkeypatch, tmp_path, tune_frcnn: bool) -> dict[str, torch.Tensor]:
    """The encoder's state the first fine-tuning step starts from: finetune() runs as the workflow's job does, and
    its step function is wrapped to take the model's state when step 1 begins, then stop the job."""
    from vlbert_core.tasks import finetune as ft

    root, sources = vqa_job
    taken: dict = {}
    real_step_function = ft.finetuning_step

    def snapshotting_step_function(model, *args, **kwargs):
        real_step = real_step_function(model, *args, **kwargs)

        def step(n):
            taken.update({k: v.detach().clone() for k, v in model.encoder.state_dict().items()})
            raise _StepZeroReached

        return step

    monkeypatch.setattr(ft, "finetuning_step", snapshotting_step_function)
    with pytest.raises(_StepZeroReached):
        ft.finetune("vqa", root / "pretrained", tmp_path / "ft", setting="full", schedule="half", schedule_factor=1.0,
                    hparams=HPARAMS, tune_frcnn=tune_frcnn, model_cfg=MODEL_CFG, sources=sources,
                    rois_paths=[str(root / "rois/train.parquet")], seed=0)
    assert taken, "the fine-tuning job never reached its first step"
    return taken


@pytest.mark.parametrize("tune_frcnn", [False, True], ids=["frozen_visual", "tuned_visual"])
def test_finetuning_starts_from_the_pretrained_weights(vqa_job, monkeypatch, tmp_path, tune_frcnn):
    assert_encoder_is_pretrained(encoder_at_step_zero(vqa_job, monkeypatch, tmp_path, tune_frcnn),
                                 vqa_job[0] / "pretrained")


def _skip_the_load(monkeypatch, world):
    """The defect: load_encoder's load of the pre-trained state is a no-op (the encoder keeps its own init)."""
    from vlbert_core.models.vlbert.model import VLBertModel

    real_load = torch.nn.Module.load_state_dict

    def load(self, state, strict=True, assign=False):
        if assign:   # from_pretrained's read of the file (load_state_exactly) still works
            return real_load(self, state, strict=strict, assign=assign)
        return torch.nn.modules.module._IncompatibleKeys([], [])

    monkeypatch.setattr(VLBertModel, "load_state_dict", load)


def _start_from_bert(monkeypatch, world):
    """The defect: the job starts from the BERT-initialised model (setting `none`'s) instead of the pre-trained one."""
    from vlbert_core.tasks import finetune as ft

    monkeypatch.setattr(ft, "from_pretrained", lambda directory: _fresh_model(world["bert"]))


@pytest.mark.parametrize("defect", [_skip_the_load, _start_from_bert], ids=["load_skipped", "bert_instead"])
def test_the_pretrained_weights_sentinel_fails_when_the_load_is_broken(vqa_job, world, monkeypatch, tmp_path, defect):
    defect(monkeypatch, world)
    state = encoder_at_step_zero(vqa_job, monkeypatch, tmp_path, tune_frcnn=True)
    with pytest.raises(AssertionError, match="are not the pre-trained ones"):
        assert_encoder_is_pretrained(state, vqa_job[0] / "pretrained")


# ---- 2. the masked objectives train on masked inputs ------------------------------------------------------------

CC_SAMPLES = 480     # ~1,000 labelled words with the text samples, ~200 RoIs with a class target
BATCH = 16


def _batches(world, setting: str, steps: int):
    from vlbert_core.models.common.bert_init import load_tokenizer
    from vlbert_core.pretrain import get_setting
    from vlbert_core.pretrain.data import (CaptionImageStream, DataStream, PretrainBatches, StreamConfig,
                                           TextStream, pair_shards_with_rois)
    from vlbert_core.pretrain.masking import MaskingVocab

    tokenizer = load_tokenizer(world["bert"])
    cfg = StreamConfig(max_caption_len=12, max_text_len=16, max_rois=4, image_max_side=48, seed=0)
    vocab = MaskingVocab.from_tokenizer(tokenizer)
    spec = get_setting(setting)
    cc = CaptionImageStream(pair_shards_with_rois(world["cc"], world["rois"]), tokenizer, vocab, cfg, spec,
                            NUM_FG_CLASSES + 1)
    text = TextStream(world["text"], tokenizer, vocab, cfg) if spec.text_corpus else None
    batches = PretrainBatches([DataStream(cc, text, BATCH // 2, BATCH // 2)])
    return tokenizer, vocab, [next(batches) for _ in range(steps)]


def _share_bound(p: float, n: int) -> float:
    """A loose bound on |observed share - p| over n draws (5 binomial standard deviations, words of several pieces
    counted once per piece)."""
    return 5 * math.sqrt(p * (1 - p) / n) + 0.01


def assert_mlm_trains_on_masked_words(batches, tokenizer, vocab) -> None:
    ordinary = set(vocab.random_ids.tolist())
    mask_id = vocab.mask_id
    labelled = replaced = as_mask = 0
    for batch in batches:
        ids, labels, inputs = batch.inputs.input_ids, batch.mlm_labels, batch.inputs
        has_label = labels != IGNORE_INDEX
        # targets sit on real text positions only
        assert bool((inputs.element_kind[has_label] == TEXT).all() and inputs.attention_mask[has_label].all())
        assert not bool((ids[~has_label & inputs.attention_mask] == mask_id).any()), "[MASK] without an MLM target"
        got, want = ids[has_label], labels[has_label]
        changed = got != want
        assert all(int(t) == mask_id or int(t) in ordinary for t in got[changed]), \
            "a replaced word's input is neither [MASK] nor an ordinary token"
        labelled += int(has_label.sum())
        replaced += int(changed.sum())
        as_mask += int((got == mask_id).sum())
    assert labelled >= 500, f"only {labelled} labelled words: too few to bound the shares"
    share = replaced / labelled
    assert share >= 0.9 - _share_bound(0.9, labelled), (
        f"of {labelled} words with an MLM target only {replaced} ({share:.1%}) have their input replaced; "
        f"{labelled - replaced} ({1 - share:.1%}) show the very word they are to predict (expected ~10 %)")
    assert share <= 0.9 + _share_bound(0.9, labelled)
    assert abs(as_mask / labelled - 0.8) <= _share_bound(0.8, labelled), f"[MASK] share {as_mask / labelled:.1%}"


def _pretraining_module(world, masked_roi_input: str):
    from vlbert_core.detector import load_detector
    from vlbert_core.models.vlbert.config import build_vlbert_config
    from vlbert_core.models.vlbert.model import VLBertModel
    from vlbert_core.models.vlbert.pretraining import VLBertForPretraining
    from vlbert_core.pretrain import get_setting

    detector, meta = load_detector(world["detector"])
    config = build_vlbert_config({"bert_path": world["bert"], "num_hidden_layers": 1, "geometry_dim": 16,
                                  "max_rois": 4, "image_max_side": 48, "frozen_stages": 2, "freeze_bn": True,
                                  "masked_roi_input": masked_roi_input},
                                 meta, tune_frcnn=False)
    torch.manual_seed(0)
    module = VLBertForPretraining(VLBertModel.from_bert(config, detector.state_dict()), get_setting("d")).eval()
    if module.model.embeddings.visual_feature.masked_appearance is not None:
        with torch.no_grad():   # a value no real feature takes, to recognise it downstream
            module.model.embeddings.visual_feature.masked_appearance.fill_(7.25)
    return module


def assert_masked_rois_are_masked(batches, module) -> None:
    """Runs the pre-training forward on each batch and looks at what the model sees of every RoI with a target."""
    model = module.model
    feature_input = model.config.masked_roi_input == "feature"
    seen: dict = {}
    hooks = [model.visual_network.body.register_forward_pre_hook(
                 lambda m, args: seen.__setitem__("cnn_images", args[0].detach().clone())),
             model.embeddings.visual_feature.linear.register_forward_pre_hook(
                 lambda m, args: seen.__setitem__("appearance", args[0][..., model.config.geometry_dim:].detach()))]
    selected_total = masked_total = 0
    try:
        for batch in batches:
            seen.clear()
            with torch.no_grad():
                module(batch)
            inputs = batch.inputs
            selected = batch.roi_selected & inputs.box_valid
            assert not bool(batch.roi_selected[:, 0].any()) and not bool(inputs.roi_masked[:, 0].any()), \
                "the whole-image box was chosen for masking"
            assert not bool((inputs.roi_masked & ~batch.roi_selected).any()), "a RoI masked without a target"
            image_rows = inputs.has_image.nonzero(as_tuple=True)[0]
            images = seen["cnn_images"]   # the CNN runs on the rows with an image, in order
            assert images.shape[0] == len(image_rows)
            for j, i in enumerate(image_rows.tolist()):
                for r in selected[i].nonzero(as_tuple=True)[0].tolist():
                    selected_total += 1
                    if feature_input:
                        hidden = bool((seen["appearance"][i, r] == 7.25).all())
                    else:
                        x1, y1, x2, y2 = (int(v) for v in inputs.boxes[i, r].floor().tolist())
                        hidden = bool((images[j, :, y1:y2 + 1, x1:x2 + 1] == 0).all())
                    masked_total += hidden
                    if bool(inputs.roi_masked[i, r]):
                        assert hidden, f"RoI {r} of row {i} is flagged masked but the model sees it"
    finally:
        for hook in hooks:
            hook.remove()
    assert selected_total >= 100, f"only {selected_total} RoIs with a target: too few to bound the share"
    share = masked_total / selected_total
    assert abs(share - 0.9) <= _share_bound(0.9, selected_total), (
        f"of {selected_total} RoIs with a class target {masked_total} ({share:.1%}) are masked in what the model "
        "sees (expected ~90 %)")


@pytest.fixture(scope="module")
def masked_batches(world):
    return _batches(world, "d", CC_SAMPLES // (BATCH // 2))


def test_mlm_targets_sit_on_masked_words(masked_batches):
    tokenizer, vocab, batches = masked_batches
    assert_mlm_trains_on_masked_words(batches, tokenizer, vocab)


def test_the_mlm_sentinel_fails_when_words_are_left_unmasked(world, monkeypatch):
    from vlbert_core.pretrain import data

    real_mask = data.whole_word_mask

    def labels_only(input_ids, tokens, rng, vocab, *args, **kwargs):   # the labels, but the words left as they are
        _, labels = real_mask(input_ids, tokens, rng, vocab, *args, **kwargs)
        return list(input_ids), labels

    monkeypatch.setattr(data, "whole_word_mask", labels_only)
    tokenizer, vocab, batches = _batches(world, "d", CC_SAMPLES // (BATCH // 2))
    with pytest.raises(AssertionError, match="show the very word they are to predict"):
        assert_mlm_trains_on_masked_words(batches, tokenizer, vocab)


@pytest.mark.parametrize("masked_roi_input", ["pixels", "feature"])
def test_roi_targets_sit_on_masked_rois(world, masked_batches, masked_roi_input):
    assert_masked_rois_are_masked(masked_batches[2], _pretraining_module(world, masked_roi_input))


def test_the_roi_sentinel_fails_when_pixels_are_left_unmasked(world, masked_batches, monkeypatch):
    from vlbert_core.models.common import visual

    monkeypatch.setattr(visual, "mask_roi_pixels", lambda images, boxes, roi_masked: images)
    with pytest.raises(AssertionError, match="is flagged masked but the model sees it"):
        assert_masked_rois_are_masked(masked_batches[2], _pretraining_module(world, "pixels"))


def test_the_roi_sentinel_fails_when_no_roi_is_masked(world, monkeypatch):
    from vlbert_core.pretrain import data

    real_mask_rois = data.mask_rois

    def select_only(num_rois, rng, *args, **kwargs):   # the targets, but no RoI masked
        selected, masked = real_mask_rois(num_rois, rng, *args, **kwargs)
        return selected, np.zeros_like(masked)

    monkeypatch.setattr(data, "mask_rois", select_only)
    _, _, batches = _batches(world, "d", CC_SAMPLES // (BATCH // 2))
    for masked_roi_input in ("pixels", "feature"):
        with pytest.raises(AssertionError, match="are masked in what the model sees"):
            assert_masked_rois_are_masked(batches, _pretraining_module(world, masked_roi_input))
