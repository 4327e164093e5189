"""generate_world: sample every scene, draw it, and write all raw datasets in their official formats.

Each image's scene and text come from random streams keyed by (seed, dataset, split, index), so
the output is a pure function of the config and the seed, and changing one dataset's count does
not change the images of another.
"""

from __future__ import annotations

import hashlib
import random
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from vlbert_core.progress import Progress

from ..typed_settings import read_fields
from ..utils import get_logger
from . import formats
from .flickr import write_flickr30k
from .language import (
    WorldStats,
    book_sentence,
    cc_caption,
    detokenise,
    pick_expressions,
    referring_expressions,
    vcr_items,
    vqa_answers,
    vqa_questions,
    wiki_article,
    wiki_topics,
)
from .scene import Scene, render, sample_scene
from .vocabulary import (
    BACKGROUND_KINDS,
    CATEGORIES,
    CATEGORY_BY_NAME,
    CATEGORY_NAMES,
    COLOURS,
    SIZES,
    VCR_OBJECT_NAME,
    coco_categories,
)

log = get_logger(__name__)

REQUIRED_KEYS = ("image_size", "cc_images", "broken_link_fraction", "books_sentences", "wiki_pages",
                 "vqa_images", "vqa_questions_per_image", "vcr_images", "vcr_questions_per_image",
                 "refcoco_images", "detector_images")
# Optional world keys and their defaults (the released config may leave them out).
OPTIONAL_DEFAULTS = {
    "objects_per_scene": [2, 6],
    "jpeg_quality": 90,
    "refcoco_refs_per_image": 3,
    "vqa_disagreement": 0.3,
    "vcr_images_per_movie": 20,
    # Categories no VQA training question or answer names; captions, books and wiki still do, and VQA val asks about
    # them as often as about any other: the "held-out concepts" column (docs/default-run.md). The last two of the
    # vocabulary, fixed before any measurement.
    "vqa_held_out_categories": ["diamond", "ring"],
}


@dataclass(frozen=True)
class WorldSettings:
    """The config's `world:` section, typed (the optional keys filled from OPTIONAL_DEFAULTS)."""

    image_size: int
    cc_images: dict
    broken_link_fraction: float
    books_sentences: int
    wiki_pages: int
    vqa_images: dict
    vqa_questions_per_image: int
    vcr_images: dict
    vcr_questions_per_image: int
    refcoco_images: dict
    detector_images: dict
    objects_per_scene: tuple[int, int]
    jpeg_quality: int
    refcoco_refs_per_image: int
    vqa_disagreement: float
    vcr_images_per_movie: int
    vqa_held_out_categories: tuple[str, ...]
    flickr_images: dict | None = None


REQUIRED_SOURCES = {
    "books": None, "wiki": None,
    "vqa": ("questions", "annotations", "images"),
    "vcr": ("annotations", "images"),
    "refcoco": ("refs", "instances", "images"),
    "detector": ("annotations", "images"),
}
REFCOCO_PERSON_SHARE = 0.35  # train/val images built around people, so testA's kind of ref is learnt


def cc_image_dir(tsv_path: str, split: str) -> Path:
    """Where the CC images of a split live: `images/{split}/` beside the TSV that links to them."""
    return Path(tsv_path).parent / "images" / split


# ---------------------------------------------------------------- seeding

def _digest(seed: int, purpose: tuple) -> bytes:
    return hashlib.sha256(repr((int(seed),) + tuple(purpose)).encode("utf-8")).digest()


def np_rng(seed: int, *purpose) -> np.random.Generator:
    """A numpy Generator for one purpose, independent of every other purpose's stream."""
    return np.random.default_rng(np.frombuffer(_digest(seed, purpose), dtype=np.uint32))


def py_rng(seed: int, *purpose) -> random.Random:
    return random.Random(int.from_bytes(_digest(seed, purpose), "big"))


# ---------------------------------------------------------------- config checks

