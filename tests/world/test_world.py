"""The synthetic world: determinism, language that matches the scene, and the official formats."""

from __future__ import annotations

import bz2
import json
import math
import pickle
import random
import re
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

import mwparserfromhell
import numpy as np
import pytest
from PIL import Image

from vlbert_core.world import generate_world, render, sample_scene
from vlbert_core.world.generate import np_rng, py_rng
from vlbert_core.world.language import (
    SIZE_WORDS,
    cc_caption,
    pick_expressions,
    referring_expressions,
    vcr_items,
    vqa_answers,
    names_category,
    vqa_questions,
)
from vlbert_core.world.scene import (
    MAX_PAIR_IOU,
    box_iou,
    clearly_bigger,
    nearest_object,
)
from vlbert_core.world.vocabulary import CATEGORIES, CATEGORY_BY_NAME, COLOUR_NAMES, COLOURS, SIZES, VCR_OBJECT_NAME

TINY_WORLD = {
    "image_size": 128,
    "cc_images": {"train": 6, "val": 2},
    "broken_link_fraction": 0.25,
    "books_sentences": 20,
    "wiki_pages": 12,
    "vqa_images": {"train": 4, "val": 2},
    "vqa_questions_per_image": 3,
    "vcr_images": {"train": 3, "val": 2},
    "vcr_questions_per_image": 2,
    "refcoco_images": {"train": 2, "val": 1, "testA": 2, "testB": 2},
    "detector_images": {"train": 3, "val": 1},
}
SOURCES = {
    "cc": {"train": "syn/cc/Train_GCC-training.tsv", "val": "syn/cc/Validation_GCC-1.1.0-Validation.tsv"},
    "books": "syn/books/books_large_p1.txt",
    "wiki": "syn/wiki/enwiki-synthetic-pages-articles.xml.bz2",
    "vqa": {"questions": "syn/vqa/v2_OpenEnded_mscoco_{split}2014_questions.json",
            "annotations": "syn/vqa/v2_mscoco_{split}2014_annotations.json",
            "images": "syn/coco/{split}2014"},
    "vcr": {"annotations": "syn/vcr/{split}.jsonl", "images": "syn/vcr/vcr1images"},
    "refcoco": {"refs": "syn/refcoco+/refs(unc).p", "instances": "syn/refcoco+/instances.json",
                "images": "syn/coco/train2014"},
    "detector": {"annotations": "syn/detector/instances_{split}.json", "images": "syn/detector/images"},
}
SEED = 7
LOCATION_WORDS = {"left", "right", "top", "bottom", "above", "below", "upper", "lower", "middle", "center",
                  "centre", "corner", "front", "behind"}


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> tuple[Path, dict]:
    root = tmp_path_factory.mktemp("world_a")
    summary = generate_world(TINY_WORLD, SOURCES, root, SEED, summary_path=Path("syn/world.json"))
    return root, summary


def _load(root: Path, rel: str, **fields):
    path = root / rel.format(**fields)
    if path.suffix == ".json":
        return json.loads(path.read_text())
    if path.suffix == ".jsonl":
        return [json.loads(line) for line in path.read_text().splitlines()]
    if path.suffix == ".p":
        return pickle.loads(path.read_bytes())
    return path.read_text()


def _has_colour(image: Image.Image, box, colour: str, tolerance: float = 45.0) -> bool:
    """Some pixel inside `box` is close to the named colour (JPEG shifts colours a little)."""
    x1, y1, x2, y2 = (int(round(v)) for v in box[:4])
    pixels = np.asarray(image.convert("RGB"), dtype=np.float32)[y1:y2, x1:x2].reshape(-1, 3)
    return bool((np.linalg.norm(pixels - np.array(COLOURS[colour]), axis=1) < tolerance).any())


# ---------------------------------------------------------------- determinism

