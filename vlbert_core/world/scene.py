"""Scenes of the synthetic world: sampling the objects on a background, and drawing them.

A Scene is pure data (objects with category, colour, size class and pixel box); `render` turns it
into an RGB image deterministically, so the image and every sentence about it come from the same
record. Boxes are half-open pixel extents: the shape covers columns x1..x2-1 and rows y1..y2-1,
and touches all four sides of its box, so the box is the ground truth a detector should find.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
from PIL import Image, ImageDraw

from .vocabulary import BACKGROUND_KINDS, CATEGORY_NAMES, COLOUR_NAMES, COLOURS, SIZES

Box = tuple[int, int, int, int]
RGB = tuple[int, int, int]

MAX_PAIR_IOU = 0.3
# A small object mostly inside a large one (a dot inside a ring) has a low IoU but is hard to
# see; this bound on intersection / smaller area keeps every object visible.
MAX_PAIR_COVER = 0.5
PERSON_ASPECT = 0.6  # width / height of a stick figure
# An object is "next to" another only when that one is clearly its nearest: the second nearest
# must be at least this much farther away, so "next to" never depends on a pixel or two.
NEAREST_MARGIN = 1.25
# "bigger than" / "the larger X" need this ratio of box areas, so the difference is obvious.
CLEARLY_BIGGER = 1.8


@dataclass(frozen=True)
class SceneObject:
    category: str
    colour: str
    size: str
    box: Box
    rgb: RGB

    @property
    def width(self) -> int:
        return self.box[2] - self.box[0]

    @property
    def height(self) -> int:
        return self.box[3] - self.box[1]

    @property
    def box_area(self) -> int:
        return self.width * self.height

    @property
    def center(self) -> tuple[float, float]:
        return (self.box[0] + self.box[2]) / 2.0, (self.box[1] + self.box[3]) / 2.0


@dataclass(frozen=True)
class Background:
    kind: str
    colours: tuple[RGB, ...]
    # gradient: direction of change in degrees; stripes: stripe direction in degrees.
    angle: float = 0.0
    stripe_period: int = 0
    noise_seed: int = 0
    noise_sigma: float = 0.0


@dataclass(frozen=True)
class Scene:
    width: int
    height: int
    background: Background
    objects: tuple[SceneObject, ...] = field(default_factory=tuple)


def box_iou(a: Box, b: Box) -> float:
    inter = _intersection(a, b)
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
    return inter / union if union > 0 else 0.0


def _intersection(a: Box, b: Box) -> int:
    w = min(a[2], b[2]) - max(a[0], b[0])
    h = min(a[3], b[3]) - max(a[1], b[1])
    return max(0, w) * max(0, h)


def _fits(box: Box, placed: list[Box]) -> bool:
    area = (box[2] - box[0]) * (box[3] - box[1])
    for other in placed:
        inter = _intersection(box, other)
        if inter == 0:
            continue
        other_area = (other[2] - other[0]) * (other[3] - other[1])
        if box_iou(box, other) >= MAX_PAIR_IOU or inter / min(area, other_area) >= MAX_PAIR_COVER:
            return False
    return True


def _muted(rng: np.random.Generator, lo: int, hi: int, tint: int = 18) -> RGB:
    """A low-saturation colour, so no background can be mistaken for an object's colour."""
    base = int(rng.integers(lo, hi + 1))
    return tuple(int(np.clip(base + rng.integers(-tint, tint + 1), 0, 255)) for _ in range(3))  # type: ignore[return-value]


def sample_background(rng: np.random.Generator) -> Background:
    kind = BACKGROUND_KINDS[int(rng.integers(len(BACKGROUND_KINDS)))]
    if kind == "light":
        return Background(kind, (_muted(rng, 185, 235),))
    if kind == "dark":
        return Background(kind, (_muted(rng, 25, 70),))
    if kind == "gradient":
        return Background(kind, (_muted(rng, 30, 120), _muted(rng, 140, 230)),
                          angle=float(rng.choice([0.0, 45.0, 90.0, 135.0, 180.0, 270.0])))
    if kind == "stripes":
        first = _muted(rng, 60, 200)
        shift = int(rng.choice([-1, 1]) * rng.integers(20, 40))
        second = tuple(int(np.clip(c + shift, 0, 255)) for c in first)
        return Background(kind, (first, second), angle=float(rng.choice([0.0, 45.0, 90.0, 135.0])),
                          stripe_period=int(rng.integers(6, 17)))
    return Background(kind, (_muted(rng, 90, 170),), noise_seed=int(rng.integers(2**31 - 1)),
                      noise_sigma=float(rng.uniform(8.0, 18.0)))


