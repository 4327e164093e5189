"""The fixed vocabulary of the synthetic world: object categories, colours, sizes, backgrounds.

Every COCO-style file the world writes uses the category ids defined here (1..C, in this order),
so the detector, RefCOCO+ and the summary agree on what id 3 means.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Category:
    id: int
    name: str
    plural: str
    supercategory: str
    # Words a person might use for it in a referring expression; the first is the canonical one.
    synonyms: tuple[str, ...]
    # A visual fact that tells this category apart; VCR rationales and wiki articles use it.
    appearance: str
    # Categories a careless annotator might name instead (VQA disagreement).
    confusable: tuple[str, ...]


CATEGORIES: tuple[Category, ...] = (
    Category(1, "person", "people", "person", ("person", "figure", "stick figure"),
             "has a round head , a body , two arms and two legs", ("cross", "star")),
    Category(2, "circle", "circles", "shape", ("circle", "disc", "dot"),
             "is perfectly round and filled in", ("ring", "diamond")),
    Category(3, "square", "squares", "shape", ("square", "block"),
             "has four equal straight sides and four right angles", ("diamond", "circle")),
    Category(4, "triangle", "triangles", "shape", ("triangle",),
             "has three straight sides that meet in a point at the top", ("diamond", "star")),
    Category(5, "star", "stars", "shape", ("star",),
             "has five sharp points around its middle", ("cross", "triangle")),
    Category(6, "cross", "crosses", "shape", ("cross", "plus sign"),
             "is made of two thick bars that cross in the middle", ("star", "square")),
    Category(7, "diamond", "diamonds", "shape", ("diamond", "rhombus"),
             "is a square standing on one of its corners", ("square", "triangle")),
    Category(8, "ring", "rings", "shape", ("ring", "hoop"),
             "is round with a hole in the middle", ("circle", "diamond")),
)
CATEGORY_BY_NAME: dict[str, Category] = {c.name: c for c in CATEGORIES}
CATEGORY_NAMES: tuple[str, ...] = tuple(c.name for c in CATEGORIES)

# Colours in hue order, so that the list neighbours are the colours people actually confuse.
COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (214, 32, 36),
    "orange": (243, 136, 22),
    "yellow": (240, 214, 30),
    "green": (38, 160, 60),
    "blue": (36, 84, 214),
    "purple": (132, 48, 176),
    "pink": (238, 112, 186),
}
COLOUR_NAMES: tuple[str, ...] = tuple(COLOURS)

# Size classes by the longer side of the object's box, in pixels (inclusive ranges).
SIZES: dict[str, tuple[int, int]] = {"small": (14, 24), "large": (28, 44)}
SIZE_NAMES: tuple[str, ...] = tuple(SIZES)
COMPARATIVES = {"small": ("smaller", "smallest"), "large": ("larger", "largest")}

# The attributes the detector's annotations carry (as Visual Genome's objects carry "white", "large", ...):
# every object's colour and size class. Ids 1..A in this order; bottom-up attention's attribute head
# keeps 0 for "no attribute".
ATTRIBUTE_NAMES: tuple[str, ...] = COLOUR_NAMES + SIZE_NAMES

# Background kinds and the adjectives the language uses for them.
BACKGROUND_WORDS: dict[str, tuple[str, ...]] = {
    "light": ("plain light", "pale", "light grey"),
    "dark": ("dark", "plain dark", "gloomy"),
    "gradient": ("gradient", "shaded", "two-tone"),
    "stripes": ("striped", "stripy", "lined"),
    "noise": ("speckled", "noisy", "grainy"),
}
BACKGROUND_KINDS: tuple[str, ...] = tuple(BACKGROUND_WORDS)

NUMBER_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten")


def neighbouring_colours(colour: str) -> tuple[str, str]:
    """The two colours next to `colour` on the hue circle (red's neighbours: pink and orange)."""
    i = COLOUR_NAMES.index(colour)
    n = len(COLOUR_NAMES)
    return COLOUR_NAMES[(i - 1) % n], COLOUR_NAMES[(i + 1) % n]


def indefinite_article(word: str) -> str:
    return "an" if word[:1].lower() in "aeiou" else "a"


def with_article(phrase: str) -> str:
    return f"{indefinite_article(phrase)} {phrase}"


def plural(category: str) -> str:
    return CATEGORY_BY_NAME[category].plural


def number_word(n: int) -> str:
    return NUMBER_WORDS[n] if 0 <= n < len(NUMBER_WORDS) else str(n)


def coco_attributes() -> list[dict]:
    """The `attributes` vocabulary of the detector's annotation files: [{"id", "name"}], ids 1..A."""
    return [{"id": i, "name": name} for i, name in enumerate(ATTRIBUTE_NAMES, start=1)]


def coco_categories() -> list[dict]:
    """The `categories` list of every COCO-style file the world writes."""
    return [{"id": c.id, "name": c.name, "supercategory": c.supercategory} for c in CATEGORIES]


# What a VCR row's `objects` list calls every object. A reference becomes this name in the text, so naming
# objects by their category (as the detector does) would put the answer to "What is [0] ?" in the question;
# with one name for all, what an object is, its colour and its size come only from its RoI.
VCR_OBJECT_NAME = "object"