def test_same_seed_gives_identical_bytes(world, tmp_path):
    root_a, _ = world
    root_b = tmp_path / "world_b"
    generate_world(TINY_WORLD, SOURCES, root_b, SEED, summary_path=Path("syn/world.json"))
    files = ["syn/vqa/v2_mscoco_train2014_annotations.json", "syn/vqa/v2_OpenEnded_mscoco_val2014_questions.json",
             "syn/vcr/train.jsonl", "syn/refcoco+/refs(unc).p", "syn/refcoco+/instances.json",
             "syn/wiki/enwiki-synthetic-pages-articles.xml.bz2", "syn/books/books_large_p1.txt",
             "syn/detector/instances_train.json", "syn/world.json"]
    files += [str(p.relative_to(root_a)) for p in sorted((root_a / "syn/coco/train2014").glob("*.jpg"))[:3]]
    files += [str(p.relative_to(root_a)) for p in sorted((root_a / "syn/vcr/vcr1images").rglob("*.json"))[:2]]
    for rel in files:
        assert (root_a / rel).read_bytes() == (root_b / rel).read_bytes(), rel
    # The TSVs differ only by the absolute root in their file:// URLs.
    tsv_a = (root_a / SOURCES["cc"]["train"]).read_text().replace(root_a.resolve().as_uri(), "ROOT")
    tsv_b = (root_b / SOURCES["cc"]["train"]).read_text().replace(root_b.resolve().as_uri(), "ROOT")
    assert tsv_a == tsv_b


def test_other_seed_gives_other_world(world, tmp_path):
    root_a, _ = world
    small = {**TINY_WORLD, "cc_images": {"train": 2, "val": 1}}
    generate_world(small, SOURCES, tmp_path, SEED + 1)
    rel = "syn/books/books_large_p1.txt"
    assert (root_a / rel).read_bytes() != (tmp_path / rel).read_bytes()


# ---------------------------------------------------------------- scenes

def test_scenes_respect_geometry_and_size_classes():
    rng = np_rng(0, "test-scenes")
    for _ in range(150):
        scene = sample_scene(rng, 128, (2, 6), required_categories=("person", "person"))
        assert 2 <= len(scene.objects) <= 6
        assert sum(o.category == "person" for o in scene.objects) >= 2
        for k, obj in enumerate(scene.objects):
            x1, y1, x2, y2 = obj.box
            assert 0 <= x1 < x2 <= 128 and 0 <= y1 < y2 <= 128
            lo, hi = SIZES[obj.size]
            assert lo <= max(obj.width, obj.height) <= hi
            for other in scene.objects[k + 1:]:
                assert box_iou(obj.box, other.box) < MAX_PAIR_IOU


def test_render_paints_each_object_in_its_colour():
    rng = np_rng(0, "test-render")
    for _ in range(20):
        scene = sample_scene(rng, 128)
        image = render(scene)
        assert image.size == (128, 128) and image.mode == "RGB"
        pixels = np.asarray(image)
        for obj in scene.objects:
            if obj.category in ("square", "circle", "diamond", "cross") and obj is scene.objects[-1]:
                # The top-most filled shape shows its exact paint at its centre.
                cx, cy = (int(v) for v in obj.center)
                assert tuple(pixels[cy, cx]) == obj.rgb


# ---------------------------------------------------------------- language matches the scene

def _objects_matching(scene, words: list[str]):
    """Objects a phrase like 'small red stars' / 'red objects' denotes (size, colour, category words)."""
    text = " ".join(words)
    matches = list(scene.objects)
    for colour in COLOUR_NAMES:
        if colour in words:
            matches = [o for o in matches if o.colour == colour]
    for size in SIZES:
        if size in words:
            matches = [o for o in matches if o.size == size]
    for cat in CATEGORIES:
        if re.search(rf"\b({cat.name}|{cat.plural})\b", text):
            matches = [o for o in matches if o.category == cat.name]
    return matches