def _check_config(cfg: dict, sources: dict) -> WorldSettings:
    missing = [k for k in REQUIRED_KEYS if k not in cfg]
    if missing:
        raise KeyError(f"config world: missing key(s) {missing}")
    cfg = {**OPTIONAL_DEFAULTS, **cfg}
    for key in ("cc_images", "vqa_images", "vcr_images", "refcoco_images", "detector_images"):
        value = cfg[key]
        if not isinstance(value, dict) or not all(isinstance(n, int) and n >= 0 for n in value.values()):
            raise ValueError(f"config world.{key}: expected a mapping split -> image count >= 0, got {value!r}")
    for key in ("books_sentences", "wiki_pages", "vqa_questions_per_image", "vcr_questions_per_image",
                "refcoco_refs_per_image", "vcr_images_per_movie"):
        if not isinstance(cfg[key], int) or cfg[key] < 1:
            raise ValueError(f"config world.{key}: expected an integer >= 1, got {cfg[key]!r}")
    settings = WorldSettings(**read_fields(WorldSettings, cfg, "world"))
    if not 0.0 <= settings.broken_link_fraction < 1.0:
        raise ValueError(f"config world.broken_link_fraction: expected 0 <= f < 1, got {cfg['broken_link_fraction']!r}")
    if not 0.0 <= settings.vqa_disagreement <= 1.0:
        raise ValueError(f"config world.vqa_disagreement: expected 0 <= p <= 1, got {cfg['vqa_disagreement']!r}")
    lo, hi = settings.objects_per_scene
    if not 2 <= lo <= hi:
        raise ValueError(f"config world.objects_per_scene: expected [lo, hi] with 2 <= lo <= hi, got {[lo, hi]}")
    held_out = settings.vqa_held_out_categories
    if not all(c in CATEGORY_BY_NAME for c in held_out):
        raise ValueError(f"config world.vqa_held_out_categories: expected a list of the world's categories "
                         f"{list(CATEGORY_NAMES)}, got {held_out!r}")
    if len(set(held_out)) == len(CATEGORY_NAMES):
        raise ValueError("config world.vqa_held_out_categories: holds out every category; VQA training would "
                         "have no question about an object's kind")
    unknown = set(cfg["refcoco_images"]) - {"train", "val", "testA", "testB"}
    if unknown:
        raise ValueError(f"config world.refcoco_images: unknown split(s) {sorted(unknown)}; "
                         "RefCOCO+ (UNC) has train, val, testA, testB")

    for split in cfg["cc_images"]:
        if split not in sources.get("cc", {}):
            raise KeyError(f"config sources.cc: no TSV path for split {split!r} listed in world.cc_images")
    for name, keys in REQUIRED_SOURCES.items():
        if name not in sources:
            raise KeyError(f"config sources: missing {name!r}")
        for key in keys or ():
            if key not in sources[name]:
                raise KeyError(f"config sources.{name}: missing {key!r}")
    for name, key in (("vqa", "questions"), ("vqa", "annotations"), ("vqa", "images"), ("vcr", "annotations"),
                      ("detector", "annotations")):
        if "{split}" not in sources[name][key]:
            raise ValueError(f"config sources.{name}.{key}: {sources[name][key]!r} needs a {{split}} placeholder")
    return settings


# ---------------------------------------------------------------- the generator

