"""A converted released ViLBERT computes what the authors' code computes.

tests/data/golden/vilbert.* hold a reference batch and the outputs of the AUTHORS' model
(facebookresearch/vilbert-multi-task vilbert/vilbert.py, run on CPU by tests/data/golden/make_golden_vilbert.py)
at every stage, for the random stand-in checkpoint of a small config (seed 0). Here the same stand-in is written
again in the released key layout, converted by `convert vilbert`'s code, loaded through the model registry, and
every stage must give the authors' numbers within 1e-4: embeddings, each co-attention layer, final states,
poolers, and the MLM / region / alignment logits.

tests/data/golden/vilbert_tasks*.* do the same for the fine-tuned layout (the authors' VILBertForVLTasks, the
multi-task model and its per-task files), without task tokens and with them (as multi_task_model.bin), and for
the ViLBERT paper's single-task release (jiasenlu/vilbert_beta's VILBertForVLTasks, vilbert_tasks_beta.*): every
stage (every text and visual layer too), and every task head of theirs against ours.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from vlbert_core.convert.stages import load_arrays
from vlbert_core.convert.vilbert.checkpoint import BETA_LAYOUT, HEAD_LAYOUT_OF, VL_TASKS_LAYOUT
from vlbert_core.convert.vilbert.reference import (INPUTS_FILE, OUTPUTS_FILE, RECORD_FILE, TOLERANCE, convert_stand_in,
                                                   golden_files, load_converted, our_stages)

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


# ---- the fine-tuned layout (VILBertForVLTasks), without and with task tokens -----------------------------------

# the authors' task heads, compared at every stage of theirs (vilbert_tasks*.authors.npz): vilbert-multi-task's
# seven, vilbert_beta's four
TASK_HEAD_STAGES = {VL_TASKS_LAYOUT: ("vil_prediction", "vil_prediction_gqa", "vil_logit", "vil_binary_prediction",
                                      "vil_tri_prediction", "vision_logit", "linguisic_logit"),
                    BETA_LAYOUT: ("vil_prediction", "vil_logit", "vision_logit", "linguisic_logit")}
TASK_LAYOUTS = [pytest.param((VL_TASKS_LAYOUT, False), id="multi-task-release-no-task-tokens"),
                pytest.param((VL_TASKS_LAYOUT, True), id="multi-task-release-task-tokens"),
                pytest.param((BETA_LAYOUT, False), id="vilbert-beta-release")]


@pytest.fixture(scope="module", params=TASK_LAYOUTS)
def fine_tuned(request, tmp_path_factory):
    """(record, inputs, the authors' outputs, converted directory) of a VILBertForVLTasks stand-in."""
    layout, task_tokens = request.param
    inputs_file, outputs_file, record_file = golden_files(layout, task_tokens)
    record = json.loads((GOLDEN / record_file).read_text())
    assert record["layout"] == layout and record["task_tokens"] == task_tokens
    _, _, model_dir = convert_stand_in(record["config"], record["seed"], tmp_path_factory.mktemp("vilbert_tasks"),
                                       layout, task_tokens)
    return record, load_arrays(GOLDEN / inputs_file), load_arrays(GOLDEN / outputs_file), model_dir


def test_a_converted_fine_tuned_model_gives_the_authors_outputs_at_every_stage_and_head(fine_tuned):
    record, inputs, theirs, model_dir = fine_tuned
    assert record["tolerance"] == TOLERANCE and max(record["largest_differences"].values()) <= TOLERANCE
    every_layer = ({f"text_layer_{i}" for i in range(record["config"]["num_hidden_layers"])}
                   | {f"visual_layer_{i}" for i in range(record["config"]["v_num_hidden_layers"])})
    assert set(TASK_HEAD_STAGES[record["layout"]]) | every_layer | {"text_states", "coattention_1_text",
                                                                    "pooled_visual"} <= set(theirs)
    model, heads, task_heads = load_converted(model_dir, with_task_heads=True)
    assert model.config.task_specific_tokens == record["task_tokens"]
    assert model.config.task_heads == HEAD_LAYOUT_OF[record["layout"]]
    gaps = differences(our_stages(model, heads, inputs, task_heads), theirs)
    assert {stage: gap for stage, gap in gaps.items() if gap > TOLERANCE} == {}


def test_the_task_token_is_compared_at_its_position(fine_tuned):
    """With task tokens the text stages hold one more element per row (the token after [CLS]), and a change of
    a row's task token moves its outputs: the comparison sees the token."""
    record, inputs, theirs, model_dir = fine_tuned
    if not record["task_tokens"]:
        assert "task_ids" not in inputs
        return
    words = int(inputs["text_mask"].sum())
    assert theirs["text_states"].shape[0] == words + len(inputs["task_ids"])
    model, heads, task_heads = load_converted(model_dir, with_task_heads=True)
    other = dict(inputs, task_ids=inputs["task_ids"][::-1].copy())
    gaps = differences(our_stages(model, heads, other, task_heads), theirs)
    for stage in ("text_embeddings", "text_states", "vil_prediction", "vision_logit"):
        assert gaps[stage] > TOLERANCE, stage


def test_the_shared_task_classes_heads_load_the_released_ones_and_give_their_scores(fine_tuned):
    """VQA, RefCOCO+, retrieval and VCR: the head each task builds for a converted model (its head_spec, layout
    vilbert_released) takes the released head's weights and gives the authors' vil_prediction, vision_logit and
    vil_logit."""
    from vlbert_core.models.common.output import EncoderOutput
    from vlbert_core.models.vilbert.model import with_task_token
    from vlbert_core.tasks.registry import get_task

    record, inputs, theirs, model_dir = fine_tuned
    model, _, task_heads = load_converted(model_dir, with_task_heads=True)
    spec = model.head_spec()
    text_mask, region_mask = torch.from_numpy(inputs["text_mask"]).bool(), torch.from_numpy(inputs["region_mask"]).bool()
    task_ids = torch.from_numpy(inputs["task_ids"]) if record["task_tokens"] else None
    with torch.no_grad():
        streams = model.eval().forward_streams(
            torch.from_numpy(inputs["input_ids"]), torch.from_numpy(inputs["token_type_ids"]), text_mask,
            torch.from_numpy(inputs["features"]), torch.from_numpy(inputs["locations"]), region_mask, task_ids)
    output = EncoderOutput(text_states=streams.text_states,
                           text_mask=with_task_token(text_mask) if task_ids is not None else text_mask,
                           visual_states=streams.visual_states, visual_mask=region_mask, pooled=streams.pooled)
    meta = {"answers": [f"answer_{i}" for i in range(3129)], "mask_id": 3, "object_names": ["a", "b"]}
    released = {"vqa": ("vqa", "vil_prediction"), "refcoco": ("region_score", "vision_logit"),
                "retrieval": ("pair_score", "vil_logit"), "vcr_q2a": ("pair_score", "vil_logit")}
    for task_name, (ours, their_stage) in released.items():
        head = get_task(task_name).build_heads(spec, meta).head.eval()
        state = getattr(task_heads, ours).state_dict()
        if task_name == "vcr_q2a":   # VCRHead names its Linear `score`, PairScoreHead `classifier`
            state = {k.replace("classifier.", "score."): v for k, v in state.items()}
        head.load_state_dict(state, strict=True)
        with torch.no_grad():
            if task_name == "vcr_q2a":
                scores = head(output, None, num_candidates=1).reshape(-1, 1)
            else:
                scores = head(output, None)
        if task_name == "refcoco":
            scores = scores[region_mask][:, None]
        elif task_name == "retrieval":
            scores = scores[:, None]
        gap = float((scores.double() - torch.from_numpy(theirs[their_stage]).double()).abs().max())
        assert gap <= TOLERANCE, (task_name, gap)


def test_a_perturbed_task_head_breaks_that_head_only(fine_tuned):
    """Each head is compared on its own: a change to the region scorer (vision_logit) moves that stage alone."""
    _, inputs, theirs, model_dir = fine_tuned
    model, heads, task_heads = load_converted(model_dir, with_task_heads=True)
    with torch.no_grad():
        task_heads.region_score.mlp.linear.weight.add_(1e-2)
    gaps = differences(our_stages(model, heads, inputs, task_heads), theirs)
    assert gaps["vision_logit"] > TOLERANCE
    assert {stage: gap for stage, gap in gaps.items() if gap > TOLERANCE and stage != "vision_logit"} == {}
