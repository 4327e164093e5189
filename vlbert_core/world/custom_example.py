"""The example dataset of `config/own_data_example.yaml`: "what shape is the big object?".

Each row is a world scene with one large object and one or two small ones (the world's size
classes, so "big" is never a close call), a question in one of a few phrasings, and the large
object's category as the label (eight labels, about one row in eight each). The answer is in the
image's RoIs (the detector is trained on these categories) and not in the text, so a model that
reads the image beats the majority label by far; the question form is a plain image–text
classification row, like a user's own data.

An earlier version asked "is the caption true of the image?" (`there is a <colour> <shape>`,
yes/no, 240 train rows): at the example's size (a 200-step detector, 150 pre-training steps) both
settings stayed at the majority label, so the example showed the plumbing but no model that learns.

The train split is JSON Lines with image paths relative to the file (every tenth row gives its
image as a file:// URL instead, so the downloader path runs), val is CSV. A few rows are broken on
purpose so the row accounting shows: in train one missing image, one corrupt image file and one
unknown label; in val one missing image and one unknown label.
"""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

from vlbert_core.utils import atomic_path

from .formats import save_jpeg
from .generate import np_rng
from .scene import Scene, render, sample_scene
from .vocabulary import CATEGORY_NAMES

EXAMPLE_ROWS = {"train": 480, "val": 120}
LABELS = CATEGORY_NAMES
QUESTIONS = ("what shape is the big object ?", "which shape is the largest one ?",
             "what is the biggest thing in the picture ?")
JPEG_QUALITY = 90
MAX_SCENES = 200  # scenes drawn per row until one has exactly one large object


def _scene_with_one_large_object(rng, image_size: int) -> Scene:
    for _ in range(MAX_SCENES):
        scene = sample_scene(rng, image_size, num_objects=(2, 3))
        if sum(o.size == "large" for o in scene.objects) == 1:
            return scene
    raise RuntimeError(f"no scene with exactly one large object in {MAX_SCENES} draws")


def example_row(scene: Scene, rng) -> tuple[str, str]:
    """(question, label) of a scene: the category of its only large object."""
    (large,) = [o for o in scene.objects if o.size == "large"]
    return QUESTIONS[int(rng.integers(len(QUESTIONS)))], large.category


def write_custom_example(out_dir: str | Path, *, image_size: int, seed: int) -> dict[str, Path]:
    """Write images/, train.jsonl and val.csv under `out_dir`; return the two data files."""
    out_dir = Path(out_dir).resolve()
    images = out_dir / "images"
    rows: dict[str, list[dict]] = {}
    for split, count in EXAMPLE_ROWS.items():
        rng = np_rng(seed, "custom_example", split)
        rows[split] = []
        for i in range(count):
            scene = _scene_with_one_large_object(rng, image_size)
            name = f"{split}_{i:05d}.jpg"
            save_jpeg(render(scene), images / name, JPEG_QUALITY)
            text, label = example_row(scene, rng)
            image = (images / name).as_uri() if split == "train" and i % 10 == 9 else f"images/{name}"
            rows[split].append({"image": image, "text": text, "label": label})
    with atomic_path(images / "corrupt.jpg") as tmp:
        tmp.write_bytes(b"\xff\xd8\xff\xe0 this is not a JPEG")
    rows["train"][3]["image"] = "images/no_such_image.jpg"
    rows["train"][5]["image"] = "images/corrupt.jpg"
    rows["train"][7]["label"] = "hexagon"
    rows["val"][2]["image"] = "images/no_such_image.jpg"
    rows["val"][4]["label"] = "oval"
    train, val = out_dir / "train.jsonl", out_dir / "val.csv"
    with atomic_path(train) as tmp:
        tmp.write_text("".join(json.dumps(r) + "\n" for r in rows["train"]), encoding="utf-8")
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=["image", "text", "label"], lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows["val"])
    with atomic_path(val) as tmp:
        tmp.write_text(buffer.getvalue(), encoding="utf-8")
    return {"train": train, "val": val}