class _World:
    def __init__(self, cfg: WorldSettings, sources: dict, out_root: Path, seed: int):
        self.cfg = cfg
        self.sources = sources
        self.out_root = out_root
        self.seed = seed
        self.size = cfg.image_size
        self.quality = cfg.jpeg_quality
        self.num_objects = cfg.objects_per_scene
        self.stats = WorldStats()
        self.counts: dict = {}
        # VQA and RefCOCO+ images share the COCO id space (train2014 holds both), so one counter.
        self.next_coco_image_id = 1

    def path(self, template: str, **fields) -> Path:
        p = Path(template.format(**fields) if fields else template)
        return p if p.is_absolute() else self.out_root / p

    def scene(self, *purpose, required: tuple[str, ...] = ()) -> Scene:
        return sample_scene(np_rng(self.seed, *purpose), self.size, self.num_objects, required)

    def progress(self, n: int, desc: str):
        return Progress(range(n), desc=desc, unit="img", mininterval=2.0, leave=False)

    # -- Conceptual Captions
    def cc(self) -> None:
        frac = self.cfg.broken_link_fraction
        self.counts["cc"] = {}
        for split, n in self.cfg.cc_images.items():
            tsv = self.path(self.sources["cc"][split])
            image_dir = self.path(str(cc_image_dir(self.sources["cc"][split], split)))
            broken = set(py_rng(self.seed, "cc", split, "broken").sample(range(n), round(n * frac)))
            rows = []
            for i in self.progress(n, f"cc {split}"):
                scene = self.scene("cc", split, i)
                caption = cc_caption(scene, py_rng(self.seed, "cc", split, i, "text"))
                image_path = image_dir / f"{i:07d}.jpg"
                if i in broken:
                    # A dead link: the URL names a file that is never written (and not left over).
                    image_path.unlink(missing_ok=True)
                else:
                    formats.save_jpeg(render(scene), image_path, self.quality)
                rows.append((caption, image_path.resolve().as_uri()))
                self.stats.add(scene)
            formats.write_cc_tsv(tsv, rows)
            self.counts["cc"][split] = {"rows": n, "images": n - len(broken), "broken_links": len(broken)}
            log.info("cc %s: %d rows (%d dead links) -> %s", split, n, len(broken), tsv)

    # -- BooksCorpus
    def books(self) -> None:
        n = self.cfg.books_sentences
        lines = []
        for i in Progress(range(n), desc="books", unit="sent", mininterval=2.0, leave=False):
            scene = self.scene("books", i)
            lines.append(book_sentence(scene, py_rng(self.seed, "books", i, "text")))
        path = self.path(self.sources["books"])
        formats.write_books(path, lines)
        self.counts["books"] = {"sentences": n}
        log.info("books: %d sentences -> %s", n, path)

    # -- Wikipedia
    def wiki(self) -> None:
        n = self.cfg.wiki_pages
        topics = wiki_topics()[:n]
        topics += [("scene", k + 1) for k in range(n - len(topics))]
        pages: list[formats.WikiPage] = []
        for topic in topics:
            scene = self.scene("wiki", "scene", topic[1]) if topic[0] == "scene" else None
            title, text = wiki_article(topic, self.stats, py_rng(self.seed, "wiki", repr(topic)), scene)
            pages.append(formats.WikiPage(len(pages) + 1, title, 0, text))
        titles = {p.title for p in pages}
        redirects = [(c.plural.capitalize(), c.name.capitalize()) for c in CATEGORIES if c.name.capitalize() in titles]
        if not redirects:
            redirects = [(f"{pages[0].title} (disambiguation)", pages[0].title)]
        for source, target in redirects:
            pages.append(formats.WikiPage(len(pages) + 1, source, 0, f"#REDIRECT [[{target}]]", redirect=target))
        pages.append(formats.WikiPage(len(pages) + 1, "Template:Infobox shape", 10, _INFOBOX_TEMPLATE))
        pages.append(formats.WikiPage(len(pages) + 1, "Wikipedia:About the synthetic world", 4, _PROJECT_PAGE))
        path = self.path(self.sources["wiki"])
        formats.write_wiki_dump(path, pages)
        self.counts["wiki"] = {"articles": n, "redirects": len(redirects), "other_namespace_pages": 2}
        log.info("wiki: %d articles, %d redirects -> %s", n, len(redirects), path)

    # -- VQA v2
    def vqa(self) -> None:
        k = self.cfg.vqa_questions_per_image
        disagreement = self.cfg.vqa_disagreement
        self.counts["vqa"] = {}
        for split, n in self.cfg.vqa_images.items():
            unasked = self.cfg.vqa_held_out_categories if split == "train" else ()
            image_dir = self.path(self.sources["vqa"]["images"], split=split)
            subtype = f"{split}2014"
            questions, annotations = [], []
            answer_types: Counter = Counter()
            for i in self.progress(n, f"vqa {split}"):
                image_id = self.next_coco_image_id
                self.next_coco_image_id += 1
                scene, rng, asked = self._with_questions("vqa", split, i,
                                                         lambda s, r: vqa_questions(s, r, k, unasked), k)
                formats.save_jpeg(render(scene), image_dir / f"COCO_{subtype}_{image_id:012d}.jpg", self.quality)
                for q_index, q in enumerate(asked):
                    question_id = image_id * 1000 + q_index
                    answers = vqa_answers(q, rng, disagreement)
                    # most_common is stable on ties, so the first (true) answer wins a tie.
                    majority = Counter(answers).most_common(1)[0][0]
                    questions.append({"image_id": image_id, "question": q.question, "question_id": question_id})
                    annotations.append({
                        "question_id": question_id, "image_id": image_id, "question_type": q.question_type,
                        "answer_type": q.answer_type, "multiple_choice_answer": majority,
                        "answers": [{"answer": a, "answer_confidence": "yes" if a == q.answer else "maybe",
                                     "answer_id": j + 1} for j, a in enumerate(answers)],
                    })
                    answer_types[q.answer_type] += 1
            info = {"description": "VQA v2-format questions about the synthetic world", "version": "2.0",
                    "year": 2020, "contributor": "vlbert_core.world"}
            license_ = {"name": "synthetic, no restrictions", "url": ""}
            formats.write_json(self.path(self.sources["vqa"]["questions"], split=split), {
                "info": info, "license": license_, "task_type": "Open-Ended", "data_type": "mscoco",
                "data_subtype": subtype, "questions": questions})
            formats.write_json(self.path(self.sources["vqa"]["annotations"], split=split), {
                "info": info, "license": license_, "data_type": "mscoco", "data_subtype": subtype,
                "annotations": annotations})
            self.counts["vqa"][split] = {"images": n, "questions": len(questions), "answer_types": dict(answer_types),
                                         "unasked_categories": list(unasked)}
            log.info("vqa %s: %d images, %d questions", split, n, len(questions))

    def _with_questions(self, dataset: str, split: str, i: int, ask, k: int):
        """The first layout of image i that supports k distinct questions: (scene, text rng, questions)."""
        for attempt in range(50):
            scene = self.scene(dataset, split, i, attempt)
            rng = py_rng(self.seed, dataset, split, i, attempt, "text")
            questions = ask(scene, rng)
            if len(questions) == k:
                return scene, rng, questions
        raise RuntimeError(f"{dataset} {split} image {i}: no layout in 50 supports {k} distinct questions; "
                           f"lower world.{dataset}_questions_per_image")

    # -- VCR
    def vcr(self) -> None:
        k = self.cfg.vcr_questions_per_image
        per_movie = self.cfg.vcr_images_per_movie
        image_root = self.path(self.sources["vcr"]["images"])
        movie_number = 0
        self.counts["vcr"] = {}
        for split, n in self.cfg.vcr_images.items():
            rows: list[dict] = []
            movie = ""
            kinds: Counter = Counter()
            for i in self.progress(n, f"vcr {split}"):
                if i % per_movie == 0:
                    # Movies never straddle splits, as in VCR.
                    movie_number += 1
                    movie = f"{1000 + movie_number}_Synthetic_World_Reel_{movie_number}"
                scene, rng, items = self._with_questions("vcr", split, i, lambda s, r: vcr_items(s, r, k), k)
                stem = f"{movie}/{movie}_shot_{i % per_movie:03d}@0"
                formats.save_jpeg(render(scene), image_root / f"{stem}.jpg", self.quality)
                formats.write_json(image_root / f"{stem}.json", formats.vcr_metadata(scene))
                names = [VCR_OBJECT_NAME] * len(scene.objects)
                for q_number, item in enumerate(items):
                    row_index = len(rows)
                    rows.append(_vcr_row(item, split, movie, stem, names, i, q_number, row_index, n * k, rng))
                    kinds[item.kind] += 1
            path = self.path(self.sources["vcr"]["annotations"], split=split)
            formats.write_jsonl(path, rows)
            self.counts["vcr"][split] = {"images": n, "questions": len(rows), "kinds": dict(kinds)}
            log.info("vcr %s: %d images, %d questions -> %s", split, n, len(rows), path)

    # -- RefCOCO+
    def refcoco(self) -> None:
        per_image = self.cfg.refcoco_refs_per_image
        image_dir = self.path(self.sources["refcoco"]["images"])
        refs, images, annotations = [], [], []
        ref_id = sent_id = 0
        self.counts["refcoco"] = {}
        for split, n in self.cfg.refcoco_images.items():
            split_refs = 0
            for i in self.progress(n, f"refcoco {split}"):
                image_id = self.next_coco_image_id
                self.next_coco_image_id += 1
                scene, chosen = self._refcoco_scene(split, i, per_image)
                file_name = f"COCO_train2014_{image_id:012d}.jpg"
                formats.save_jpeg(render(scene), image_dir / file_name, self.quality)
                images.append(formats.coco_image(image_id, file_name, scene))
                first_ann = len(annotations) + 1
                annotations += [formats.coco_annotation(first_ann + j, image_id, o) for j, o in enumerate(scene.objects)]
                for target, expressions in chosen:
                    sentences = []
                    for text in expressions:
                        sentences.append({"tokens": text.split(), "raw": _raw_form(text, ref_id + sent_id),
                                          "sent_id": sent_id, "sent": text})
                        sent_id += 1
                    ann_id = first_ann + target
                    refs.append({
                        "ref_id": ref_id, "ann_id": ann_id, "image_id": image_id, "split": split,
                        "sentences": sentences, "sent_ids": [s["sent_id"] for s in sentences],
                        "category_id": CATEGORY_BY_NAME[scene.objects[target].category].id,
                        # The published refs name the file with an extra suffix; loaders look the
                        # image up by image_id in instances.json.
                        "file_name": f"COCO_train2014_{image_id:012d}_{ann_id}.jpg",
                    })
                    ref_id += 1
                    split_refs += 1
            self.counts["refcoco"][split] = {"images": n, "refs": split_refs}
            log.info("refcoco+ %s: %d images, %d refs", split, n, split_refs)
        formats.write_pickle(self.path(self.sources["refcoco"]["refs"]), refs)
        formats.write_json(self.path(self.sources["refcoco"]["instances"]),
                           formats.coco_instances(images, annotations, "RefCOCO+ images of the synthetic world"))
        self.counts["refcoco"]["sentences"] = sent_id

    def _refcoco_scene(self, split: str, i: int, per_image: int) -> tuple[Scene, list[tuple[int, list[str]]]]:
        """A scene built around two objects of one category, and up to `per_image` refs in it.

        testA refers to people only, testB to other objects only (the UNC RefCOCO+ split rule).
        """
        for attempt in range(100):
            pick = py_rng(self.seed, "refcoco", split, i, attempt, "layout")
            if split == "testA" or (split not in ("testA", "testB") and pick.random() < REFCOCO_PERSON_SHARE):
                focus = "person"
            else:
                focus = pick.choice(CATEGORY_NAMES[1:])
            scene = self.scene("refcoco", split, i, attempt, required=(focus, focus))
            rng = py_rng(self.seed, "refcoco", split, i, attempt, "text")
            eligible = [j for j, o in enumerate(scene.objects)
                        if (split != "testA" or o.category == "person") and (split != "testB" or o.category != "person")]
            repeated = Counter(o.category for o in scene.objects)
            # Refs to objects that share their category need more than the name: prefer those.
            eligible.sort(key=lambda j: (repeated[scene.objects[j].category] < 2, rng.random()))
            chosen = []
            for j in eligible:
                expressions = pick_expressions(referring_expressions(scene, j, rng), rng)
                if expressions:
                    chosen.append((j, expressions))
                if len(chosen) == per_image:
                    break
            if chosen:
                return scene, sorted(chosen)
        raise RuntimeError(f"refcoco {split} image {i}: no scene with a referable object in 100 layouts")

    # -- detector training data
    def detector(self) -> None:
        image_id = 0
        self.counts["detector"] = {}
        for split, n in self.cfg.detector_images.items():
            image_dir = self.path(self.sources["detector"]["images"], split=split)
            images, annotations = [], []
            for i in self.progress(n, f"detector {split}"):
                image_id += 1
                scene = self.scene("detector", split, i)
                file_name = f"{split}_{image_id:07d}.jpg"
                formats.save_jpeg(render(scene), image_dir / file_name, self.quality)
                images.append(formats.coco_image(image_id, file_name, scene))
                first_ann = len(annotations) + 1
                annotations += [formats.coco_annotation(first_ann + j, image_id, o, with_attributes=True)
                                for j, o in enumerate(scene.objects)]
            path = self.path(self.sources["detector"]["annotations"], split=split)
            formats.write_json(path, formats.coco_instances(images, annotations, f"detector {split} images",
                                                            with_attributes=True))
            self.counts["detector"][split] = {"images": n, "objects": len(annotations)}
            log.info("detector %s: %d images, %d objects -> %s", split, n, len(annotations), path)