def test_vqa_answers_follow_from_the_scene():
    """Re-derive every answer from the question text and the scene, independently of the generator."""
    kinds = Counter()
    for i in range(150):
        scene = sample_scene(np_rng(1, "test-vqa", i), 128)
        for q in vqa_questions(scene, py_rng(1, "test-vqa", i), 3):
            words = q.question.rstrip("?").split()
            kinds[q.kind] += 1
            if q.question.startswith("how many"):
                assert q.answer == str(len(_objects_matching(scene, words[2:-2])))
            elif q.question.startswith("is there"):
                assert q.answer == ("yes" if _objects_matching(scene, words[3:]) else "no")
            elif q.question.startswith("what color is the"):
                (obj,) = _objects_matching(scene, words[4:])
                assert q.answer == obj.colour
            else:  # "what is the red object" / "what kind of object is the small red one"
                (obj,) = _objects_matching(scene, [w for w in words if w in COLOUR_NAMES or w in SIZES])
                assert q.answer == obj.category
    assert set(kinds) == {"colour", "count", "yesno", "category"}


def test_vqa_ten_answers_with_some_disagreement():
    rng = random.Random(3)
    scene = sample_scene(np_rng(3, "test-vqa-answers"), 128)
    disagreeing = 0
    for q in vqa_questions(scene, rng, 3) * 100:
        answers = vqa_answers(q, rng, 0.3)
        assert len(answers) == 10
        assert Counter(answers).most_common(1)[0][0] == q.answer
        assert answers.count(q.answer) >= 6
        disagreeing += len(set(answers)) > 1
    assert 0.15 < disagreeing / 300 < 0.45


def test_captions_name_exactly_the_objects_drawn():
    for i in range(100):
        scene = sample_scene(np_rng(2, "test-cc", i), 128)
        caption = cc_caption(scene, py_rng(2, "test-cc", i))
        mentioned = {c.name for c in CATEGORIES if re.search(rf"\b({c.name}|{c.plural})\b", caption)}
        assert mentioned == {o.category for o in scene.objects}, (caption, scene.objects)
        for colour in COLOUR_NAMES:
            if re.search(rf"\b{colour}\b", caption):
                assert any(o.colour == colour for o in scene.objects), caption


def _resolve_expression(scene, sentence: str) -> list[int]:
    """Interpret a referring expression of the world's grammar; return the indices it denotes."""
    for word in ("next to", "near", "beside"):
        if f" {word} " in f" {sentence} ":
            head, landmark = sentence.split(f" {word} ", 1)
            (anchor,) = _resolve_expression(scene, landmark)
            return [k for k in _resolve_expression(scene, head) if nearest_object(scene, k) == anchor]
    words = sentence.replace("plus sign", "cross").replace("stick figure", "figure").split()
    synonyms = {syn.replace("plus sign", "cross").replace("stick figure", "figure"): c.name
                for c in CATEGORIES for syn in c.synonyms}
    keep = list(range(len(scene.objects)))
    category = next((synonyms[w] for w in words if w in synonyms), None)
    if category:
        keep = [k for k in keep if scene.objects[k].category == category]
    for colour in COLOUR_NAMES:
        if colour in words:
            keep = [k for k in keep if scene.objects[k].colour == colour]
    for size, size_words in SIZE_WORDS.items():
        if any(w in words for w in size_words):
            keep = [k for k in keep if scene.objects[k].size == size]
    same = [k for k in range(len(scene.objects)) if scene.objects[k].category == category]
    if {"larger", "bigger", "largest", "biggest"} & set(words):
        keep = [k for k in keep if all(clearly_bigger(scene.objects[k], scene.objects[j]) for j in same if j != k)]
    if {"smaller", "smallest"} & set(words):
        keep = [k for k in keep if all(clearly_bigger(scene.objects[j], scene.objects[k]) for j in same if j != k)]
    return keep


def test_referring_expressions_pick_out_exactly_their_target():
    checked = 0
    for i in range(120):
        scene = sample_scene(np_rng(4, "test-ref", i), 128, required_categories=("star", "star"))
        rng = py_rng(4, "test-ref", i)
        for target in range(len(scene.objects)):
            for kind, sentence in referring_expressions(scene, target, rng):
                assert not LOCATION_WORDS & set(sentence.split()), sentence
                assert _resolve_expression(scene, sentence) == [target], (kind, sentence, scene.objects)
                checked += 1
    assert checked > 300


