"""A converted released ViLBERT computes what the authors' code computes.

tests/data/golden/vilbert.* hold a reference batch and the outputs of the AUTHORS' model
(facebookresearch/vilbert-multi-task vilbert/vilbert.py, run on CPU by tests/data/golden/make_golden_vilbert.py)
at every stage, for the random stand-in checkpoint of a small config (seed 0). Here the same stand-in is written
again in the released key layout, converted by `convert vilbert`'s code, loaded through the model registry, and
every stage must give the authors' numbers within 1e-4: embeddings, each co-attention layer, final states,
poolers, and the MLM / region / alignment logits.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from vlbert_core.convert.stages import load_arrays
from vlbert_core.convert.vilbert.reference import (INPUTS_FILE, OUTPUTS_FILE, RECORD_FILE, TOLERANCE, convert_stand_in,
                                                   load_converted, our_stages)

GOLDEN = Path(__file__).resolve().parents[1] / "data" / "golden"


@pytest.fixture(scope="module")
def golden():
    record = json.loads((GOLDEN / RECORD_FILE).read_text())
    return record, load_arrays(GOLDEN / INPUTS_FILE), load_arrays(GOLDEN / OUTPUTS_FILE)


@pytest.fixture(scope="module")
def converted(golden, tmp_path_factory):
    record, _, _ = golden
    _, _, model_dir = convert_stand_in(record["config"], record["seed"], tmp_path_factory.mktemp("vilbert"))
    return model_dir


def differences(ours: dict, theirs: dict) -> dict[str, float]:
    assert set(ours) == set(theirs)
    out = {}
    for stage, value in theirs.items():
        assert ours[stage].shape == value.shape, stage
        out[stage] = float(np.abs(ours[stage].astype(np.float64) - value).max())
    return out


def test_converted_stand_in_gives_the_authors_outputs_at_every_stage(golden, converted):
    record, inputs, theirs = golden
    assert record["tolerance"] == TOLERANCE and max(record["largest_differences"].values()) <= TOLERANCE
    # every stage is compared: the embeddings, both co-attention layers, the states, poolers and the three heads
    assert {"text_embeddings", "visual_embeddings", "coattention_0_text", "coattention_1_visual", "text_states",
            "visual_states", "pooled_text", "pooled_visual", "mlm_logits", "region_logits",
            "alignment_logits"} <= set(theirs)
    model, heads = load_converted(converted)
    gaps = differences(our_stages(model, heads, inputs), theirs)
    assert {stage: gap for stage, gap in gaps.items() if gap > TOLERANCE} == {}


def test_a_perturbed_weight_breaks_the_stages_after_it_and_only_those(golden, converted):
    """The comparison can fail: a small change to the text values of the second co-attention layer (what the
    regions' queries read) leaves every earlier stage equal and moves the regions' output of that layer."""
    _, inputs, theirs = golden
    model, heads = load_converted(converted)
    with torch.no_grad():
        model.encoder.coattention_layers[1].attention.text_value.weight.add_(1e-2)
    gaps = differences(our_stages(model, heads, inputs), theirs)
    for stage in ("text_embeddings", "visual_embeddings", "coattention_0_text", "coattention_0_visual"):
        assert gaps[stage] <= TOLERANCE, stage
    for stage in ("coattention_1_visual", "visual_states", "pooled_visual", "region_logits"):
        assert gaps[stage] > TOLERANCE, stage
