"""ViLBERT's task tokens (the authors' multi-task models): the task embedding after [CLS], no position or type of
its own, the mask one longer, the task id per task. (That it computes the authors' numbers:
tests/convert/test_golden_vilbert.py.)"""

from __future__ import annotations

import pytest
import torch

from vlbert_core.models.vilbert.config import AUTHORS_TASK_IDS, PIPELINE_AUTHORS_TASKS, task_token_id
from vlbert_core.models.vilbert.model import ViLBertModel

from test_vilbert import tiny_config, two_rows

torch.set_num_threads(1)


def task_model(seed: int = 0, **overrides) -> ViLBertModel:
    torch.manual_seed(seed)
    return ViLBertModel(tiny_config(task_specific_tokens=True, **overrides)).eval()


def streams_inputs(rows: int = 2, words: int = 5, regions: int = 3):
    g = torch.Generator().manual_seed(3)
    input_ids = torch.randint(3, 50, (rows, words), generator=g)
    token_types = torch.zeros(rows, words, dtype=torch.long)
    text_mask = torch.ones(rows, words, dtype=torch.bool)
    text_mask[1, 3:] = False
    features = torch.rand(rows, regions, 8, generator=g)
    locations = torch.rand(rows, regions, 5, generator=g)
    region_mask = torch.ones(rows, regions, dtype=torch.bool)
    return input_ids, token_types, text_mask, features, locations, region_mask


def test_the_task_token_follows_cls_with_no_position_or_type_embedding():
    model = task_model()
    input_ids, token_types, *_ = streams_inputs()
    embeddings = model.embeddings
    task_ids = torch.tensor([1, 10])
    with torch.no_grad():
        out = embeddings(input_ids, token_types, task_ids)
        assert out.shape == (2, input_ids.shape[1] + 1, 16)
        # the task token alone: the LayerNorm of its embedding row, nothing added
        assert torch.allclose(out[:, 1], embeddings.layer_norm(embeddings.task_embeddings.weight[task_ids]),
                              atol=1e-6)
        # the words keep positions 0..T-1: [CLS] at 0, word k (k >= 1) at k + 1
        words = embeddings.layer_norm(embeddings.word_embeddings(input_ids)
                                      + embeddings.position_embeddings.weight[:input_ids.shape[1]]
                                      + embeddings.token_type_embeddings(token_types))
        assert torch.allclose(out[:, 0], words[:, 0], atol=1e-6)
        assert torch.allclose(out[:, 2:], words[:, 1:], atol=1e-6)


def test_task_ids_are_given_exactly_when_the_model_has_task_tokens():
    input_ids, token_types, *_ = streams_inputs()
    with pytest.raises(ValueError, match="task ids are given exactly when"):
        task_model().embeddings(input_ids, token_types)
    with pytest.raises(ValueError, match="task ids are given exactly when"):
        ViLBertModel(tiny_config()).embeddings(input_ids, token_types, torch.tensor([1, 1]))
    with pytest.raises(ValueError, match=r"0\.\.19"):
        task_model().embeddings(input_ids, token_types, torch.tensor([1, 20]))


def test_the_text_outputs_are_one_longer_and_the_task_token_is_attended():
    model = task_model()
    inputs = streams_inputs()
    with torch.no_grad():
        streams = model.forward_streams(*inputs, task_ids=torch.tensor([1, 1]))
        other_task = model.forward_streams(*inputs, task_ids=torch.tensor([10, 10]))
    assert streams.text_states.shape[1] == inputs[0].shape[1] + 1
    # the task changes what the words and, through the co-attention, the regions compute
    assert (streams.text_states[:, 0] - other_task.text_states[:, 0]).abs().max() > 1e-3
    assert (streams.visual_states - other_task.visual_states).abs().max() > 1e-3


def test_padding_after_the_task_token_stays_masked():
    """Row 1 has 3 real words; what its padded words hold changes nothing of its real outputs."""
    model = task_model()
    input_ids, *rest = streams_inputs()
    changed = input_ids.clone()
    changed[1, 3:] = 7
    with torch.no_grad():
        a = model.forward_streams(input_ids, *rest, task_ids=torch.tensor([5, 5]))
        b = model.forward_streams(changed, *rest, task_ids=torch.tensor([5, 5]))
    assert torch.allclose(a.text_states[1, :4], b.text_states[1, :4], atol=1e-6)
    assert torch.allclose(a.visual_states[1], b.visual_states[1], atol=1e-6)


def test_encode_feeds_the_configs_task_id_and_keeps_the_outputs_aligned_with_the_batch():
    batch = two_rows()
    model = task_model(task_id=task_token_id("vqa"))
    with torch.no_grad():
        out = model.encode(batch)
        assert out.text_states.shape[:2] == batch.input_ids.shape
        model.config.task_id = task_token_id("refcoco")
        assert (model.encode(batch).visual_states - out.visual_states).abs().max() > 1e-3
    model.config.task_id = None
    with pytest.raises(ValueError, match="names no task_id"):
        model.encode(batch)


def test_the_task_ids_are_the_authors_task_numbers():
    # vilbert_tasks.yml: TASK1 VQA, TASK5 / TASK6 VCR Q-A / QA-R, TASK8 Flickr30k retrieval, TASK10 RefCOCO+
    assert {task: task_token_id(task) for task in PIPELINE_AUTHORS_TASKS} == {
        "vqa": 1, "vcr_q2a": 5, "vcr_qa2r": 6, "retrieval": 8, "refcoco": 10}
    assert AUTHORS_TASK_IDS["NLVR2"] == 12 and AUTHORS_TASK_IDS["VisualEntailment"] == 13
    assert AUTHORS_TASK_IDS["GQA"] == 15
    with pytest.raises(ValueError, match="no task token"):
        task_token_id("custom")
    with pytest.raises(ValueError, match="task_id 20"):
        tiny_config(task_specific_tokens=True, task_id=20)


def test_a_model_with_task_tokens_round_trips_through_the_registry(tmp_path):
    from vlbert_core.models import registry

    model = task_model(task_id=1)
    model.save_pretrained(tmp_path / "m")
    loaded = registry.from_pretrained(tmp_path / "m")
    assert loaded.config.task_specific_tokens and loaded.config.task_id == 1
    assert torch.equal(loaded.embeddings.task_embeddings.weight, model.embeddings.task_embeddings.weight)