def _sample_object(rng: np.random.Generator, category: str) -> tuple[str, str, int, int, RGB]:
    colour = COLOUR_NAMES[int(rng.integers(len(COLOUR_NAMES)))]
    size = "small" if rng.random() < 0.5 else "large"
    lo, hi = SIZES[size]
    side = int(rng.integers(lo, hi + 1))
    if category == "person":
        height, width = side, max(6, round(side * PERSON_ASPECT))
    else:
        # A little aspect jitter, so boxes are not all squares; the longer side stays `side`.
        other = max(lo, round(side * float(rng.uniform(0.85, 1.0))))
        width, height = (side, other) if rng.random() < 0.5 else (other, side)
    # Jitter the paint a little: the colour name stays true, the pixels are not one fixed value.
    base = np.array(COLOURS[colour])
    rgb = tuple(int(v) for v in np.clip(base + rng.integers(-14, 15, size=3), 0, 255))
    return colour, size, width, height, rgb  # type: ignore[return-value]


def sample_scene(
    rng: np.random.Generator,
    image_size: int,
    num_objects: tuple[int, int] = (2, 6),
    required_categories: tuple[str, ...] = (),
    max_attempts: int = 50,
) -> Scene:
    """Sample a background and 2–6 objects that lie inside the image and barely overlap.

    `required_categories` are placed first (e.g. ("person", "person") for RefCOCO+ testA); the
    rest are drawn uniformly. Objects keep IoU < 0.3 with each other. Drawing order is shuffled,
    so the list order (the object index used by VCR) says nothing about the category.
    """
    if image_size < 2 * SIZES["large"][1]:
        raise ValueError(f"world.image_size={image_size} is too small for objects up to "
                         f"{SIZES['large'][1]} px; use at least {2 * SIZES['large'][1]}")
    lo_n, hi_n = num_objects
    if not 1 <= lo_n <= hi_n:
        raise ValueError(f"bad number of objects per scene: {num_objects}")
    for name in required_categories:
        if name not in CATEGORY_NAMES:
            raise ValueError(f"unknown category {name!r}; known: {CATEGORY_NAMES}")
    background = sample_background(rng)
    for _ in range(max_attempts):
        n = max(int(rng.integers(lo_n, hi_n + 1)), len(required_categories))
        categories = list(required_categories) + [
            CATEGORY_NAMES[int(rng.integers(len(CATEGORY_NAMES)))] for _ in range(n - len(required_categories))
        ]
        placed: list[Box] = []
        objects: list[SceneObject] = []
        for category in categories:
            colour, size, w, h, rgb = _sample_object(rng, category)
            for _try in range(60):
                x1 = int(rng.integers(1, image_size - w))
                y1 = int(rng.integers(1, image_size - h))
                box = (x1, y1, x1 + w, y1 + h)
                if _fits(box, placed):
                    placed.append(box)
                    objects.append(SceneObject(category, colour, size, box, rgb))
                    break
            else:
                break  # this layout is too crowded; start a fresh one
        if len(objects) == len(categories):
            order = rng.permutation(len(objects))
            return Scene(image_size, image_size, background, tuple(objects[i] for i in order))
    raise RuntimeError(f"could not place {num_objects} objects in a {image_size}px image "
                       f"after {max_attempts} layouts")


# ---------------------------------------------------------------- shapes

def _unit_star() -> list[tuple[float, float]]:
    points = []
    for k in range(10):
        radius = 1.0 if k % 2 == 0 else 0.42
        angle = -math.pi / 2 + k * math.pi / 5
        points.append((radius * math.cos(angle), radius * math.sin(angle)))
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    return [((x - min(xs)) / (max(xs) - min(xs)), (y - min(ys)) / (max(ys) - min(ys))) for x, y in points]


def _unit_ellipse(n: int = 20) -> list[tuple[float, float]]:
    return [(0.5 + 0.5 * math.cos(2 * math.pi * k / n), 0.5 + 0.5 * math.sin(2 * math.pi * k / n)) for k in range(n)]


_T = 1.0 / 3.0
UNIT_POLYGONS: dict[str, list[tuple[float, float]]] = {
    "square": [(0, 0), (1, 0), (1, 1), (0, 1)],
    "triangle": [(0.5, 0), (1, 1), (0, 1)],
    "diamond": [(0.5, 0), (1, 0.5), (0.5, 1), (0, 0.5)],
    "cross": [(_T, 0), (2 * _T, 0), (2 * _T, _T), (1, _T), (1, 2 * _T), (2 * _T, 2 * _T), (2 * _T, 1),
              (_T, 1), (_T, 2 * _T), (0, 2 * _T), (0, _T), (_T, _T)],
    "star": _unit_star(),
    "circle": _unit_ellipse(),
    "ring": _unit_ellipse(),
    # The outline of a stick figure: head on top, arms reaching the sides, legs to the corners.
    "person": [(0.35, 0), (0.65, 0), (1, 0.42), (1, 1), (0, 1), (0, 0.42)],
}


def _to_pixels(obj: SceneObject, unit: list[tuple[float, float]]) -> list[tuple[float, float]]:
    x1, y1, x2, y2 = obj.box
    return [(x1 + u * (x2 - 1 - x1), y1 + v * (y2 - 1 - y1)) for u, v in unit]


def object_polygon(obj: SceneObject) -> list[tuple[float, float]]:
    """The object's outline in pixel coordinates (the segmentation in COCO and VCR files).

    Circles and rings are 20-gons; the stick figure's outline is its hexagonal hull.
    """
    return [(round(x, 1), round(y, 1)) for x, y in _to_pixels(obj, UNIT_POLYGONS[obj.category])]


