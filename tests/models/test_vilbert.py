"""ViLBERT, the second model family: its config, its forward on VL-BERT's batches, initialisation from a local
BERT, saving and loading through the registry, the pre-training heads and the converter's key accounting.
(That the converted model computes what the authors' code computes: tests/convert/test_golden_vilbert.py.)"""

from __future__ import annotations

import json

import pytest
import torch

from vlbert_core.convert.accounting import ConversionError
from vlbert_core.models import registry
from vlbert_core.convert.vilbert.checkpoint import (RELEASED_CONFIG, TIED_DECODER, convert_vilbert_state,
                                                    released_key_shapes, stand_in_state, write_stand_in)
from vlbert_core.convert.vilbert.reference import SMALL_CONFIG, write_detector_stand_in
from vlbert_core.models.common.batch import collate_samples
from vlbert_core.models.common.heads import save_pretraining_heads
from vlbert_core.models.common.inputs import TEXT, build_input_sequence
from vlbert_core.models.common.output import EncoderOutput
from vlbert_core.models.vilbert.config import ViLBertConfig
from vlbert_core.models.vilbert.heads import ALIGNED_INDEX, ViLBertPretrainingHeads, load_vilbert_pretraining_heads
from vlbert_core.models.vilbert.model import ViLBertModel

torch.set_num_threads(1)
TINY_BACKBONE = {"stage_widths": [4, 4, 4, 8], "blocks_per_stage": [1, 1, 1, 1], "block": "basic"}
CLS, SEP, PAD = 1, 2, 0
BERT = dict(vocab_size=50, hidden_size=16, num_hidden_layers=3, num_attention_heads=2, intermediate_size=32,
            hidden_act="gelu", hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1, max_position_embeddings=32,
            layer_norm_eps=1e-12)
TWO_STREAM = dict(v_hidden_size=12, v_num_hidden_layers=2, v_num_attention_heads=2, v_intermediate_size=20,
                  bi_hidden_size=8, bi_num_attention_heads=2, v_biattention_id=[0, 1], t_biattention_id=[1, 2])


def tiny_config(**overrides) -> ViLBertConfig:
    return ViLBertConfig(**{**BERT, **TWO_STREAM, "visual_backbone": TINY_BACKBONE, "appearance_dim": 8,
                            "num_object_classes": 5, **overrides})


def tiny_model(seed: int = 0, **overrides) -> ViLBertModel:
    torch.manual_seed(seed)
    return ViLBertModel(tiny_config(**overrides)).eval()


def sample(ids_a, boxes, image, roi_masked=None, ids_b=None) -> dict:
    seq = build_input_sequence(ids_a, ids_b, None if image is None else len(boxes), cls_id=CLS, sep_id=SEP,
                               pad_id=PAD)
    out = {"sequence": seq}
    if image is not None:
        out.update(image=image, boxes=torch.as_tensor(boxes, dtype=torch.float32))
    if roi_masked is not None:
        out["roi_masked"] = torch.as_tensor(roi_masked)
    return out


def two_rows(roi_masked=None):
    """Two image rows with different numbers of words (one with a sentence B) and of boxes."""
    g = torch.Generator().manual_seed(0)
    image_a, image_b = torch.randn(3, 40, 56, generator=g), torch.randn(3, 32, 48, generator=g)
    return collate_samples([
        sample([5, 6, 7, 8], [[0, 0, 55, 39], [2, 3, 30, 20], [20, 10, 50, 38], [5, 5, 15, 30]], image_a, roi_masked),
        sample([9, 10], [[0, 0, 47, 31], [4, 4, 40, 28]], image_b, ids_b=[11, 12, 13]),
    ])


