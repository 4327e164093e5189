"""A converted ViLBERT fed the pipeline's own inputs for an image computes what the authors' released models
compute on the same features.

tests/data/golden/vilbert-pipeline.* hold two images with detector and ground-truth boxes and the outputs of the
AUTHORS' code (facebookresearch/vilbert-multi-task: their _image_features_reader builds the visual rows from the
RoI features and the boxes in the image's pixels, their BertForMultiModalPreTraining runs on them; written by
tests/data/golden/make_golden_vilbert_pipeline.py). Here our side is the pipeline's: the images read by the task
image loader and resized, the boxes scaled with them and box 0 put first, our visual network's RoI features, and
the converted stand-in's encode with global_region mean_of_regions. Every stage, from the visual rows to the
heads' logits, must give the authors' numbers within 1e-4.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from test_golden_vilbert import differences as gaps  # max |ours - theirs| per stage, shapes checked
from vlbert_core.convert.stages import load_arrays
from vlbert_core.convert.vilbert.pipeline_check import (FILES, PIPELINE_CONFIG, our_pipeline_stages, ours_on,
                                                        pipeline_batch)
from vlbert_core.convert.vilbert.reference import TOLERANCE, convert_stand_in, load_converted

GOLDEN = Path(__file__).resolve().parents[1] / "data" / "golden"
EVERY_STAGE = {"region_features", "region_locations", "text_embeddings", "visual_embeddings", "coattention_0_visual",
               "coattention_1_text", "text_states", "visual_states", "pooled_text", "pooled_visual", "mlm_logits",
               "region_logits", "alignment_logits"}
VISUAL_STAGES = {"region_features", "visual_embeddings", "coattention_0_visual", "visual_states", "pooled_visual",
                 "alignment_logits"}


@pytest.fixture(scope="module")
def golden():
    record = json.loads((GOLDEN / FILES["record"]).read_text())
    return (record, load_arrays(GOLDEN / FILES["inputs"]), load_arrays(GOLDEN / FILES["authors"]),
            load_arrays(GOLDEN / FILES["authors_vcr"]))


@pytest.fixture(scope="module")
def converted(golden, tmp_path_factory):
    record = golden[0]
    assert record["config"] == PIPELINE_CONFIG
    _, _, model_dir = convert_stand_in(record["config"], record["seed"], tmp_path_factory.mktemp("vilbert-pipeline"))
    return model_dir



def above(differences: dict[str, float]) -> set[str]:
    return {stage for stage, gap in differences.items() if gap > TOLERANCE}


def test_the_pipelines_inputs_give_the_authors_outputs_with_the_released_global_region(golden, converted, tmp_path):
    record, images, theirs, _ = golden
    assert max(record["largest_differences"]["plain"].values()) <= TOLERANCE
    assert EVERY_STAGE <= set(theirs)
    assert json.loads((converted / "config.json").read_text())["global_region"] == "mean_of_regions"
    ours, _ = ours_on(converted, images, tmp_path, vcr_form=False)
    assert above(gaps(ours, theirs)) == set()
    # row 0 of each image is the authors' mean of its detections at (0, 0, 1, 1, 1)
    first_rows = np.cumsum([0, *(images["det_count"][:-1] + 1)])
    np.testing.assert_array_equal(theirs["region_locations"][first_rows], [[0, 0, 1, 1, 1]] * len(first_rows))


def test_the_vcr_form_gives_the_authors_merge_of_detections_and_ground_truth(golden, converted, tmp_path):
    record, images, _, theirs = golden
    assert max(record["largest_differences"]["vcr"].values()) <= TOLERANCE
    ours, _ = ours_on(converted, images, tmp_path, vcr_form=True)
    assert above(gaps(ours, theirs)) == set()


def test_the_projects_whole_image_box_is_not_what_the_released_models_saw(golden, converted, tmp_path):
    """Control: the pipeline's default region 0 (the whole-image box's own feature and location) moves every
    visual stage out of the bound; the text embeddings, before any co-attention, stay exact."""
    import shutil

    _, images, theirs, _ = golden
    directory = Path(shutil.copytree(converted, tmp_path / "m"))
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "global_region": "whole_image_box"}))
    ours, _ = ours_on(directory, images, tmp_path, vcr_form=False)
    differences = gaps(ours, theirs)
    assert VISUAL_STAGES | {"region_locations"} <= above(differences)
    assert differences["text_embeddings"] <= TOLERANCE


def test_the_plain_mean_of_detections_and_ground_truth_is_not_the_authors_vcr_row(golden, converted, tmp_path):
    """Control: on the VCR images, row 0 as the plain mean of all the regions (not weighted by each feature
    file's row count, row 0 included) moves region 0's feature by 5.5e-3 on these images and the visual states
    after it out of the bound (the pooled and logit stages, small on a random stand-in, move by less)."""
    _, images, _, theirs = golden
    model, heads = load_converted(converted)
    from vlbert_core.models.common.config import visual_pixel_format

    batch, _ = pipeline_batch(images, visual_pixel_format(model.config), tmp_path, with_ground_truth=True)
    ours, _ = our_pipeline_stages(model, heads, batch, ground_truth=None)
    differences = gaps(ours, theirs)
    assert {"region_features", "visual_embeddings", "coattention_0_visual", "visual_states", "pooled_visual",
            "region_logits"} <= above(differences)
    assert differences["region_locations"] <= TOLERANCE and differences["text_embeddings"] <= TOLERANCE


def test_the_vcr_form_weights_each_files_mean_by_its_row_count_and_refuses_a_missing_kind():
    """vcr_dataset.py: features[0] = (g_det * num_boxes + g_gt * gt_num_boxes) / (num_boxes + gt_num_boxes), each
    count the reader's, its row 0 included: 2 detections of mean 1 and 1 ground-truth box of 4 give
    (3 * 1 + 2 * 4) / 5 = 2.2 (the plain mean of the three would be 2)."""
    import torch

    from vlbert_core.models.vilbert.model import mean_global_region

    features = torch.tensor([[[9.0], [0.0], [2.0], [4.0]]])
    locations = torch.rand(1, 4, 5)
    valid = torch.ones(1, 4, dtype=torch.bool)
    ground_truth = torch.tensor([[False, False, False, True]])
    rows, places = mean_global_region(features, locations, valid, ground_truth)
    assert rows[0, 0, 0].item() == pytest.approx(2.2)
    assert places[0, 0].tolist() == [0.0, 0.0, 1.0, 1.0, 1.0] and torch.equal(rows[:, 1:], features[:, 1:])
    assert mean_global_region(features, locations, valid)[0][0, 0, 0].item() == pytest.approx(2.0)
    with pytest.raises(ValueError, match="one detected and one ground-truth"):
        mean_global_region(features, locations, valid, torch.zeros(1, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="shape"):
        mean_global_region(features, locations, valid, ground_truth[:, :3])
