"""The example dataset of `config/own_data_example.yaml`: "is the caption true of the image?".

Each row is a world scene and a caption "there is a <colour> <shape>"; the label is `yes` when an
object of that colour and shape is in the scene, else `no` (half of the rows; the false captions
mostly name a shape that is there in another colour, so the colour has to be read off the image).
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
from .scene import render, sample_scene
from .vocabulary import CATEGORY_NAMES, COLOUR_NAMES

EXAMPLE_ROWS = {"train": 240, "val": 80}
LABELS = ("yes", "no")
JPEG_QUALITY = 90


def _caption(scene, rng) -> tuple[str, str]:
    present = {(o.colour, o.category) for o in scene.objects}
    if rng.random() < 0.5:
        colour, category = sorted(present)[int(rng.integers(len(present)))]
        return f"there is a {colour} {category}", "yes"
    for _ in range(100):
        if rng.random() < 0.75:  # a shape that is there, in a colour it does not have
            category = scene.objects[int(rng.integers(len(scene.objects)))].category
        else:
            category = CATEGORY_NAMES[int(rng.integers(len(CATEGORY_NAMES)))]
        colour = COLOUR_NAMES[int(rng.integers(len(COLOUR_NAMES)))]
        if (colour, category) not in present:
            return f"there is a {colour} {category}", "no"
    raise RuntimeError("could not find a false caption for a scene")


def write_custom_example(out_dir: str | Path, *, image_size: int, seed: int) -> dict[str, Path]:
    """Write images/, train.jsonl and val.csv under `out_dir`; return the two data files."""
    out_dir = Path(out_dir).resolve()
    images = out_dir / "images"
    rows: dict[str, list[dict]] = {}
    for split, count in EXAMPLE_ROWS.items():
        rng = np_rng(seed, "custom_example", split)
        rows[split] = []
        for i in range(count):
            scene = sample_scene(rng, image_size, num_objects=(2, 4))
            name = f"{split}_{i:05d}.jpg"
            save_jpeg(render(scene), images / name, JPEG_QUALITY)
            text, label = _caption(scene, rng)
            image = (images / name).as_uri() if split == "train" and i % 10 == 9 else f"images/{name}"
            rows[split].append({"image": image, "text": text, "label": label})
    with atomic_path(images / "corrupt.jpg") as tmp:
        tmp.write_bytes(b"\xff\xd8\xff\xe0 this is not a JPEG")
    rows["train"][3]["image"] = "images/no_such_image.jpg"
    rows["train"][5]["image"] = "images/corrupt.jpg"
    rows["train"][7]["label"] = "maybe"
    rows["val"][2]["image"] = "images/no_such_image.jpg"
    rows["val"][4]["label"] = "unsure"
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