@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory):
    """A local BERT checkpoint directory of BERT's sizes above (transformers' own save_pretrained)."""
    from transformers import BertConfig, BertModel

    torch.manual_seed(1)
    directory = tmp_path_factory.mktemp("bert")
    BertModel(BertConfig(**{k: v for k, v in BERT.items() if k != "layer_norm_eps"}, layer_norm_eps=1e-12,
                         type_vocab_size=2)).save_pretrained(directory)
    return str(directory)


# ---- config ------------------------------------------------------------------------------------------------------

def test_config_round_trips_and_rejects_what_the_authors_code_cannot_run():
    config = tiny_config()
    assert ViLBertConfig.from_dict({"model_type": "vilbert", **config.to_dict()}) == config
    with pytest.raises(ValueError, match="not a ViLBERT one"):
        ViLBertConfig.from_dict({"model_type": "vlbert", **config.to_dict()})
    with pytest.raises(ValueError, match="unknown keys"):
        ViLBertConfig.from_dict({**config.to_dict(), "v_feature_size": 8})
    with pytest.raises(ValueError, match="one length"):
        tiny_config(t_biattention_id=[2])
    with pytest.raises(ValueError, match="non-decreasing layer indices below num_hidden_layers"):
        tiny_config(t_biattention_id=[2, 1])
    with pytest.raises(ValueError, match="below v_num_hidden_layers"):
        tiny_config(v_biattention_id=[0, 2])
    with pytest.raises(ValueError, match="bi_hidden_size 8 is not a multiple of bi_num_attention_heads 3"):
        tiny_config(bi_num_attention_heads=3)
    with pytest.raises(ValueError, match="fusion_method"):
        tiny_config(fusion_method="concat")


# ---- the forward on VL-BERT's batches ------------------------------------------------------------------------

def test_encode_reads_vlbert_batches_into_two_streams():
    model, batch = tiny_model(), two_rows()
    with torch.no_grad():
        out = model.encode(batch)
    assert type(out) is EncoderOutput
    batch_size, length = batch.input_ids.shape
    num_boxes = batch.boxes.shape[1]
    assert out.text_states.shape == (batch_size, length, 16) and out.visual_states.shape == (batch_size, num_boxes, 12)
    assert out.pooled.shape == (batch_size, 8) and out.roi_features.shape == (batch_size, num_boxes, 8)
    assert torch.equal(out.text_mask, (batch.element_kind == TEXT) & batch.attention_mask)
    assert torch.equal(out.visual_mask, batch.box_valid)
    # zeros where there is no word / no box; states elsewhere
    assert bool((out.text_states[~out.text_mask] == 0).all()) and bool((out.text_states[out.text_mask] != 0).any())
    assert bool((out.visual_states[~batch.box_valid] == 0).all())
    assert bool((out.visual_states[batch.box_valid].abs().sum(-1) > 0).all())
    spec = model.head_spec()
    assert (spec.text_width, spec.visual_width, spec.pooled_width, spec.answer_readout, spec.layout) == \
        (16, 12, 8, "pooled", "project")


def test_each_row_computes_what_it_computes_alone():
    """Padding words and box slots are masked in every layer: a row's outputs do not depend on its batch."""
    model, batch = tiny_model(), two_rows()
    with torch.no_grad():
        together = model.encode(batch)
        for row in range(batch.batch_size):
            alone = model.encode(batch.select_rows(torch.tensor([row])))
            length, boxes = alone.text_states.shape[1], alone.visual_states.shape[1]
            torch.testing.assert_close(together.text_states[row, :length], alone.text_states[0], atol=1e-5, rtol=0)
            torch.testing.assert_close(together.visual_states[row, :boxes], alone.visual_states[0], atol=1e-5, rtol=0)
            torch.testing.assert_close(together.pooled[row], alone.pooled[0], atol=1e-5, rtol=0)


def test_text_only_rows_are_refused():
    g = torch.Generator().manual_seed(0)
    batch = collate_samples([sample([5, 6], [[0, 0, 31, 23]], torch.randn(3, 24, 32, generator=g)),
                             sample([7, 8, 9], None, None)])
    with pytest.raises(ValueError, match=r"ViLBERT has no text-only input.*rows \[1\]"):
        tiny_model().encode(batch)