def test_pick_expressions_gives_one_to_three_distinct_sentences():
    rng = random.Random(0)
    candidates = [("category", "the star"), ("colour", "the red star"), ("colour", "red star"), ("size", "big star")]
    for _ in range(50):
        picked = pick_expressions(candidates, rng)
        assert 1 <= len(picked) <= 3 and len(set(picked)) == len(picked)
        assert set(picked) <= {t for _, t in candidates}
    assert pick_expressions([], rng) == []


def test_vcr_items_are_visual_facts():
    labels, kinds = Counter(), Counter()
    for i in range(100):
        scene = sample_scene(np_rng(5, "test-vcr", i), 128)
        for item in vcr_items(scene, py_rng(5, "test-vcr", i), 2):
            kinds[item.kind] += 1
            labels[item.answer_label] += 1
            labels[item.rationale_label] += 1
            answer = item.answer_choices[item.answer_label]
            refs = [t[0] for t in item.question if isinstance(t, list)]
            if item.kind == "colour":
                assert scene.objects[refs[0]].colour in answer
            elif item.kind == "kind":
                assert scene.objects[refs[0]].category in answer
            elif item.kind == "next_to":
                rationale = item.rationale_choices[item.rationale_label]
                assert nearest_object(scene, refs[0]) == rationale[0][0]
            elif item.kind == "bigger":
                i_obj, j_obj = (scene.objects[r] for r in refs)
                asks_bigger = "bigger" in item.question
                assert (answer[0] == "Yes") == (clearly_bigger(i_obj, j_obj) == asks_bigger)
    assert set(kinds) == {"colour", "kind", "next_to", "bigger"}
    assert set(labels) == {0, 1, 2, 3}  # the right choice is not always in one position


def test_vcr_text_alone_never_rules_a_choice_out():
    """VCR's objects all carry one name, so a choice's words are only told apart from another's by the RoIs
    its references point at. On `bigger` every choice has a twin with the same words: the same sentence with
    the two objects swapped (no answer form that is never right, which a text-only model learns to skip)."""
    def words(tokens):
        return tuple(VCR_OBJECT_NAME if isinstance(t, list) else t for t in tokens)

    checked = 0
    for i in range(60):
        scene = sample_scene(np_rng(6, "test-vcr-text", i), 128)
        for item in vcr_items(scene, py_rng(6, "test-vcr-text", i), 2):
            if item.kind != "bigger":
                continue
            texts = Counter(words(c) for c in item.answer_choices)
            assert all(n == 2 for n in texts.values()), item.answer_choices
            checked += 1
    assert checked > 10


# ---------------------------------------------------------------- files in their official formats

def test_cc_tsv_rows_and_dead_links(world):
    root, summary = world
    for split, n in TINY_WORLD["cc_images"].items():
        lines = (root / SOURCES["cc"][split]).read_text().splitlines()
        assert len(lines) == n
        dead = 0
        for i, line in enumerate(lines):
            fields = line.split("\t")
            assert len(fields) == 2 and fields[0] and fields[1].startswith("file:///")
            path = Path(fields[1].removeprefix("file://"))
            if not path.exists():
                dead += 1
                continue
            image = Image.open(path)
            assert image.format == "JPEG" and image.size == (128, 128)
            # The caption's colours are painted in the image.
            scene = sample_scene(np_rng(SEED, "cc", split, i), 128)
            for obj in scene.objects:
                assert _has_colour(image, obj.box, obj.colour), (fields[0], obj)
        assert dead == round(n * TINY_WORLD["broken_link_fraction"]) == summary["counts"]["cc"][split]["broken_links"]