def _vcr_row(item, split: str, movie: str, stem: str, names: list[str], image_index: int, q_number: int,
             row_index: int, rows_in_split: int, rng: random.Random) -> dict:
    def provenance(label: int) -> tuple[list[int], list[int]]:
        # VCR's wrong choices come from other questions by adversarial matching; `sources` name
        # those questions and `match_iter` the matching round. Here: random other rows.
        others = [r for r in rng.sample(range(max(rows_in_split, 4)), 4) if r != row_index][:3]
        sources = others[:label] + [row_index] + others[label:]
        rounds = [1, 2, 3]
        rng.shuffle(rounds)
        return sources, rounds[:label] + [0] + rounds[label:]

    answer_sources, answer_iter = provenance(item.answer_label)
    rationale_sources, rationale_iter = provenance(item.rationale_label)
    return {
        "movie": movie,
        "objects": names,
        "interesting_scores": [],
        "answer_likelihood": "likely",
        "img_fn": f"{stem}.jpg",
        "metadata_fn": f"{stem}.json",
        "question": item.question,
        "answer_choices": item.answer_choices,
        "answer_label": item.answer_label,
        "rationale_choices": item.rationale_choices,
        "rationale_label": item.rationale_label,
        "question_orig": detokenise(item.question, names),
        "answer_orig": detokenise(item.answer_choices[item.answer_label], names),
        "rationale_orig": detokenise(item.rationale_choices[item.rationale_label], names),
        "answer_sources": answer_sources,
        "answer_match_iter": answer_iter,
        "rationale_sources": rationale_sources,
        "rationale_match_iter": rationale_iter,
        "img_id": f"{split}-{image_index}",
        "question_number": q_number,
        "annot_id": f"{split}-{row_index}",
        "match_fold": f"{split}-{image_index % 4}",
        "match_index": row_index,
    }