def test_a_masked_roi_has_its_feature_zeroed_and_its_pixels_kept():
    model = tiny_model()
    masked, plain = two_rows(roi_masked=[False, False, True, False]), two_rows()
    with torch.no_grad():
        features = model.visual_features(plain)
        # the visual network sees the whole image: masking changes no RoI feature ...
        torch.testing.assert_close(model.visual_features(masked), features, atol=0, rtol=0)
        zeroed = features.clone()
        zeroed[0, 2] = 0.0
        # ... the masked region enters the visual stream with a zero feature (its location kept)
        torch.testing.assert_close(model.encode(masked, roi_features=features).visual_states,
                                   model.encode(plain, roi_features=zeroed).visual_states, atol=1e-6, rtol=0)
        assert not torch.allclose(model.encode(plain, roi_features=features).visual_states,
                                  model.encode(plain, roi_features=zeroed).visual_states, atol=1e-4)
    with pytest.raises(ValueError, match="box 0"):
        model.encode(two_rows(roi_masked=[True, False, False, False]), roi_features=features)


def test_the_released_global_region_is_the_mean_of_the_detections_at_the_whole_image_location():
    """global_region mean_of_regions (a converted released model): region 0 is what the authors'
    _image_features_reader prepends, g_feat = np.sum(features, 0) / num_boxes over the real detections, at
    g_location (0, 0, 1, 1, 1); encode on the pipeline's batch equals forward_streams on those explicit inputs,
    which tests/convert/test_golden_vilbert.py checks against the authors' forward."""
    import numpy as np

    from vlbert_core.models.vilbert.embeddings import region_locations
    from vlbert_core.models.vilbert.model import text_stream

    model, batch = tiny_model(global_region="mean_of_regions"), two_rows()
    whole_image = tiny_model()   # the same weights (seed 0), the project's own region 0
    with torch.no_grad():
        features = model.visual_features(batch)
        locations = region_locations(batch.boxes, batch.image_size)
        authors_features, authors_locations = features.clone(), locations.clone()
        for row in range(batch.batch_size):
            detections = features[row, 1:][batch.box_valid[row, 1:]].numpy()
            authors_features[row, 0] = torch.from_numpy(np.sum(detections, axis=0) / detections.shape[0])
            authors_locations[row, 0] = torch.tensor([0.0, 0.0, 1.0, 1.0, 1.0])
        input_ids, token_types, text_mask = text_stream(batch, model.config.type_vocab_size)
        expected = model.forward_streams(input_ids, token_types, text_mask, authors_features, authors_locations,
                                         batch.box_valid)
        out = model.encode(batch, roi_features=features)
        torch.testing.assert_close(out.pooled, expected.pooled, atol=1e-6, rtol=0)
        valid = batch.box_valid
        torch.testing.assert_close(out.visual_states[valid], expected.visual_states[valid], atol=1e-6, rtol=0)
        # the project's default reads the whole-image box's own feature and location instead
        assert not torch.allclose(whole_image.encode(batch, roi_features=features).pooled, out.pooled, atol=1e-4)
    with pytest.raises(ValueError, match="global_region must be one of"):
        tiny_config(global_region="first_box")


def test_precomputed_features_may_not_bypass_a_tuned_visual_network():
    model, batch = tiny_model(tune_frcnn=True), two_rows()
    features = model.visual_features(batch).detach()
    with pytest.raises(ValueError, match="bypass the tuned visual network"):
        model.encode(batch, roi_features=features)
    with torch.no_grad():
        model.encode(batch, roi_features=features)


def test_rows_sharing_an_image_run_the_visual_network_once_per_image():
    model, batch = tiny_model(), two_rows()
    pairs = batch.select_rows(torch.tensor([0, 0, 1, 1]))
    with torch.no_grad():
        torch.testing.assert_close(model.visual_features(pairs, rows_per_image=2), model.visual_features(pairs))


