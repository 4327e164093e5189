"""All the text of the synthetic world, generated from scenes so that language depends on vision.

Every statement made about a scene is true of the objects drawn in it: captions list exactly the
objects present, VQA questions are asked only when their answer is unique, VCR correct answers
and rationales are visual facts (and the wrong ones are false), referring expressions match
exactly one object. Randomness comes from the `random.Random` passed in.
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, field

from .scene import Scene, SceneObject, clearly_bigger, is_above, nearest_object
from .vocabulary import (
    BACKGROUND_KINDS,
    BACKGROUND_WORDS,
    CATEGORIES,
    CATEGORY_BY_NAME,
    CATEGORY_NAMES,
    COLOUR_NAMES,
    SIZES,
    indefinite_article,
    neighbouring_colours,
    number_word,
    plural,
    with_article,
)

SIZE_WORDS = {"small": ("small", "little"), "large": ("large", "big")}


def _phrase(obj: SceneObject, size: bool = True, colour: bool = True, noun: str | None = None) -> str:
    words = ([obj.size] if size else []) + ([obj.colour] if colour else []) + [noun or obj.category]
    return " ".join(words)


def _counted(n: int, adjectives: tuple[str, ...], category: str) -> str:
    words = " ".join((*adjectives, category if n == 1 else plural(category)))
    return with_article(words) if n == 1 else f"{number_word(n)} {words}"


def _join(items: list[str]) -> str:
    if len(items) == 1:
        return items[0]
    return ", ".join(items[:-1]) + " and " + items[-1]


def _capitalise(text: str) -> str:
    return text[:1].upper() + text[1:]


# ---------------------------------------------------------------- Conceptual Captions

_CAPTION_TEMPLATES = (
    "{objs} on {bg} background",
    "{objs}",
    "{bg} background with {objs}",
    "a picture of {objs}",
    "{objs} against {bg} backdrop",
    "{count} objects on {bg} background: {objs}",
    "illustration of {objs} on {bg} background",
)


def cc_caption(scene: Scene, rng: random.Random) -> str:
    """A Conceptual-Captions-style caption naming every object drawn (counts, attributes, maybe a relation)."""
    attributes = rng.choice([("size", "colour"), ("size", "colour"), ("colour",), ("size",), ()])
    groups: dict[tuple[str, ...], list[int]] = {}
    for i, obj in enumerate(scene.objects):
        key = tuple(getattr(obj, a) for a in attributes) + (obj.category,)
        groups.setdefault(key, []).append(i)
    phrase_of = {key: _counted(len(ids), key[:-1], key[-1]) for key, ids in groups.items()}
    parts = list(phrase_of.values())
    relation = _caption_relation(scene, groups, phrase_of, rng) if rng.random() < 0.45 else None
    if relation is not None:
        text, used = relation
        rest = [phrase_of[k] for k in groups if k not in used]
        objs = text if not rest else f"{text}, with {_join(rest)}"
    else:
        rng.shuffle(parts)
        objs = _join(parts)
    bg = with_article(rng.choice(BACKGROUND_WORDS[scene.background.kind]))
    template = rng.choice(_CAPTION_TEMPLATES)
    return template.format(objs=objs, bg=bg, count=number_word(len(scene.objects)))


def _caption_relation(scene, groups, phrase_of, rng) -> tuple[str, set] | None:
    singles = [(key, ids[0]) for key, ids in groups.items() if len(ids) == 1]
    pairs = [(a, b) for a in singles for b in singles if a[1] != b[1]]
    rng.shuffle(pairs)
    for (key_a, a), (key_b, b) in pairs:
        obj_a, obj_b = scene.objects[a], scene.objects[b]
        if nearest_object(scene, a) == b:
            word = rng.choice(["next to", "beside", "near"])
        elif is_above(obj_a, obj_b):
            word = "above"
        elif is_above(obj_b, obj_a):
            word = "below"
        else:
            continue
        return f"{phrase_of[key_a]} {word} {phrase_of[key_b]}", {key_a, key_b}
    return None


# ---------------------------------------------------------------- BooksCorpus

_ACTIVITIES = ("rolling slowly across the {bg} floor", "counting the stripes on the far wall",
               "humming quietly to itself", "watching the other shapes with great suspicion",
               "practising its sharpest corners", "waiting for the light to change")
_REASONS = ("it believed that every {colour} thing deserved at least one friend",
            "the {b} had promised to stay close until the evening",
            "nobody had ever told it that {plural} could not dance",
            "it was afraid of being mistaken for {confusable}")
_REACTIONS = ("blushed a deeper shade of {colour}", "pretended to be very busy with something else",
              "moved a little closer without saying a word",
              "began a long story about the day it was first drawn")
_CLAIMS = ("{colour} was the only colour worth wearing", "the {bg} background had been chosen just for it",
           "{plural} were the oldest shapes in the whole world", "it had been painted before all the others")
_QUALITIES = ("brighter", "more important", "better at keeping still", "older")


def book_sentence(scene: Scene, rng: random.Random) -> str:
    """One long narrative sentence with subordinate clauses; the facts it states hold in `scene`."""
    a_i, b_i = rng.sample(range(len(scene.objects)), 2)
    a, b = scene.objects[a_i], scene.objects[b_i]
    others = [o for k, o in enumerate(scene.objects) if k not in (a_i, b_i)]
    bg = rng.choice(BACKGROUND_WORDS[scene.background.kind])
    if clearly_bigger(a, b):
        comparison = "much bigger than"
    elif clearly_bigger(b, a):
        comparison = "much smaller than"
    else:
        comparison = "roughly as big as"
    near = nearest_object(scene, a_i) == b_i
    where = "standing right next to it" if near else "waiting on the other side of the picture"
    slots = {
        "a": _phrase(a), "b": _phrase(b), "bg": bg, "colour": a.colour, "plural": plural(a.category),
        "confusable": with_article(CATEGORY_BY_NAME[a.category].confusable[0]),
    }

    def fill(options: tuple[str, ...]) -> str:
        return rng.choice(options).format(**slots)

    same_colour = sum(o.colour == a.colour for o in scene.objects)
    templates = [
        lambda: f"although the {slots['a']} was {comparison} the {slots['b']} , it spent the whole "
                f"afternoon {fill(_ACTIVITIES)} , because {fill(_REASONS)} .",
        lambda: f"when the {slots['a']} finally noticed that the {slots['b']} was {where} , it "
                f"{fill(_REACTIONS)} , and the {bg} background seemed to grow quieter around them .",
        lambda: f"there were {number_word(len(scene.objects))} shapes in the picture that morning , and "
                f"although {number_word(same_colour)} of them {'was' if same_colour == 1 else 'were'} "
                f"{a.colour} , the {slots['a']} insisted that {fill(_CLAIMS)} .",
        lambda: f"long after the light over the {bg} background had faded , the {slots['a']} and the "
                f"{slots['b']} were still arguing about which of them was {rng.choice(_QUALITIES)} , while "
                + (f"the {_phrase(others[0])} pretended to be asleep ." if others
                   else "nobody else was there to settle the matter ."),
        lambda: f"if the {slots['a']} had known how patient the {slots['b']} could be , it would never have "
                f"left its place on the {bg} ground , but nobody in the picture had ever thought to warn it .",
        lambda: f"the {slots['a']} , which had always been proud of its {a.colour} paint , turned towards "
                f"the {slots['b']} as soon as it realised that the other one was {comparison} itself .",
        lambda: f"because the {slots['b']} was {'so close' if near else 'so far away'} , the {slots['a']} "
                f"kept {fill(_ACTIVITIES)} until the light over the {bg} background began to fade .",
        lambda: f"nobody could remember who had painted the {_phrase(a, colour=False)} {a.colour} , but everyone "
                f"agreed that it looked {'handsome' if near else 'lonely'} so "
                f"{'close to' if near else 'far from'} the {slots['b']} , especially when the evening came .",
    ]
    # BooksCorpus text is lower-cased and tokenised (punctuation split off), and so is this.
    return rng.choice(templates)()


# ---------------------------------------------------------------- Wikipedia

@dataclass
class WorldStats:
    """Counts over the scenes of the captioned collection; the wiki articles quote them."""

    images: int = 0
    objects: Counter = field(default_factory=Counter)          # (category, colour, size) -> objects
    images_with: Counter = field(default_factory=Counter)      # category -> images containing one
    backgrounds: Counter = field(default_factory=Counter)      # background kind -> images

    def add(self, scene: Scene) -> None:
        self.images += 1
        self.backgrounds[scene.background.kind] += 1
        for obj in scene.objects:
            self.objects[(obj.category, obj.colour, obj.size)] += 1
        for category in {o.category for o in scene.objects}:
            self.images_with[category] += 1

    def count(self, category: str | None = None, colour: str | None = None, size: str | None = None) -> int:
        return sum(n for (c, k, s), n in self.objects.items()
                   if category in (None, c) and colour in (None, k) and size in (None, s))


def wiki_topics() -> list[tuple]:
    """Article topics in a fixed order; scene articles extend the list as far as needed."""
    topics: list[tuple] = [("category", c) for c in CATEGORY_NAMES]
    topics += [("colour", k) for k in COLOUR_NAMES]
    topics += [("background", b) for b in BACKGROUND_KINDS]
    topics += [("colour_category", k, c) for c in CATEGORY_NAMES for k in COLOUR_NAMES]
    topics += [("size_category", s, c) for c in CATEGORY_NAMES for s in SIZES]
    return topics


def wiki_title(topic: tuple) -> str:
    kind = topic[0]
    if kind in ("category", "colour"):
        return _capitalise(topic[1])
    if kind == "background":
        return f"{_capitalise(BACKGROUND_WORDS[topic[1]][0])} background"
    if kind in ("colour_category", "size_category"):
        return _capitalise(f"{topic[1]} {topic[2]}")
    if kind == "scene":
        return f"Scene {topic[1]} (synthetic world)"
    raise ValueError(f"unknown wiki topic {topic!r}")


def _cite(rng: random.Random) -> str:
    source = rng.choice(["Census of the synthetic world", "Annual report of the shape society",
                         "A field guide to flat objects"])
    return f"<ref>{{{{cite book |title={source} |year={2000 + rng.randrange(20)} |page={rng.randrange(1, 300)}}}}}</ref>"


def wiki_article(topic: tuple, stats: WorldStats, rng: random.Random, scene: Scene | None = None) -> tuple[str, str]:
    """(title, wikitext) of one namespace-0 article, with an infobox, refs, links, a table, a File link."""
    title = wiki_title(topic)
    kind = topic[0]
    if kind == "category":
        body = _category_article(topic[1], stats, rng)
    elif kind == "colour":
        body = _colour_article(topic[1], stats, rng)
    elif kind == "background":
        body = _background_article(topic[1], stats, rng)
    elif kind == "colour_category":
        body = _combination_article(topic[2], stats, rng, colour=topic[1])
    elif kind == "size_category":
        body = _combination_article(topic[2], stats, rng, size=topic[1])
    elif kind == "scene":
        if scene is None:
            raise ValueError(f"wiki topic {topic!r} needs its scene")
        body = _scene_article(topic[1], scene, rng)
    else:
        raise ValueError(f"unknown wiki topic {topic!r}")
    return title, body


def _category_article(name: str, stats: WorldStats, rng: random.Random) -> str:
    cat = CATEGORY_BY_NAME[name]
    counts = {k: stats.count(name, k) for k in COLOUR_NAMES}
    favourite = max(COLOUR_NAMES, key=lambda k: (counts[k], k))
    noun = "A person" if name == "person" else f"A {name}"
    lines = [
        "{{Infobox shape",
        f"| name = {_capitalise(name)}",
        f"| image = {_capitalise(name)} example.jpg",
        f"| category_id = {cat.id}",
        f"| colours = {len(COLOUR_NAMES)}",
        f"| sizes = {', '.join(SIZES)}",
        "}}",
        f"The '''{name}''' is one of the {number_word(len(CATEGORIES))} kinds of [[Shape (synthetic world)|object]] "
        f"that appear in the [[synthetic world]].{_cite(rng)} {noun} {cat.appearance.replace(' ,', ',')}. "
        f"It can be painted in any of the [[Colour (synthetic world)|colours]] of the world, such as "
        f"[[{_capitalise(COLOUR_NAMES[0])}|{COLOUR_NAMES[0]}]] or [[{_capitalise(favourite)}|{favourite}]].",
        "",
        "== Description ==",
        f"[[File:{_capitalise(favourite)} {name}.jpg|thumb|A large {favourite} {name} on a "
        f"{rng.choice(BACKGROUND_WORDS[rng.choice(BACKGROUND_KINDS)])} background.]]",
        f"A small {name} measures between {SIZES['small'][0]} and {SIZES['small'][1]} pixels along its longer side, "
        f"while a large one measures between {SIZES['large'][0]} and {SIZES['large'][1]} pixels.{_cite(rng)} "
        f"People sometimes confuse it with the [[{_capitalise(cat.confusable[0])}|{cat.confusable[0]}]], "
        f"although the two are easy to tell apart when seen up close.",
        "",
        "== Occurrence ==",
        f"Of the {stats.images} captioned pictures, {stats.images_with[name]} contain at least one {name}. "
        f"The most common colour for {plural(name)} is {favourite}, with {counts[favourite]} examples.",
        "",
        "{| class=\"wikitable sortable\"",
        f"|+ {_capitalise(plural(name))} by colour and size",
        "! Colour !! Small !! Large",
    ]
    for k in COLOUR_NAMES:
        lines += ["|-", f"| [[{_capitalise(k)}]] || {stats.count(name, k, 'small')} || {stats.count(name, k, 'large')}"]
    lines += ["|}", "", "== See also ==", *[f"* [[{_capitalise(o)}]]" for o in cat.confusable],
              f"* [[{_capitalise(favourite)} {name}]]", "", "== References ==", "<references />", "",
              "[[Category:Shapes of the synthetic world]]"]
    return "\n".join(lines)


def _colour_article(colour: str, stats: WorldStats, rng: random.Random) -> str:
    left, right = neighbouring_colours(colour)
    counts = {c: stats.count(c, colour) for c in CATEGORY_NAMES}
    commonest = max(CATEGORY_NAMES, key=lambda c: (counts[c], c))
    lines = [
        "{{Infobox colour",
        f"| name = {_capitalise(colour)}",
        f"| neighbours = {left}, {right}",
        "}}",
        f"'''{_capitalise(colour)}''' is one of the {number_word(len(COLOUR_NAMES))} paints of the "
        f"[[synthetic world]].{_cite(rng)} On the colour wheel it lies between [[{_capitalise(left)}|{left}]] "
        f"and [[{_capitalise(right)}|{right}]], and careless observers sometimes mistake one for the other.",
        "",
        "== Use ==",
        f"[[File:{_capitalise(colour)} {commonest}.jpg|thumb|{_capitalise(with_article(f'{colour} {commonest}'))}.]]",
        f"Every kind of object can be {colour}. In the captioned pictures there are {stats.count(colour=colour)} "
        f"{colour} objects, most often {plural(commonest)}.{_cite(rng)} Backgrounds are never painted "
        f"{colour}, because backgrounds use only muted tones.",
        "",
        "{| class=\"wikitable\"",
        f"|+ {_capitalise(colour)} objects by kind",
        "! Kind !! Count",
    ]
    for c in CATEGORY_NAMES:
        lines += ["|-", f"| [[{_capitalise(colour)} {c}|{c}]] || {counts[c]}"]
    lines += ["|}", "", "== References ==", "<references />", "", "[[Category:Colours of the synthetic world]]"]
    return "\n".join(lines)


def _background_article(kind: str, stats: WorldStats, rng: random.Random) -> str:
    words = BACKGROUND_WORDS[kind]
    lines = [
        "{{Infobox background",
        f"| name = {_capitalise(words[0])} background",
        f"| also_called = {', '.join(words[1:])}",
        "}}",
        f"A '''{words[0]} background''' is one of the {number_word(len(BACKGROUND_KINDS))} kinds of ground on which "
        f"the objects of the [[synthetic world]] are drawn.{_cite(rng)} It is also called {words[1]} or "
        f"{words[2]}. Backgrounds never carry objects of their own, and their tones are muted so that every "
        f"[[Colour (synthetic world)|colour]] stands out.",
        "",
        "== Frequency ==",
        f"[[File:{_capitalise(words[0])} background.jpg|thumb|An empty {words[0]} background.]]",
        f"{stats.backgrounds[kind]} of the {stats.images} captioned pictures use it.{_cite(rng)}",
        "",
        "{| class=\"wikitable\"",
        "! Background !! Pictures",
    ]
    for other in BACKGROUND_KINDS:
        lines += ["|-", f"| {BACKGROUND_WORDS[other][0]} || {stats.backgrounds[other]}"]
    lines += ["|}", "", "== References ==", "<references />", "", "[[Category:Backgrounds]]"]
    return "\n".join(lines)


def _combination_article(category: str, stats: WorldStats, rng: random.Random,
                         colour: str | None = None, size: str | None = None) -> str:
    qualifier = colour or size
    name = f"{qualifier} {category}"
    n = stats.count(category, colour, size)
    lines = [
        "{{Short description|" + _capitalise(f"{with_article(name)} in the synthetic world") + "}}",
        f"{_capitalise(indefinite_article(name))} '''{name}''' is {indefinite_article(category)} [[{_capitalise(category)}|{category}]] that is "
        f"{'painted ' + colour if colour else size + ' in size'}.{_cite(rng)} Like every "
        f"{category}, it {CATEGORY_BY_NAME[category].appearance.replace(' ,', ',')}.",
        "",
        "== Occurrence ==",
        f"[[File:{_capitalise(name)}.jpg|thumb|{_capitalise(with_article(name))}.]]",
        f"The captioned pictures contain {n} {name if n == 1 else f'{qualifier} {plural(category)}'}.",
        "",
        "{| class=\"wikitable\"",
    ]
    if colour:
        lines += ["! Size !! Count"]
        for s in SIZES:
            lines += ["|-", f"| {s} || {stats.count(category, colour, s)}"]
    else:
        lines += ["! Colour !! Count"]
        for k in COLOUR_NAMES:
            lines += ["|-", f"| [[{_capitalise(k)}|{k}]] || {stats.count(category, k, size)}"]
    lines += ["|}", "", "== See also ==", f"* [[{_capitalise(category)}]]",
              f"* [[{_capitalise(qualifier)}]]" if colour else "* [[Size (synthetic world)]]",
              "", "== References ==", "<references />", "", f"[[Category:{_capitalise(plural(category))}]]"]
    return "\n".join(lines)


def _scene_article(number: int, scene: Scene, rng: random.Random) -> str:
    bg = BACKGROUND_WORDS[scene.background.kind][0]
    names = [_phrase(o) for o in scene.objects]
    lines = [
        "{{Infobox picture",
        f"| name = Scene {number}",
        f"| objects = {len(scene.objects)}",
        f"| background = {bg}",
        "}}",
        f"'''Scene {number}''' is a picture of the [[synthetic world]] that shows "
        f"{_join([with_article(n) for n in names])} on {with_article(bg)} background.{_cite(rng)}",
        "",
        "== Composition ==",
        f"[[File:Scene {number}.jpg|thumb|Scene {number}, {with_article(bg)} background.]]",
        f"The picture is {scene.width} pixels wide and {scene.height} pixels high.",
        "",
        "{| class=\"wikitable\"",
        "! Object !! Colour !! Size !! Width !! Height",
    ]
    for obj in scene.objects:
        lines += ["|-", f"| [[{_capitalise(obj.category)}]] || {obj.colour} || {obj.size} || {obj.width} || {obj.height}"]
    lines += ["|}", "", "== References ==", "<references />", "", "[[Category:Scenes]]"]
    return "\n".join(lines)


# ---------------------------------------------------------------- VQA v2

@dataclass(frozen=True)
class VqaQuestion:
    question: str
    answer: str
    answer_type: str      # "yes/no" | "number" | "other"
    question_type: str    # the official VQA question-type prefix
    kind: str             # colour | count | yesno | category


def _unique(scene: Scene, predicate) -> int | None:
    matches = [i for i, o in enumerate(scene.objects) if predicate(o)]
    return matches[0] if len(matches) == 1 else None


def _vqa_candidates(scene: Scene, rng: random.Random) -> dict[str, list[VqaQuestion]]:
    objs = scene.objects
    out: dict[str, list[VqaQuestion]] = {"colour": [], "count": [], "yesno": [], "category": []}
    for o in objs:
        if _unique(scene, lambda p, o=o: p.category == o.category) is not None:
            out["colour"].append(VqaQuestion(f"what color is the {o.category}?", o.colour, "other",
                                             "what color is the", "colour"))
        elif _unique(scene, lambda p, o=o: (p.category, p.size) == (o.category, o.size)) is not None:
            out["colour"].append(VqaQuestion(f"what color is the {o.size} {o.category}?", o.colour, "other",
                                             "what color is the", "colour"))
        if _unique(scene, lambda p, o=o: p.colour == o.colour) is not None:
            out["category"].append(VqaQuestion(f"what is the {o.colour} object?", o.category, "other",
                                               "what is the", "category"))
        elif _unique(scene, lambda p, o=o: (p.colour, p.size) == (o.colour, o.size)) is not None:
            out["category"].append(VqaQuestion(f"what kind of object is the {o.size} {o.colour} one?",
                                               o.category, "other", "what kind of", "category"))
    present = Counter(o.category for o in objs)
    for category in CATEGORY_NAMES:
        # Mostly ask about what is there; sometimes the honest answer is 0.
        if present[category] or rng.random() < 0.15:
            out["count"].append(VqaQuestion(f"how many {plural(category)} are there?", str(present[category]),
                                            "number", "how many", "count"))
    for colour, n in Counter(o.colour for o in objs).items():
        out["count"].append(VqaQuestion(f"how many {colour} objects are there?", str(n), "number", "how many", "count"))
    present_pairs = {(o.colour, o.category) for o in objs}
    absent_pairs = [(k, c) for k in COLOUR_NAMES for c in CATEGORY_NAMES if (k, c) not in present_pairs]
    for want_yes in (True, False):
        pool = sorted(present_pairs) if want_yes else rng.sample(absent_pairs, min(4, len(absent_pairs)))
        for colour, category in pool:
            out["yesno"].append(VqaQuestion(f"is there {with_article(f'{colour} {category}')}?",
                                            "yes" if want_yes else "no", "yes/no", "is there a", "yesno"))
    return out


def names_category(q: VqaQuestion, categories: tuple[str, ...]) -> bool:
    """Whether the question or its answer names one of `categories` (singular or plural)."""
    names = {n for c in categories for n in (c, plural(c))}
    return q.answer in names or not names.isdisjoint(q.question.rstrip("?").split())


def vqa_questions(scene: Scene, rng: random.Random, k: int, unasked: tuple[str, ...] = ()) -> list[VqaQuestion]:
    """Up to k distinct questions with unique answers, spread over the question kinds; none names a category of
    `unasked` (the training split's held-out concepts), though the scene may show one."""
    candidates = _vqa_candidates(scene, rng)
    if unasked:
        candidates = {kind: [q for q in pool if not names_category(q, unasked)] for kind, pool in candidates.items()}
    chosen: list[VqaQuestion] = []
    seen: set[str] = set()
    kinds = [kind for kind in candidates if candidates[kind]]
    rng.shuffle(kinds)
    while len(chosen) < k:
        progressed = False
        for kind in kinds:
            if len(chosen) == k:
                break
            pool = [q for q in candidates[kind] if q.question not in seen]
            if kind == "count":
                # Most single objects make "1" the usual count; ask about larger counts when there are any.
                larger = [q for q in pool if q.answer not in ("0", "1")]
                pool = larger if larger and rng.random() < 0.6 else pool
            if kind == "yesno":
                # Balance yes and no: pick the answer first, then a question with that answer.
                answer = rng.choice(["yes", "no"])
                pool = [q for q in pool if q.answer == answer] or pool
            if not pool:
                continue
            q = rng.choice(pool)
            chosen.append(q)
            seen.add(q.question)
            progressed = True
        if not progressed:
            break  # the scene offers fewer than k distinct questions; the caller decides
    return chosen


def _other_answer(q: VqaQuestion, rng: random.Random) -> str:
    if q.kind == "colour":
        return rng.choice(neighbouring_colours(q.answer))
    if q.kind == "count":
        n = int(q.answer)
        # "two" for "2" is the same answer after VQA normalisation; the rest are real mistakes.
        return rng.choice([str(n + 1), number_word(n)] + ([str(n - 1)] if n > 0 else []))
    if q.kind == "yesno":
        return "no" if q.answer == "yes" else "yes"
    return rng.choice([with_article(q.answer), plural(q.answer), *CATEGORY_BY_NAME[q.answer].confusable])


def vqa_answers(q: VqaQuestion, rng: random.Random, disagreement: float = 0.3) -> list[str]:
    """Ten human answers: all correct, except that with probability `disagreement` 1–4 annotators differ."""
    answers = [q.answer] * 10
    if rng.random() < disagreement:
        for position in rng.sample(range(10), rng.randint(1, 4)):
            answers[position] = _other_answer(q, rng)
    return answers


# ---------------------------------------------------------------- VCR

Token = str | list[int]


def _tokens(*parts) -> list[Token]:
    out: list[Token] = []
    for part in parts:
        if isinstance(part, int):
            out.append([part])
        else:
            out.extend(part.split())
    return out


@dataclass(frozen=True)
class VcrItem:
    kind: str
    question: list[Token]
    answer_choices: list[list[Token]]
    answer_label: int
    rationale_choices: list[list[Token]]
    rationale_label: int


def _vcr_colour(scene: Scene, i: int, rng: random.Random):
    obj = scene.objects[i]
    scene_colours = [o.colour for o in scene.objects if o.colour != obj.colour]
    wrong = list(dict.fromkeys(scene_colours))
    rng.shuffle(wrong)
    wrong += [k for k in rng.sample(COLOUR_NAMES, len(COLOUR_NAMES)) if k != obj.colour and k not in wrong]
    answer_form = rng.choice([lambda who, c: _tokens(who, f"is {c} ."),
                              lambda who, c: _tokens(who, f"is painted {c} .")])
    reason_form = rng.choice([lambda who, c: _tokens("The whole of", who, f"is filled with {c} ."),
                              lambda who, c: _tokens(who, f"has the same {c} paint from edge to edge .")])
    question = _tokens("What color is", i, "?")
    answers = [answer_form(i, obj.colour)] + [answer_form(i, k) for k in wrong[:3]]
    liars = [j for j, o in enumerate(scene.objects) if o.colour != obj.colour]
    reasons = [reason_form(i, obj.colour)]
    if liars:
        reasons.append(reason_form(rng.choice(liars), obj.colour))
    reasons += [reason_form(i, k) for k in wrong[: 4 - len(reasons)]]
    return question, answers, reasons


def _vcr_kind(scene: Scene, i: int, rng: random.Random):
    obj = scene.objects[i]
    confusable = list(CATEGORY_BY_NAME[obj.category].confusable)
    rest = [c for c in rng.sample(CATEGORY_NAMES, len(CATEGORY_NAMES)) if c != obj.category and c not in confusable]
    kinds = [obj.category] + (confusable + rest)[:3]
    question = _tokens(rng.choice(["What is", "What kind of object is"]), i, "?")
    answers = [_tokens(i, f"is {with_article(c)} .") for c in kinds]
    reasons = [_tokens(i, f"{CATEGORY_BY_NAME[c].appearance} .") for c in kinds]
    return question, answers, reasons


def _vcr_bigger(scene: Scene, i: int, j: int, rng: random.Random):
    a, b = scene.objects[i], scene.objects[j]
    big, small = (i, j) if clearly_bigger(a, b) else (j, i)
    asks_bigger = rng.random() < 0.5
    question = _tokens("Is", i, "bigger than" if asks_bigger else "smaller than", j, "?")
    truthful = (big == i) == asks_bigger
    yes = _tokens("Yes ,", i, "is bigger than" if asks_bigger else "is smaller than", j, ".")
    no = _tokens("No ,", i, "is smaller than" if asks_bigger else "is bigger than", j, ".")
    answers = [yes, no] if truthful else [no, yes]
    # The wrong choices are the same sentences with the two objects swapped: every choice could be the right
    # answer of some question, and VCR names every object alike (VCR_OBJECT_NAME), so only the referenced
    # RoIs tell them apart.
    answers += [_tokens("Yes ,", j, "is bigger than" if asks_bigger else "is smaller than", i, "."),
                _tokens("No ,", j, "is smaller than" if asks_bigger else "is bigger than", i, ".")]
    reasons = [_tokens(big, "takes up much more of the picture than", small, "."),
               _tokens(small, "takes up much more of the picture than", big, "."),
               _tokens(i, "and", j, "are drawn at exactly the same size ."),
               _tokens("Only", i if rng.random() < 0.5 else j, "can be seen in the picture .")]
    return question, answers, reasons


def _vcr_next_to(scene: Scene, i: int, j: int, rng: random.Random):
    others = [k for k in range(len(scene.objects)) if k not in (i, j)]
    rng.shuffle(others)
    question = _tokens("What is", i, "next to ?")
    if len(others) >= 3:
        answers = [_tokens(i, "is next to", k, ".") for k in [j] + others[:3]]
    else:
        target = scene.objects[j]
        if _unique(scene, lambda o: (o.colour, o.category) == (target.colour, target.category)) is None:
            return None
        names = [f"{target.colour} {target.category}"]
        names += [f"{o.colour} {o.category}" for o in (scene.objects[k] for k in others)]
        present = {(o.colour, o.category) for o in scene.objects}
        absent = [f"{k} {c}" for k in COLOUR_NAMES for c in CATEGORY_NAMES if (k, c) not in present]
        names = list(dict.fromkeys(names))
        names += rng.sample(absent, 4 - len(names))
        answers = [_tokens(i, f"is next to the {n} .") for n in names]
    reasons = [_tokens(k, "is closer to", i, "than anything else in the picture .") for k in [j] + others[:3]]
    fillers = [_tokens("There is nothing else in the picture except", i, "."),
               _tokens(i, "has no other objects around it at all ."),
               _tokens(i, "and", j, "are the same object .")]
    reasons += fillers[: 4 - len(reasons)]
    return question, answers, reasons


def vcr_items(scene: Scene, rng: random.Random, k: int) -> list[VcrItem]:
    """Up to k VCR questions about different objects/relations, each with 4 answers and 4 rationales.

    Fewer than k come back only when the scene offers fewer distinct questions.
    """
    n = len(scene.objects)
    makers = []
    for i in range(n):
        makers.append(("colour", (i,), lambda i=i: _vcr_colour(scene, i, rng)))
        makers.append(("kind", (i,), lambda i=i: _vcr_kind(scene, i, rng)))
        j = nearest_object(scene, i)
        if j is not None:
            makers.append(("next_to", (i,), lambda i=i, j=j: _vcr_next_to(scene, i, j, rng)))
        for j2 in range(n):
            if j2 != i and (clearly_bigger(scene.objects[i], scene.objects[j2])
                            or clearly_bigger(scene.objects[j2], scene.objects[i])):
                makers.append(("bigger", (i, j2), lambda i=i, j2=j2: _vcr_bigger(scene, i, j2, rng)))
    rng.shuffle(makers)
    # Take one item of each kind before repeating a kind, so an image's questions differ in kind.
    by_kind: dict[str, list] = {}
    for m in makers:
        by_kind.setdefault(m[0], []).append(m)
    order = list(by_kind)
    rng.shuffle(order)
    queue = [m for rank in range(max(map(len, by_kind.values()))) for kind in order
             if rank < len(by_kind[kind]) for m in [by_kind[kind][rank]]]
    items: list[VcrItem] = []
    for kind, _objects, make in queue:
        if len(items) == k:
            break
        made = make()
        if made is None:
            continue
        question, answers, reasons = made
        if len({repr(a) for a in answers}) != 4 or len({repr(r) for r in reasons}) != 4:
            raise AssertionError(f"VCR {kind} item has repeated choices: {answers} / {reasons}")
        a_label, r_label = rng.randrange(4), rng.randrange(4)
        items.append(VcrItem(kind, question, _place(answers, a_label, rng), a_label,
                             _place(reasons, r_label, rng), r_label))
    return items


def _place(choices: list, label: int, rng: random.Random) -> list:
    """Shuffle the wrong choices and put the correct one (choices[0]) at position `label`."""
    wrong = choices[1:]
    rng.shuffle(wrong)
    return wrong[:label] + [choices[0]] + wrong[label:]


def detokenise(tokens: list[Token], names: list[str]) -> str:
    """The *_orig text of a VCR field: object references become the object's name and index."""
    words = [" and ".join(f"{names[i]}{i}" for i in t) if isinstance(t, list) else t for t in tokens]
    return " ".join(words).replace(" ?", "?").replace(" .", ".").replace(" ,", ",")


# ---------------------------------------------------------------- RefCOCO+

def _size_word(size: str, rng: random.Random) -> str:
    return rng.choice(SIZE_WORDS[size])


def referring_expressions(scene: Scene, target: int, rng: random.Random) -> list[tuple[str, str]]:
    """All (kind, expression) pairs that pick out exactly object `target`, without location words."""
    objs = scene.objects
    t = objs[target]
    syn = rng.choice(CATEGORY_BY_NAME[t.category].synonyms)
    out: list[tuple[str, str]] = []

    def only_target(predicate) -> bool:
        return _unique(scene, predicate) == target

    if only_target(lambda o: o.category == t.category):
        out += [("category", f"the {syn}"), ("category", syn)]
    if only_target(lambda o: (o.category, o.colour) == (t.category, t.colour)):
        out += [("colour", f"the {t.colour} {syn}"), ("colour", f"{t.colour} {syn}"),
                ("colour", f"the {syn} in {t.colour}" if t.category == "person" else f"the {syn} that is {t.colour}")]
    if only_target(lambda o: (o.category, o.size) == (t.category, t.size)):
        out += [("size", f"the {_size_word(t.size, rng)} {syn}"), ("size", f"{_size_word(t.size, rng)} {syn}")]
    if only_target(lambda o: (o.category, o.size, o.colour) == (t.category, t.size, t.colour)):
        out += [("size_colour", f"the {_size_word(t.size, rng)} {t.colour} {syn}")]
    same = [o for o in objs if o.category == t.category]
    rivals = [o for o in same if o is not t]
    if rivals and all(clearly_bigger(t, o) for o in rivals):
        word = "larger" if len(rivals) == 1 else "largest"
        out += [("comparative", f"the {word} {syn}"), ("comparative", f"{'bigger' if len(rivals) == 1 else 'biggest'} {syn}")]
    if rivals and all(clearly_bigger(o, t) for o in rivals):
        word = "smaller" if len(rivals) == 1 else "smallest"
        out += [("comparative", f"the {word} {syn}"), ("comparative", f"{word} {t.colour} {syn}")]
    # "the red one" is valid whenever the colour is unique, which is often; offering it only
    # sometimes keeps most expressions about the object's kind.
    if only_target(lambda o: o.colour == t.colour) and rng.random() < 0.4:
        out += [("colour_only", f"the {t.colour} one"), ("colour_only", f"{t.colour} thing")]
    near = nearest_object(scene, target)
    if near is not None:
        landmark = _landmark(scene, near)
        if landmark is not None:
            same_near = [k for k, o in enumerate(objs) if o.category == t.category and nearest_object(scene, k) == near]
            if same_near == [target]:
                word = rng.choice(["next to", "near", "beside"])
                out += [("relation", f"the {syn} {word} {landmark}"), ("relation", f"{syn} {word} {landmark}")]
    return out


def _landmark(scene: Scene, index: int) -> str | None:
    """The shortest description that names only object `index` ("the blue circle"), if any."""
    o = scene.objects[index]
    for predicate, words in (
        (lambda p: p.category == o.category, [o.category]),
        (lambda p: (p.category, p.colour) == (o.category, o.colour), [o.colour, o.category]),
        (lambda p: (p.category, p.size, p.colour) == (o.category, o.size, o.colour), [o.size, o.colour, o.category]),
    ):
        if _unique(scene, predicate) == index:
            return "the " + " ".join(words)
    return None


def pick_expressions(candidates: list[tuple[str, str]], rng: random.Random, max_sentences: int = 3) -> list[str]:
    """1..max_sentences distinct expressions, preferring different kinds of description."""
    if not candidates:
        return []
    by_kind: dict[str, list[str]] = {}
    for kind, text in candidates:
        by_kind.setdefault(kind, [])
        if text not in by_kind[kind]:
            by_kind[kind].append(text)
    kinds = list(by_kind)
    rng.shuffle(kinds)
    ordered = [rng.choice(by_kind[kind]) for kind in kinds]
    ordered += [t for kind in kinds for t in by_kind[kind] if t not in ordered]
    ordered = list(dict.fromkeys(ordered))
    return ordered[: rng.randint(1, max_sentences)]
