"""benchmarks/vcr_question_kinds.py reads each VCR question's kind back from its words: it must agree with the
kind the world generator made the question as, and refuse a question of no known kind."""

import importlib.util
from pathlib import Path

import pytest

from vlbert_core.world import sample_scene
from vlbert_core.world.generate import np_rng, py_rng
from vlbert_core.world.language import vcr_items

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "vcr_question_kinds.py"


def load_script():
    spec = importlib.util.spec_from_file_location("vcr_question_kinds", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_question_kind_agrees_with_the_generator_on_every_kind():
    kinds = load_script()
    seen = set()
    for i in range(60):
        scene = sample_scene(np_rng(3, "test-vcr-kinds", i), 128)
        for item in vcr_items(scene, py_rng(3, "test-vcr-kinds", i), 4):
            assert kinds.question_kind(item.question) == item.kind, item.question
            seen.add(item.kind)
    assert seen == set(kinds.KINDS)


def test_question_kind_refuses_a_question_of_no_known_kind():
    with pytest.raises(ValueError, match="none of the world's VCR kinds"):
        load_script().question_kind(["Why", "is", [0], "smiling", "?"])