# ---- initialisation, saving, loading ------------------------------------------------------------------------

def test_from_bert_takes_the_text_stream_from_bert_and_starts_the_rest_new(tiny_bert):
    from transformers import BertModel

    bert = BertModel.from_pretrained(tiny_bert).eval()
    model = ViLBertModel.from_bert(tiny_config(bert_path=tiny_bert), None).eval()
    ids, types = torch.tensor([[CLS, 5, 6, SEP, 7, SEP]]), torch.tensor([[0, 0, 0, 0, 1, 1]])
    with torch.no_grad():
        torch.testing.assert_close(model.embeddings(ids, types), bert.embeddings(input_ids=ids, token_type_ids=types))
        torch.testing.assert_close(model.encoder.text_layers[2].output.weight,
                                   bert.encoder.layer[2].output.dense.weight)
    new = model.encoder.coattention_layers[0].attention.text_query.weight.detach()
    assert 0.01 < float(new.std()) < 0.03 and float(model.text_pooler.dense.bias.detach().abs().max()) == 0.0
    with pytest.raises(ValueError, match="hidden_size=24 but the BERT checkpoint"):
        ViLBertModel.from_bert(tiny_config(bert_path=tiny_bert, hidden_size=24), None)


def test_save_pretrained_round_trips_through_the_registry(tmp_path):
    model, batch = tiny_model(), two_rows()
    model.save_pretrained(tmp_path / "m")
    assert json.loads((tmp_path / "m" / "config.json").read_text())["model_type"] == "vilbert"
    loaded = registry.from_pretrained(tmp_path / "m").eval()
    assert type(loaded) is ViLBertModel and loaded.config == model.config
    with torch.no_grad():
        torch.testing.assert_close(loaded.encode(batch).pooled, model.encode(batch).pooled, atol=0, rtol=0)
    assert type(registry.build_model("vilbert", model.config.to_dict())) is ViLBertModel


def test_pretraining_heads_tie_the_decoder_and_round_trip(tmp_path):
    model = tiny_model()
    heads = ViLBertPretrainingHeads(model.config, model.word_embeddings()).eval()
    assert ALIGNED_INDEX == 0
    assert not any(p is model.word_embeddings().weight for p in heads.parameters())   # owned by the model once
    hidden = torch.randn(3, 16)
    with torch.no_grad():
        before = heads.mlm(hidden)
        model.word_embeddings().weight[:, 0] += 1.0
        assert not torch.allclose(before, heads.mlm(hidden))
    assert heads.region(torch.randn(4, 12)).shape == (4, 5) and heads.alignment(torch.randn(2, 8)).shape == (2, 2)
    save_pretraining_heads(heads, tmp_path)
    again = ViLBertPretrainingHeads(model.config, model.word_embeddings())
    load_vilbert_pretraining_heads(again, tmp_path)
    for (name, a), b in zip(heads.state_dict().items(), again.state_dict().values()):
        assert torch.equal(a, b), name


# ---- the converter ------------------------------------------------------------------------------------------------

# a visual network of the small config's 16-d features
SMALL_BACKBONE = {"stage_widths": [4, 4, 4, 16], "blocks_per_stage": [1, 1, 1, 1], "block": "basic"}


def _convert(source, authors_config=SMALL_CONFIG):
    return convert_vilbert_state(source, source_name="stand-in", visual_backbone=SMALL_BACKBONE,
                                 authors_config=authors_config)