def polygon_area(points: list[tuple[float, float]]) -> float:
    s = 0.0
    for (xa, ya), (xb, yb) in zip(points, points[1:] + points[:1]):
        s += xa * yb - xb * ya
    return abs(s) / 2.0


def _draw_object(draw: ImageDraw.ImageDraw, obj: SceneObject) -> None:
    x1, y1, x2, y2 = obj.box
    right, bottom = x2 - 1, y2 - 1
    if obj.category == "circle":
        draw.ellipse([x1, y1, right, bottom], fill=obj.rgb)
    elif obj.category == "ring":
        thickness = max(3, round(min(obj.width, obj.height) / 5))
        draw.ellipse([x1, y1, right, bottom], outline=obj.rgb, width=thickness)
    elif obj.category == "person":
        _draw_stick_figure(draw, obj)
    else:
        draw.polygon(_to_pixels(obj, UNIT_POLYGONS[obj.category]), fill=obj.rgb)


def _draw_stick_figure(draw: ImageDraw.ImageDraw, obj: SceneObject) -> None:
    x1, y1, x2, y2 = obj.box
    w, h = obj.width, obj.height
    line = max(2, round(h / 9))
    half = line / 2.0
    cx = x1 + (w - 1) / 2.0
    head = 0.3 * h
    draw.ellipse([cx - head / 2, y1, cx + head / 2, y1 + head - 1], fill=obj.rgb)
    neck, hip = y1 + head - 1, y1 + 0.64 * h
    shoulder = y1 + 0.42 * h
    draw.line([(cx, neck), (cx, hip)], fill=obj.rgb, width=line)
    draw.line([(x1 + half, shoulder - 0.08 * h), (x2 - 1 - half, shoulder - 0.08 * h)], fill=obj.rgb, width=line)
    draw.line([(cx, hip), (x1 + half, y2 - 1 - half)], fill=obj.rgb, width=line)
    draw.line([(cx, hip), (x2 - 1 - half, y2 - 1 - half)], fill=obj.rgb, width=line)


def render_background(scene: Scene) -> np.ndarray:
    bg = scene.background
    h, w = scene.height, scene.width
    if bg.kind in ("light", "dark"):
        return np.broadcast_to(np.array(bg.colours[0], dtype=np.uint8), (h, w, 3)).copy()
    ys, xs = np.mgrid[0:h, 0:w].astype(np.float32)
    theta = math.radians(bg.angle)
    along = xs * math.cos(theta) + ys * math.sin(theta)
    if bg.kind == "gradient":
        t = (along - along.min()) / max(1e-6, float(along.max() - along.min()))
        c0, c1 = (np.array(c, dtype=np.float32) for c in bg.colours)
        return (c0 * (1 - t[..., None]) + c1 * t[..., None]).round().astype(np.uint8)
    if bg.kind == "stripes":
        band = (np.floor(along / bg.stripe_period).astype(np.int64) % 2).astype(bool)
        c0, c1 = (np.array(c, dtype=np.uint8) for c in bg.colours)
        return np.where(band[..., None], c1, c0)
    if bg.kind == "noise":
        noise_rng = np.random.default_rng(bg.noise_seed)
        base = np.array(bg.colours[0], dtype=np.float32)
        grain = noise_rng.normal(0.0, bg.noise_sigma, size=(h, w, 1)).astype(np.float32)
        tint = noise_rng.normal(0.0, bg.noise_sigma / 3, size=(h, w, 3)).astype(np.float32)
        return np.clip(base + grain + tint, 0, 255).round().astype(np.uint8)
    raise ValueError(f"unknown background kind {bg.kind!r}")


def render(scene: Scene) -> Image.Image:
    """Draw the scene: background, then the objects in list order."""
    image = Image.fromarray(render_background(scene), mode="RGB")
    draw = ImageDraw.Draw(image)
    for obj in scene.objects:
        _draw_object(draw, obj)
    return image


# ---------------------------------------------------------------- relations used by the language

def _distance(a: SceneObject, b: SceneObject) -> float:
    (ax, ay), (bx, by) = a.center, b.center
    return math.hypot(ax - bx, ay - by)


def nearest_object(scene: Scene, index: int) -> int | None:
    """The index of the object clearly nearest to object `index`, or None when it is a close call."""
    target = scene.objects[index]
    others = sorted((_distance(target, o), j) for j, o in enumerate(scene.objects) if j != index)
    if not others:
        return None
    if len(others) > 1 and others[1][0] < NEAREST_MARGIN * others[0][0]:
        return None
    return others[0][1]


def clearly_bigger(a: SceneObject, b: SceneObject) -> bool:
    return a.box_area >= CLEARLY_BIGGER * b.box_area


def is_above(a: SceneObject, b: SceneObject) -> bool:
    """a sits on top of b: a ends before b starts vertically and they share some columns."""
    return a.box[3] <= b.box[1] and min(a.box[2], b.box[2]) - max(a.box[0], b.box[0]) > 0