def test_books_one_long_sentence_per_line(world):
    root, _ = world
    lines = (root / SOURCES["books"]).read_text().splitlines()
    assert len(lines) == TINY_WORLD["books_sentences"] and all(line.strip() for line in lines)
    captions = [line.split("\t")[0] for line in (root / SOURCES["cc"]["train"]).read_text().splitlines()]
    book_words = np.mean([len(line.split()) for line in lines])
    assert book_words > 20 and book_words > 1.3 * np.mean([len(c.split()) for c in captions])


def test_books_archive_path_gets_the_published_archive_layout_and_reads_back(tmp_path):
    """A books source ending in .tar.bz2 (config/rehearsal.yaml, as paper_base's bookcorpus.tar.bz2)
    is written as the published archive: the lines in order over books_large_p1.txt and _p2.txt."""
    import tarfile

    from vlbert_core.data.text import iter_text_units
    from vlbert_core.world import formats

    lines = [f"sentence number {i} of the synthetic books ." for i in range(7)]
    path = tmp_path / "bookcorpus.tar.bz2"
    assert formats.write_books(path, lines) == 7
    with tarfile.open(path, "r:bz2") as tar:
        assert tar.getnames() == ["books_large_p1.txt", "books_large_p2.txt"]
    units = list(iter_text_units("books", path, sentences_per_doc=3))
    assert [u.file for u in units] == ["books_large_p1.txt", "books_large_p1.txt", "books_large_p2.txt"]
    assert [s for u in units for s in u.sentences] == lines
    again = tmp_path / "again" / "bookcorpus.tar.bz2"
    formats.write_books(again, lines)
    assert again.read_bytes() == path.read_bytes()  # byte-stable, like every world file


def test_wiki_dump_is_a_mediawiki_export(world):
    root, _ = world
    tree = ET.fromstring(bz2.decompress((root / SOURCES["wiki"]).read_bytes()))
    ns = {"mw": "http://www.mediawiki.org/xml/export-0.10/"}
    assert tree.tag == "{http://www.mediawiki.org/xml/export-0.10/}mediawiki"
    pages = tree.findall("mw:page", ns)
    ids = [p.findtext("mw:id", namespaces=ns) for p in pages]
    assert len(set(ids)) == len(ids)
    articles = [p for p in pages if p.findtext("mw:ns", namespaces=ns) == "0" and p.find("mw:redirect", ns) is None]
    redirects = [p for p in pages if p.find("mw:redirect", ns) is not None]
    assert len(articles) == TINY_WORLD["wiki_pages"]
    assert redirects and all(p.findtext("mw:revision/mw:text", namespaces=ns).startswith("#REDIRECT [[")
                             for p in redirects)
    titles = {p.findtext("mw:title", namespaces=ns) for p in articles}
    assert all(p.find("mw:redirect", ns).get("title") in titles for p in redirects)
    assert any(p.findtext("mw:ns", namespaces=ns) in ("4", "10") for p in pages)
    for page in articles:
        text = page.findtext("mw:revision/mw:text", namespaces=ns)
        for markup in ("{{", "<ref>", "[[", "{|", "[[File:", "== "):
            assert markup in text, (page.findtext("mw:title", namespaces=ns), markup)
        plain = mwparserfromhell.parse(text).strip_code()
        assert len(plain.split()) > 20


def test_vqa_files(world):
    root, _ = world
    seen_ids = set()
    for split, n in TINY_WORLD["vqa_images"].items():
        questions = _load(root, SOURCES["vqa"]["questions"], split=split)
        annotations = _load(root, SOURCES["vqa"]["annotations"], split=split)
        assert {"info", "license", "task_type", "data_type", "data_subtype", "questions"} <= set(questions)
        assert {"info", "license", "data_type", "data_subtype", "annotations"} <= set(annotations)
        assert questions["data_subtype"] == f"{split}2014"
        assert len(questions["questions"]) == n * TINY_WORLD["vqa_questions_per_image"]
        by_id = {a["question_id"]: a for a in annotations["annotations"]}
        for q in questions["questions"]:
            assert q["question_id"] not in seen_ids
            seen_ids.add(q["question_id"])
            ann = by_id[q["question_id"]]
            assert ann["image_id"] == q["image_id"]
            assert [a["answer_id"] for a in ann["answers"]] == list(range(1, 11))
            answers = [a["answer"] for a in ann["answers"]]
            assert ann["multiple_choice_answer"] == Counter(answers).most_common(1)[0][0]
            assert ann["answer_type"] in ("yes/no", "number", "other")
            image = Image.open(root / SOURCES["vqa"]["images"].format(split=split)
                               / f"COCO_{split}2014_{q['image_id']:012d}.jpg")
            if q["question"].startswith("what color"):
                assert _has_colour(image, (0, 0, 128, 128), ann["multiple_choice_answer"]), q


