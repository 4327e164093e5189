"""The places where a converted released VL-BERT used to compute something else than the authors' code
(issue: "The authors' released VL-BERT, computed exactly"), each checked against the authors' own numbers, worked
out by hand from their code (jackroos/VL-BERT at 4373674). tests/convert/test_golden_released.py checks the whole models.

1. geometry divided by the image size (im_info), box 0 = [0, 0, W0 - 1, H0 - 1] scaled and clamped;
2. a text-only row: word pieces then [END] at position id T + 1 (tests/models/test_released_architecture.py);
3. prec: a masked RoI's feature replaced by object_mask_visual_embedding;
4. the released image size: shorter side 600, longer at most 1000;
5. the pre-training heads kept by the converter and continued from (tests/pretrain/test_pretrain.py);
6. docs/real-data.md: converting a prec checkpoint needs the visual weights;
7. the fp16 checkpoints are fp16 throughout.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from test_convert_vlbert import MINILM, cut_down, load, write_released
from test_released_architecture import model_with, tiny_config

from vlbert_core.convert.__main__ import main as convert_main
from vlbert_core.convert.manifest import MANIFEST_DIR
from vlbert_core.models.common.batch import collate_samples, fitted_size
from vlbert_core.models.common.heads import HEADS_FILE, read_pretraining_heads
from vlbert_core.models.common.inputs import boxes_with_whole_image, build_input_sequence
from vlbert_core.models.vlbert.embeddings import VisualFeatureEmbedding
from vlbert_core.models.vlbert.heads import HEAD_NAMES
from vlbert_core.models.vlbert.model import VLBertModel

REPO = Path(__file__).resolve().parents[2]
MANIFESTS = MANIFEST_DIR


# ---- 1. geometry ---------------------------------------------------------------------------------------------

def test_box_zero_is_the_released_whole_image_box():
    """conceptual_captions.py: [0, 0, w0 - 1, h0 - 1], scaled by Resize's ratios (857 / 400, 600 / 280), then
    clamped to [0, w - 1] x [0, h - 1]."""
    out = boxes_with_whole_image(np.zeros((0, 4)), (857, 600), (400, 280), max_rois=5)
    np.testing.assert_allclose(out[0], [0.0, 0.0, 399 * 857 / 400, 279 * 600 / 280], rtol=1e-6)   # 854.86, 597.86
    np.testing.assert_allclose(boxes_with_whole_image(np.zeros((0, 4)), (1000, 500), (2000, 1000), 5)[0],
                               [0.0, 0.0, 999.0, 499.0])                                       # 999.5 -> 999


def test_geometry_is_divided_by_the_image_size_not_by_box_zero():
    """common/utils/bbox.py coordinate_embeddings([x1, y1, x2, y2, w, h], 256) with w, h = im_info[:2]: box
    [10, 20, 50, 60] in a 100 x 80 image is (centre 30, 50; size 40, 50) in percent; its first sin is sin(30)."""
    config = tiny_config(geometry_dim=16, hidden_size=16, num_attention_heads=2, geometry_encoding="centre_size")
    feature = VisualFeatureEmbedding(config).eval()
    with torch.no_grad():
        feature.linear.weight.zero_()
        feature.linear.weight[:, :16] = torch.eye(16)     # the output is relu(geometry)
        feature.linear.bias.zero_()
    boxes = torch.tensor([[[0.0, 0.0, 99.0, 79.0], [10.0, 20.0, 50.0, 60.0]]])
    got = feature(boxes, torch.zeros(1, 2, 8), torch.tensor([[100.0, 80.0]]))[0, 1]
    pos = torch.tensor([30.0, 50.0, 40.0, 50.0])
    wavelengths = 1000.0 ** (torch.arange(2) / 2)          # dim 16: 4 coordinates x (sin, cos) x 2
    angles = pos[:, None] / wavelengths
    expected = torch.relu(torch.cat([angles.sin(), angles.cos()], dim=-1).flatten())
    assert got[0].item() == pytest.approx(max(0.0, math.sin(30.0)), abs=1e-6)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    # box 0's corner (99, 79) is not the image size: normalising by it (the old way) gives other numbers
    old = feature(boxes, torch.zeros(1, 2, 8), torch.tensor([[99.0, 79.0]]))[0, 1]
    assert not torch.allclose(old, expected, atol=1e-3)


def test_a_word_takes_the_visual_feature_of_the_box_it_refers_to():
    """vcr ResNetVLBERT: text_visual_embeddings = obj_reps[text_tags], through visual_ln_text; tag 0 (box 0,
    the whole image) for plain words."""
    model = model_with()
    seq = build_input_sequence([5, 6, 7], None, 3, cls_id=1, sep_id=2, pad_id=0)
    seq.roi_index[2] = 2                                   # word 6 refers to box 2
    boxes = torch.tensor([[0.0, 0.0, 31.0, 31.0], [2.0, 3.0, 12.0, 20.0], [15.0, 4.0, 30.0, 29.0]])
    batch = collate_samples([{"sequence": seq, "image": torch.zeros(3, 32, 32), "boxes": boxes}])
    features = torch.randn(1, 3, 8)
    emb = model.embeddings
    with torch.no_grad():
        per_box = emb.visual_feature(batch.boxes, features, batch.image_size)
        visual = emb.visual_norm_text(per_box)[0]
        plain = emb(batch.input_ids, batch.element_kind, batch.segment_ids, batch.position_ids, batch.roi_index,
                    batch.has_image, batch.boxes, features, batch.roi_masked, batch.image_size)
        token = emb.word_embeddings(batch.input_ids[0]) + emb.position_embeddings(batch.position_ids[0]) + \
            emb.segment_embeddings(batch.segment_ids[0])
    for position, box in ((1, 0), (2, 2), (3, 0)):
        torch.testing.assert_close(plain[0, position], emb.layer_norm(token[position] + visual[box]))


# ---- 3. prec: the masked RoI's feature ---------------------------------------------------------------------

def test_prec_replaces_a_masked_rois_feature_by_the_learned_vector():
    """resnet_vlbert_for_pretraining_multitask.py: box_features[mvrc_ops == 1] = object_mask_visual_embedding,
    before obj_downsample; the image is not masked."""
    model = model_with(masked_roi_input="feature")
    vector = model.embeddings.visual_feature.masked_appearance
    with torch.no_grad():
        vector.normal_()
    boxes = torch.tensor([[[0.0, 0.0, 31.0, 31.0], [2.0, 3.0, 12.0, 20.0], [15.0, 4.0, 30.0, 29.0]]])
    size, masked = torch.tensor([[32.0, 32.0]]), torch.tensor([[False, True, False]])
    features = torch.randn(1, 3, 8)
    replaced = features.clone()
    replaced[0, 1] = vector.detach()
    with torch.no_grad():
        got = model.embeddings.visual_feature(boxes, features, size, masked)
        expected = model.embeddings.visual_feature(boxes, replaced, size)
    torch.testing.assert_close(got, expected)
    # e2e models have no such vector: their masked RoIs' pixels are zeroed instead
    assert model_with().embeddings.visual_feature.masked_appearance is None
    assert VLBertModel(tiny_config(masked_roi_input="feature")).visual_features(collate_samples([{
        "sequence": build_input_sequence([5], None, 3, cls_id=1, sep_id=2, pad_id=0), "image": torch.ones(3, 32, 32),
        "boxes": boxes[0], "roi_masked": masked[0]}])).shape == (1, 3, 8)


# ---- 4. the released image size -------------------------------------------------------------------------------

@pytest.mark.parametrize("size, expected", [
    ((400, 280), (857, 600)),     # the example: 280 -> 600, 400 * 600 / 280 = 857.1 -> 857
    ((2000, 1000), (1000, 500)),  # 1200 would pass 1000: the shorter side becomes int(1000 * 1000 / 2000)
    ((600, 800), (600, 800)),     # the shorter side is 600 already
    ((300, 300), (600, 600)),
    ((640, 427), (899, 600)),     # a COCO image: 640 * 600 / 427 = 899.3
])
def test_released_image_size_is_transforms_resize(size, expected):
    """pretrain/data/transforms/transforms.py Resize(600, 1000).get_size."""
    assert fitted_size(*size, max_side=1000, min_side=600) == expected


# ---- 5. the pre-training heads --------------------------------------------------------------------------------

def test_converted_pretrained_model_keeps_its_pretraining_heads(tmp_path):
    arrays = write_released(cut_down(load("vl-bert-base-e2e")), tmp_path / "vl-bert-base-e2e.model")
    assert convert_main(["vl-bert", str(tmp_path / "vl-bert-base-e2e.model"), str(tmp_path / "m"),
                         "--bert-path", MINILM]) == 0
    heads = read_pretraining_heads(tmp_path / "m", HEAD_NAMES)
    p = "module.vlbert."
    expected = {("mlm", "transform.dense.weight"): p + "mlm_head.predictions.transform.dense.weight",
                ("mlm", "transform.layer_norm.bias"): p + "mlm_head.predictions.transform.LayerNorm.bias",
                ("mlm", "bias"): p + "mlm_head.predictions.bias",
                ("roi_cls", "transform.dense.weight"): p + "mvrc_head.transform.dense.weight",
                ("roi_cls", "classifier.weight"): p + "mvrc_head.region_cls_pred.weight"}
    for (head, key), source in expected.items():
        torch.testing.assert_close(heads[head][key], torch.from_numpy(arrays[source]).float())
    assert set(heads) == {"mlm", "roi_cls"}   # the released pre-training has no relationship head
    report = json.loads((tmp_path / "m" / "conversion_report.json").read_text())
    assert report["mapped"]["vlbert.mvrc_head.region_cls_pred.weight"] == "heads.roi_cls.classifier.weight"
    assert (tmp_path / "m" / HEADS_FILE).is_file()


# ---- 6. the docs name the visual weights for prec ---------------------------------------------------------------

def test_real_data_docs_convert_prec_with_the_visual_weights():
    text = (REPO / "docs" / "real-data.md").read_text()
    prec_lines = [line for line in text.splitlines() if "vl-bert-base-prec" in line and "convert vl-bert" in line]
    assert prec_lines and all("--visual-weights" in line for line in prec_lines)


# ---- 7. fp16 checkpoints ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("name, dtype", [("vl-bert-base-e2e", "float16"), ("vl-bert-large-e2e", "float16"),
                                         ("vl-bert-large-prec", "float16"), ("vl-bert-base-prec", "float32"),
                                         ("vqa-base", "float32"), ("vcr-base", "float32"), ("refcoco-base", "float32")])
def test_manifest_dtypes_follow_the_released_configs_fp16_setting(name, dtype):
    """apex amp O2 with keep_batchnorm_fp32=False (pretrain/function/train.py) saves every float tensor in
    fp16, BatchNorm statistics included, for the configs with TRAIN.FP16 true."""
    tensors = json.loads((MANIFESTS / f"{name}.json").read_text())["tensors"]
    floats = {spec["dtype"] for key, spec in tensors.items() if not key.endswith("num_batches_tracked")}
    assert floats == {dtype}
    assert {spec["dtype"] for key, spec in tensors.items() if key.endswith("num_batches_tracked")} <= {"int64"}


def test_fp16_checkpoint_converts_to_the_same_values_in_fp32(tmp_path):
    arrays = write_released(cut_down(load("vl-bert-base-e2e")), tmp_path / "e2e.model")
    assert arrays["module.vlbert.word_embeddings.weight"].dtype == np.float16
    assert convert_main(["vl-bert", str(tmp_path / "e2e.model"), str(tmp_path / "m"), "--bert-path", MINILM]) == 0
    model = VLBertModel.from_pretrained(tmp_path / "m")
    assert model.embeddings.word_embeddings.weight.dtype == torch.float32
    torch.testing.assert_close(model.visual_network.body.bn1.running_var,
                               torch.from_numpy(arrays["module.image_feature_extractor.backbone.bn1.running_var"]).float(),
                               rtol=0, atol=0)
