"""benchmarks/vs_authors.py: the released-size batch it times both sides on keeps the authors' conventions, and
this project's side sees the same targets in it as the authors' side."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import load_benchmark

from vlbert_core.convert.released_heads import get_layout
from vlbert_core.convert.vlbert.reference import CLS_ID, MASK_ID, SEP_ID, pretrain_batch, reference_inputs
from vlbert_core.models.common.inputs import IGNORE_INDEX
from vlbert_core.models.vlbert.config import VLBertConfig

vs_authors = load_benchmark("vs_authors")


def released_config() -> VLBertConfig:
    """The converted released model's input conventions (its config.json), at a tiny size: only the batch is
    built from it."""
    return VLBertConfig(vocab_size=30522, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=16, hidden_act="gelu", hidden_dropout_prob=0.1,
                        attention_probs_dropout_prob=0.1, max_position_embeddings=512, layer_norm_eps=1e-12,
                        text_only_layout="released",
                        visual_backbone={"block": "bottleneck", "depth": 101, "head_dilation": 2,
                                         "pixel_format": "bgr255_caffe", "stride_in_1x1": True})


def test_released_batch_has_the_released_sizes_and_the_authors_conventions():
    batch = vs_authors.released_batch(seed=0)
    assert set(batch) == set(reference_inputs(get_layout("pretrain-e2e"), 0))
    rows, boxes = vs_authors.RELEASED_ROWS, vs_authors.RELEASED_BOXES
    assert batch["images"].shape[:3] == (rows, vs_authors.RELEASED_IMAGE[1], vs_authors.RELEASED_IMAGE[0])
    assert batch["boxes"].shape == (rows, boxes, 4)
    w, h = vs_authors.RELEASED_IMAGE
    assert (batch["boxes"][:, 0] == [0, 0, w - 1, h - 1]).all()
    x1, y1, x2, y2 = np.moveaxis(batch["boxes"], -1, 0)
    assert (x1 < x2).all() and (y1 < y2).all() and (x2 <= w - 1).all() and (y2 <= h - 1).all()
    # captions: [CLS] words [SEP]; text rows: SEQ_LEN word pieces, no specials
    for ids in batch["text"]:
        real = ids[ids > 0]
        assert real[0] == CLS_ID and real[-1] == SEP_ID
    assert batch["aux_text"].shape == (rows, vs_authors.TEXT_ROW_LENGTH)
    assert not np.isin(batch["aux_text"], [0, CLS_ID, SEP_ID]).any()
    # every row has a masked word, each label sits under a [MASK] and is not one of the specials
    for ids, labels in ((batch["text"], batch["mlm_labels"]), (batch["aux_text"], batch["aux_mlm_labels"])):
        assert ((labels >= 0).sum(1) >= 1).all()
        assert (ids[labels >= 0] == MASK_ID).all() and not np.isin(labels[labels >= 0], [CLS_ID, SEP_ID]).any()
    # masked RoIs: never box 0, at least one per image, each with a class distribution as its target
    ops = batch["mvrc_ops"]
    assert not ops[:, 0].any() and (ops.sum(1) >= 1).all()
    np.testing.assert_allclose(batch["mvrc_labels"][ops == 1].sum(-1), 1.0, rtol=1e-5)
    assert not batch["mvrc_labels"][ops == 0].any()


def test_our_batch_carries_the_same_targets_as_the_authors_arrays():
    arrays = vs_authors.released_batch(seed=0)
    batch = pretrain_batch(arrays, released_config())
    labels = batch.mlm_labels[batch.mlm_labels != IGNORE_INDEX]
    theirs = np.concatenate([arrays["mlm_labels"][arrays["mlm_labels"] >= 0],
                             arrays["aux_mlm_labels"][arrays["aux_mlm_labels"] >= 0]])
    assert sorted(labels.tolist()) == sorted(theirs.tolist())
    assert int(batch.inputs.has_image.sum()) == vs_authors.RELEASED_ROWS == int((~batch.inputs.has_image).sum())
    assert torch.equal(batch.inputs.roi_masked[: vs_authors.RELEASED_ROWS, : arrays["mvrc_ops"].shape[1]],
                       torch.from_numpy(arrays["mvrc_ops"] == 1))


def test_the_floor_is_the_visual_network_plus_the_rest_at_the_gemm_rate_plus_the_update():
    ours = {"median_s": 2.4, "visual_s": 1.5, "rest_flops": 30e9, "gemm_flops_per_s": 120e9, "update_s": 0.07,
            "peak_rss_mb": 2048.0}
    assert vs_authors.step_floor(ours) == pytest.approx(1.5 + 0.25 + 0.07)
    theirs = {"median_s": 2.0, "peak_rss_mb": 2048.0}
    row = {"batch": "fixture", "threads": 1, "pairs": [{"ours": ours, "authors": theirs, "ratio": 1.2}]}
    header, _, line = vs_authors.table([row]).splitlines()
    cells = dict(zip([c.strip() for c in header.strip("|").split("|")], [c.strip() for c in line.strip("|").split("|")]))
    assert cells["floor (s)"] == "1.820" and cells["floor / authors"] == "0.910"
