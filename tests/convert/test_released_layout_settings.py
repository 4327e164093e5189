"""The released layouts' evaluation conventions (vlbert_core/convert/released_heads.py LAYOUTS, checked against
the authors' code by tests/convert/test_golden_released.py) are the ones the paper configs set for the pipeline,
and the RefCOCO+ candidate rule the check uses is the task's."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from vlbert_core.convert.released_heads import LAYOUTS, SENTENCE_INPUTS, ReleasedLayout
from vlbert_core.tasks.modeling.refcoco import candidate_boxes

CONFIG = Path(__file__).resolve().parents[2] / "config"


@pytest.mark.parametrize("config_file", ["paper_base.yaml", "paper_large.yaml"])
def test_paper_configs_set_the_released_canvas_and_box_zero(config_file):
    finetune = yaml.safe_load((CONFIG / config_file).read_text())["finetune"]
    for task in ("vcr_q2a", "vcr_qa2r"):
        assert tuple(finetune[task]["fixed_canvas"]) == LAYOUTS["vcr"].fixed_canvas == (600, 1200)
    assert finetune["refcoco"]["whole_image_candidate"] is LAYOUTS["refcoco"].whole_image_candidate is True


def test_candidate_boxes_include_box_zero_only_when_asked():
    assert candidate_boxes(3, True).tolist() == [True, True, True]
    assert candidate_boxes(3, False).tolist() == [False, True, True]
    assert candidate_boxes(1, False).dtype == torch.bool
    with pytest.raises(ValueError, match="box 0"):
        candidate_boxes(0, True)


def test_a_layout_refuses_box_zero_without_per_box_scores_and_a_bad_canvas():
    common = dict(name="x", manifest="m", task="vqa", precomputed=True, authors_config="c", authors_package="vqa",
                  authors_class="C", inputs=SENTENCE_INPUTS, sentence="question", sentence_lengths=(3,),
                  output="answer_logits")
    with pytest.raises(ValueError, match="per_box"):
        ReleasedLayout(**common, whole_image_candidate=True)
    with pytest.raises(ValueError, match="short, long"):
        ReleasedLayout(**common, fixed_canvas=(1200, 600))