def _raw_form(sentence: str, salt: int) -> str:
    """RefCOCO+ keeps what the annotator typed in `raw`: some capitalise, some shout, some add a stop."""
    style = salt % 4
    if style == 1:
        return sentence.capitalize()
    if style == 2:
        return sentence.upper()
    if style == 3:
        return sentence + "."
    return sentence


_INFOBOX_TEMPLATE = """{| class="infobox"
|+ {{{name|{{PAGENAME}}}}}
|-
| [[File:{{{image|}}}|200px]]
|-
! Category id
| {{{category_id|}}}
|-
! Sizes
| {{{sizes|}}}
|}<noinclude>
This template summarises one kind of object of the [[synthetic world]].
[[Category:Infobox templates]]
</noinclude>"""

_PROJECT_PAGE = """This project page explains how articles about the [[synthetic world]] are written.
== Scope ==
Articles describe the kinds of objects, their colours and the backgrounds they are drawn on.
[[Category:Wikipedia projects]]"""


def generate_world(cfg: dict, sources: dict, out_root: Path, seed: int,
                   summary_path: Path | None = None) -> dict:
    """Write the whole synthetic world and return its summary (also written to `summary_path`).

    `cfg` is the config's `world:` section, `sources` the `sources:` section; relative paths in
    both resolve against `out_root` (the Snakemake working directory). CC images go next to
    each TSV, in `images/{split}/`.
    """
    cfg = _check_config(cfg, sources)
    world = _World(cfg, sources, Path(out_root), int(seed))
    log.info("generating the synthetic world (seed %d, %dpx) under %s", seed, world.size, Path(out_root).resolve())
    world.cc()          # first: the wiki articles quote statistics of the captioned pictures
    world.books()
    world.wiki()
    world.vqa()
    world.vcr()
    world.refcoco()
    world.detector()
    if "flickr30k" in sources:  # optional: caption-based image retrieval (vlbert_core/world/flickr.py)
        world.counts["flickr30k"] = write_flickr30k(world, cfg.flickr_images, sources["flickr30k"], py_rng)
    summary = {
        "seed": int(seed),
        "image_size": world.size,
        "categories": coco_categories(),
        "colours": {name: list(rgb) for name, rgb in COLOURS.items()},
        "sizes": {name: list(r) for name, r in SIZES.items()},
        "backgrounds": list(BACKGROUND_KINDS),
        "objects_per_scene": list(world.num_objects),
        "counts": world.counts,
        "cc_image_dirs": {split: str(cc_image_dir(sources["cc"][split], split)) for split in cfg.cc_images},
    }
    if summary_path is not None:
        path = Path(summary_path)
        formats.write_json(path if path.is_absolute() else world.out_root / path, summary, indent=2)
    log.info("synthetic world done: %s", {k: v for k, v in world.counts.items()})
    return summary