def test_vqa_training_questions_leave_the_held_out_categories_unnamed():
    """No VQA training question or answer names a held-out category, though the images show them; val asks about
    them as the unfiltered generator does, so the held-out-concepts column has its examples."""
    held_out = ("diamond", "ring")
    named_in_train = named_in_val = shown_in_train = 0
    for i in range(60):
        scene = sample_scene(np_rng(5, "test-held-out", i), 128)
        shown_in_train += any(o.category in held_out for o in scene.objects)
        train = vqa_questions(scene, py_rng(5, "test-held-out", i), 3, unasked=held_out)
        val = vqa_questions(scene, py_rng(5, "test-held-out", i), 3)
        named_in_train += sum(names_category(q, held_out) for q in train)
        named_in_val += sum(names_category(q, held_out) for q in val)
        assert all(q.answer not in ("diamond", "ring") for q in train)
        assert not any(w in q.question.rstrip("?").split() for q in train for w in ("diamond", "diamonds", "ring",
                                                                                     "rings"))
    assert named_in_train == 0 and named_in_val > 10 and shown_in_train > 10


def test_the_held_out_categories_must_be_the_worlds(tmp_path):
    with pytest.raises(ValueError, match=r"world\.vqa_held_out_categories.*'hexagon'"):
        generate_world({**TINY_WORLD, "vqa_held_out_categories": ["ring", "hexagon"]}, SOURCES, tmp_path, SEED)


def test_vcr_files(world):
    root, _ = world
    images_root = root / SOURCES["vcr"]["images"]
    for split, n in TINY_WORLD["vcr_images"].items():
        rows = _load(root, SOURCES["vcr"]["annotations"], split=split)
        assert len(rows) == n * TINY_WORLD["vcr_questions_per_image"]
        assert len({r["annot_id"] for r in rows}) == len(rows)
        for row in rows:
            meta = json.loads((images_root / row["metadata_fn"]).read_text())
            image = Image.open(images_root / row["img_fn"])
            assert meta["names"] == row["objects"] and len(meta["boxes"]) == len(meta["segms"]) == len(row["objects"])
            assert set(row["objects"]) == {VCR_OBJECT_NAME}  # a reference's name never says what the object is
            assert (meta["width"], meta["height"]) == image.size
            for x1, y1, x2, y2, score in meta["boxes"]:
                assert 0 <= x1 < x2 <= meta["width"] and 0 <= y1 < y2 <= meta["height"] and score == 1.0
            assert len(row["answer_choices"]) == len(row["rationale_choices"]) == 4
            assert row["answer_label"] in range(4) and row["rationale_label"] in range(4)
            for tokens in [row["question"], *row["answer_choices"], *row["rationale_choices"]]:
                for token in tokens:
                    if isinstance(token, list):
                        assert token and all(0 <= k < len(row["objects"]) for k in token)
                    else:
                        assert isinstance(token, str) and token
            refs = [t[0] for t in row["question"] if isinstance(t, list)]
            if row["question"][:2] == ["What", "color"]:
                colour = next(w for w in row["answer_choices"][row["answer_label"]] if w in COLOUR_NAMES)
                assert _has_colour(image, meta["boxes"][refs[0]], colour)