def test_every_released_tensor_is_mapped_or_dropped_for_a_reason():
    source = stand_in_state(SMALL_CONFIG, seed=0)
    converted = _convert(source)
    report = converted.report
    assert set(report.mapped) | set(report.dropped) == set(source) and not set(report.mapped) & set(report.dropped)
    assert report.dropped[TIED_DECODER[0]].startswith("the MLM decoder is tied")
    assert all("never uses them" in why for key, why in report.dropped.items() if ".q_dense" in key)
    assert len(report.dropped) == 1 + 4 * 2   # the tied decoder, q_dense1/2 weight and bias of 2 layers
    assert all(key.startswith("visual_network.") for key in report.filled)
    assert converted.config.appearance_dim == 16 and converted.config.num_object_classes == 7
    assert converted.config.global_region == "mean_of_regions"   # what the released models were trained on
    heads = ViLBertPretrainingHeads(converted.config, torch.nn.Embedding(64, 32))
    assert set(converted.heads) == set(heads.state_dict())


def test_a_missing_or_unknown_key_is_an_error_naming_it():
    source = stand_in_state(SMALL_CONFIG, seed=0)
    missing = {k: v for k, v in source.items() if k != "bert.encoder.c_layer.1.biattention.key2.weight"}
    with pytest.raises(ConversionError, match=r"missing from the source.*coattention_layers\.1\.attention\.text_key"):
        _convert(missing)
    with pytest.raises(ConversionError, match=r"no rule knows: 'bert\.encoder\.c_layer\.0\.extra\.weight'"):
        _convert({**source, "bert.encoder.c_layer.0.extra.weight": torch.zeros(2)})
    untied = dict(source)
    untied[TIED_DECODER[0]] = source[TIED_DECODER[1]] + 1.0
    with pytest.raises(ConversionError, match="differs from"):
        _convert(untied)
    with pytest.raises(ConversionError, match="config says hidden_size=64, the checkpoint's tensors hidden_size=32"):
        _convert(source, authors_config={**SMALL_CONFIG, "hidden_size": 64})
    with pytest.raises(ConversionError, match="dynamic_attention"):
        _convert(source, authors_config={**SMALL_CONFIG, "dynamic_attention": True})


def test_the_released_layout_has_the_authors_sizes():
    shapes = released_key_shapes(RELEASED_CONFIG)
    assert len(shapes) == 533
    assert shapes["bert.encoder.c_layer.5.biattention.query2.weight"] == (1024, 768)
    assert shapes["cls.imagePredictions.decoder.weight"] == (1601, 1024)
    assert shapes["bert.v_embeddings.image_embeddings.weight"] == (1024, 2048)


def test_convert_command_writes_a_model_directory_the_registry_loads(tmp_path):
    from vlbert_core.convert.__main__ import main as convert_main

    write_stand_in(tmp_path / "pretrained_model.bin", SMALL_CONFIG, seed=0)
    (tmp_path / "config.json").write_text(json.dumps(SMALL_CONFIG))
    write_detector_stand_in(tmp_path / "detector.pt", 16, 7)
    bert_dir = tmp_path / "bert"
    bert_dir.mkdir()
    (bert_dir / "config.json").write_text(json.dumps({"model_type": "bert", "vocab_size": 64}))
    def command(out: str, detector: str) -> list[str]:
        return ["vilbert", str(tmp_path / "pretrained_model.bin"), str(tmp_path / out), "--bert-path", str(bert_dir),
                "--detector", str(tmp_path / detector), "--config", str(tmp_path / "config.json")]

    assert convert_main(command("out", "detector.pt")) == 0
    model = registry.from_pretrained(tmp_path / "out")
    assert type(model) is ViLBertModel and model.config.bert_path == str(bert_dir)
    report = json.loads((tmp_path / "out" / "conversion_report.json").read_text())
    assert report["num_mapped"] + report["num_dropped"] == len(released_key_shapes(SMALL_CONFIG))
    write_detector_stand_in(tmp_path / "wide.pt", 32, 7)
    with pytest.raises(ConversionError, match="RoI features of 32 dimensions"):
        convert_main(command("out2", "wide.pt"))
    assert not (tmp_path / "out2").exists()
