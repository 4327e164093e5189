"""The rehearsal's stand-ins of published weights: the layer cut of a manifest and the BERT-BASE directory."""

import json

import pytest
import torch

from vlbert_core.convert.manifest import Manifest, read_published
from vlbert_core.convert.stand_in import (BERT_BASE_UNCASED_CONFIG, bert_layer_of, keep_bert_layers, main,
                                          write_bert_stand_in)


def vl_bert_like_manifest(layers: int = 3) -> Manifest:
    tensors = {"module.vlbert.word_embeddings.weight": ((10, 8), "float32"),
               "module.image_feature_extractor.backbone.layer4.0.conv1.weight": ((4, 4, 1, 1), "float32")}
    for i in range(layers):
        tensors[f"module.vlbert.encoder.layer.{i}.attention.self.query.weight"] = ((8, 8), "float32")
        tensors[f"module.vlbert.encoder.layer.{i}.output.LayerNorm.bias"] = ((8,), "float32")
    return Manifest(file="vl-bert-base-e2e.model", format="torch", wrap=("state_dict",), tensors=tensors,
                    extra={"epoch": 9})


def test_bert_layer_of_reads_encoder_layers_only():
    assert bert_layer_of("module.vlbert.encoder.layer.11.output.dense.weight") == 11
    assert bert_layer_of("encoder.layer.0.attention.self.key.bias") == 0
    assert bert_layer_of("backbone.layer4.0.conv1.weight") is None  # a ResNet stage is not a BERT layer
    assert bert_layer_of("module.vlbert.word_embeddings.weight") is None


def test_keep_bert_layers_drops_the_deeper_layers_and_nothing_else(tmp_path):
    manifest = vl_bert_like_manifest(layers=3)
    cut = keep_bert_layers(manifest, 2)
    dropped = set(manifest.tensors) - set(cut.tensors)
    assert dropped == {"module.vlbert.encoder.layer.2.attention.self.query.weight",
                       "module.vlbert.encoder.layer.2.output.LayerNorm.bias"}
    assert all(cut.tensors[k] == manifest.tensors[k] for k in cut.tensors)
    assert (cut.file, cut.format, cut.wrap, cut.extra) == (manifest.file, manifest.format, manifest.wrap, manifest.extra)


@pytest.mark.parametrize("keep", [0, 4])
def test_keep_bert_layers_refuses_a_cut_outside_the_model(keep):
    with pytest.raises(ValueError, match=f"cannot keep {keep} of its 3 BERT layers"):
        keep_bert_layers(vl_bert_like_manifest(layers=3), keep)


def test_keep_bert_layers_refuses_a_manifest_without_bert_layers():
    manifest = Manifest(file="resnet101-pt-vgbua-0000.model", format="torch", wrap=(),
                        tensors={"layer4.0.conv1.weight": ((4, 4, 1, 1), "float32")})
    with pytest.raises(ValueError, match="resnet101-pt-vgbua-0000.model: no BERT encoder layers"):
        keep_bert_layers(manifest, 1)


def test_cli_writes_the_cut_stand_in_in_the_published_layout(tmp_path):
    manifest = vl_bert_like_manifest(layers=3)
    path = tmp_path / "manifest.json"
    path.write_text(json.dumps({"file": manifest.file, "format": manifest.format, "wrap": list(manifest.wrap),
                                "extra": manifest.extra,
                                "tensors": {k: {"shape": list(s), "dtype": d} for k, (s, d) in manifest.tensors.items()}}))
    out = tmp_path / "vl-bert-base-e2e.model"
    main(["manifest", str(path), str(out), "--bert-layers", "1", "--seed", "3"])
    assert torch.load(out, weights_only=True)["epoch"] == 9
    tensors = read_published(out, ("state_dict",))
    assert {bert_layer_of(k) for k in tensors} == {None, 0}
    assert tensors["module.vlbert.encoder.layer.0.attention.self.query.weight"].shape == (8, 8)


def test_bert_stand_in_is_a_bert_base_uncased_directory_our_loaders_read(tmp_path):
    from vlbert_core.models.common.bert_init import (load_bert_mlm_head_state, load_bert_state_dict, load_tokenizer,
                                                     read_bert_config)

    out = write_bert_stand_in(tmp_path / "bert-base-uncased", seed=0, bert_layers=1)
    config = read_bert_config(str(out))
    assert config == {**BERT_BASE_UNCASED_CONFIG, "num_hidden_layers": 1}
    state = load_bert_state_dict(str(out))
    assert state["embeddings.word_embeddings.weight"].shape == (30522, 768)
    assert state["encoder.layer.0.intermediate.dense.weight"].shape == (3072, 768)
    assert not any(k.startswith("encoder.layer.1.") for k in state)
    assert load_bert_mlm_head_state(str(out))["transform.dense.weight"].shape == (768, 768)
    tokenizer = load_tokenizer(str(out))
    assert tokenizer.tokenize("A Red Cube") == ["a", "red", "cube"]  # uncased WordPieces
    assert tokenizer.vocab_size == 30522
    assert not list(tmp_path.glob(".tmp-*")), "no temporary directory is left behind"


def test_published_aliases_are_written_equal(tmp_path):
    """A published VL-BERT file saves some tensors twice (stage 5 again as head.0, the MLM decoder tied to the
    word embeddings); the stand-in keeps each pair equal, as the converter checks."""
    from vlbert_core.convert.stand_in import write_published_stand_in

    tensors = {"module.vlbert.word_embeddings.weight": ((10, 8), "float32"),
               "module.vlbert.mlm_head.predictions.decoder.weight": ((10, 8), "float32"),
               "module.image_feature_extractor.roi_head_feature_extractor.0.conv1.weight": ((4, 4, 1, 1), "float32"),
               "module.image_feature_extractor.head.0.0.conv1.weight": ((4, 4, 1, 1), "float32")}
    manifest = Manifest(file="vl-bert-base-e2e.model", format="torch", wrap=("state_dict",), tensors=tensors)
    write_published_stand_in(manifest, tmp_path / "m.model", seed=1)
    written = read_published(tmp_path / "m.model", ("state_dict",))
    assert torch.equal(written["module.vlbert.mlm_head.predictions.decoder.weight"],
                       written["module.vlbert.word_embeddings.weight"])
    assert torch.equal(written["module.image_feature_extractor.head.0.0.conv1.weight"],
                       written["module.image_feature_extractor.roi_head_feature_extractor.0.conv1.weight"])


def test_detector_test_sizes_change_the_config_only(tmp_path):
    from vlbert_core.convert.stand_in import set_detector_test_sizes

    path = tmp_path / "detector.pt"
    state = {"rpn.head.conv.weight": torch.randn(4, 4, 3, 3)}
    torch.save({"config": {"min_size": 600, "max_size": 1000, "rpn_post_nms_test": 300, "backbone": {"depth": 101}},
                "categories": [], "num_classes": 1, "state_dict": state}, path)
    set_detector_test_sizes(path, {"min_size": 128, "max_size": 128, "rpn_post_nms_test": 12})
    checkpoint = torch.load(path, weights_only=True)
    assert checkpoint["config"] == {"min_size": 128, "max_size": 128, "rpn_post_nms_test": 12, "backbone": {"depth": 101}}
    assert torch.equal(checkpoint["state_dict"]["rpn.head.conv.weight"], state["rpn.head.conv.weight"])
    with pytest.raises(ValueError, match=r"\['anchor_sizes'\] are not test-time keys"):
        set_detector_test_sizes(path, {"anchor_sizes": [16]})