def test_refcoco_files_and_split_rules(world):
    root, _ = world
    refs = _load(root, SOURCES["refcoco"]["refs"])
    instances = _load(root, SOURCES["refcoco"]["instances"])
    anns = {a["id"]: a for a in instances["annotations"]}
    images = {im["id"]: im for im in instances["images"]}
    person = CATEGORY_BY_NAME["person"].id
    assert {r["split"] for r in refs} == set(TINY_WORLD["refcoco_images"])
    assert len(images) == sum(TINY_WORLD["refcoco_images"].values())
    sent_ids = [s["sent_id"] for r in refs for s in r["sentences"]]
    assert len(set(sent_ids)) == len(sent_ids)
    assert len({r["ref_id"] for r in refs}) == len(refs)
    for ref in refs:
        ann = anns[ref["ann_id"]]
        assert ann["image_id"] == ref["image_id"] and ann["category_id"] == ref["category_id"]
        assert 1 <= len(ref["sentences"]) <= 3 and ref["sent_ids"] == [s["sent_id"] for s in ref["sentences"]]
        for sentence in ref["sentences"]:
            assert sentence["tokens"] == sentence["sent"].split() and sentence["raw"]
            assert not LOCATION_WORDS & set(sentence["tokens"]), sentence
        people = [a for a in instances["annotations"] if a["image_id"] == ref["image_id"] and a["category_id"] == person]
        if ref["split"] == "testA":
            assert ref["category_id"] == person and len(people) >= 2
        if ref["split"] == "testB":
            assert ref["category_id"] != person
    for ann in instances["annotations"]:
        x, y, w, h = ann["bbox"]
        im = images[ann["image_id"]]
        assert 0 <= x and 0 <= y and x + w <= im["width"] and y + h <= im["height"] and ann["area"] > 0
        assert ann["iscrowd"] == 0
    # VQA train images and RefCOCO+ images share the train2014 folder: their ids must not collide.
    vqa_train = {q["image_id"] for q in _load(root, SOURCES["vqa"]["questions"], split="train")["questions"]}
    assert not vqa_train & set(images)
    for im in images.values():
        assert (root / SOURCES["refcoco"]["images"] / im["file_name"]).exists()


def test_detector_annotations_and_shared_categories(world):
    root, summary = world
    refcoco_categories = _load(root, SOURCES["refcoco"]["instances"])["categories"]
    assert summary["categories"] == refcoco_categories
    assert [c["id"] for c in refcoco_categories] == list(range(1, len(CATEGORIES) + 1))
    assert json.loads((root / "syn/world.json").read_text()) == summary
    for split, n in TINY_WORLD["detector_images"].items():
        data = _load(root, SOURCES["detector"]["annotations"], split=split)
        assert data["categories"] == refcoco_categories and len(data["images"]) == n
        assert len({a["id"] for a in data["annotations"]}) == len(data["annotations"])
        per_image = Counter(a["image_id"] for a in data["annotations"])
        for im in data["images"]:
            assert 2 <= per_image[im["id"]] <= 6
            assert Image.open(root / SOURCES["detector"]["images"] / im["file_name"]).size == (im["width"], im["height"])
        for ann in data["annotations"]:
            x, y, w, h = ann["bbox"]
            assert w > 0 and h > 0 and x + w <= 128 and y + h <= 128
            assert math.isclose(len(ann["segmentation"][0]) % 2, 0)


def test_config_errors_name_the_key(tmp_path):
    broken = {k: v for k, v in TINY_WORLD.items() if k != "wiki_pages"}
    with pytest.raises(KeyError, match="wiki_pages"):
        generate_world(broken, SOURCES, tmp_path, 0)
    sources = {**SOURCES, "vqa": {**SOURCES["vqa"], "questions": "syn/vqa/questions.json"}}
    with pytest.raises(ValueError, match=r"sources\.vqa\.questions"):
        generate_world(TINY_WORLD, sources, tmp_path, 0)
    with pytest.raises(ValueError, match="refcoco_images"):
        generate_world({**TINY_WORLD, "refcoco_images": {"testC": 1}}, SOURCES, tmp_path, 0)
