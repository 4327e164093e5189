"""The heads of ViLBERT's released fine-tuned models (layout vilbert_released, tasks/modeling/vilbert_released.py):
their shapes and conventions. (Their numbers against the authors' code: tests/convert/test_golden_vilbert.py.)"""

from __future__ import annotations

import pytest
import torch

from vlbert_core.models.common.output import EncoderOutput, HeadSpec
from vlbert_core.tasks.modeling.common import PADDED_REGION_SCORE, check_layout
from vlbert_core.tasks.modeling.refcoco import RefCOCOHead
from vlbert_core.tasks.modeling.vilbert_released import HEAD_NAMES, ViLBertReleasedHeads
from vlbert_core.tasks.modeling.vqa import VQAHead

torch.set_num_threads(1)
SPEC = HeadSpec(text_width=12, visual_width=10, pooled_width=8, dropout=0.1, hidden_act="gelu",
                layer_norm_eps=1e-12, layout="vilbert_released", answer_readout="pooled")


def encoder_output(rows: int) -> EncoderOutput:
    g = torch.Generator().manual_seed(0)
    visual_mask = torch.ones(rows, 4, dtype=torch.bool)
    visual_mask[0, 3] = False
    return EncoderOutput(text_states=torch.randn(rows, 5, 12, generator=g),
                         text_mask=torch.ones(rows, 5, dtype=torch.bool),
                         visual_states=torch.randn(rows, 4, 10, generator=g), visual_mask=visual_mask,
                         pooled=torch.randn(rows, 8, generator=g))


def test_the_layout_is_known_and_the_vqa_head_is_dropout_then_the_authors_classifier():
    check_layout("vilbert_released")
    head = VQAHead(8, 30, mask_id=-1, layout="vilbert_released", readout="pooled").eval()
    assert [name for name, _ in head.classifier.named_children()] == ["dropout", "mlp"]
    assert head.classifier.mlp.dense.out_features == 16   # the authors' 2 x bi_hidden_size
    output = encoder_output(2)
    assert head(output, None).shape == (2, 30)


def test_the_region_score_puts_padded_regions_at_the_authors_minus_10000():
    head = RefCOCOHead(10, layout="vilbert_released").eval()
    output = encoder_output(2)
    with torch.no_grad():
        logits = head(output, None)
        plain = head.mlp(output.visual_states).squeeze(-1)
    assert torch.allclose(logits[output.visual_mask], plain[output.visual_mask])
    assert torch.allclose(logits[0, 3], plain[0, 3] + PADDED_REGION_SCORE)


def test_every_released_head_reads_the_encoder_output_and_nlvr2_needs_pairs_of_rows():
    heads = ViLBertReleasedHeads(SPEC).eval()
    with torch.no_grad():
        out = heads(encoder_output(4), None)
        assert set(out) == set(HEAD_NAMES)
        assert out["vqa"].shape == (4, 3129) and out["gqa"].shape == (4, 1533)
        assert out["nlvr2"].shape == (2, 2) and out["entailment"].shape == (4, 3)
        assert out["pair_score"].shape == (4,) and out["region_score"].shape == (4, 4)
        assert out["word_score"].shape == (4, 5, 1)
        # rows 0 and 1 are one NLVR2 example: its logits change with row 1 and not with row 2
        changed = encoder_output(4)
        changed.pooled[1] += 1.0
        assert not torch.allclose(heads.nlvr2(changed, None)[0], out["nlvr2"][0])
        assert torch.allclose(heads.nlvr2(changed, None)[1], out["nlvr2"][1])
        assert "nlvr2" not in heads(encoder_output(3), None)   # the authors' forward skips it for odd batches
    with pytest.raises(ValueError, match="come in pairs"):
        heads.nlvr2(encoder_output(3), None)
