"""Flickr30k for the embedded world: rendered scenes, five captions each, in the published files' formats.

Written when the config's `sources:` has a `flickr30k` entry (caption-based image retrieval,
vlbert_core/tasks/retrieval.py); sizes from `world.flickr_images`. Files:
- the Karpathy split JSON `dataset_flickr30k.json` (the split every retrieval paper evaluates on):
  {"images": [{"filename", "imgid", "split", "sentences": [{"raw", "tokens", "imgid", "sentid"}], "sentids"}],
   "dataset": "flickr30k"};
- the official captions file `results_20130124.token`: one `<filename>#<k><TAB><caption>` line per caption;
- the images, `<photo id>.jpg`, in one folder (the published `flickr30k-images`).

Each image's scene and captions come from streams keyed by ("flickr30k", split, index), so this dataset
never changes another dataset's files, and another dataset's size never changes its scenes.
"""

from __future__ import annotations

import random
import re
from typing import Callable, Mapping

from .formats import save_jpeg, write_json, write_lines
from .language import cc_caption
from .scene import render

FLICKR_SPLITS = ("train", "val", "test")
CAPTIONS_PER_IMAGE = 5  # as in Flickr30k: five annotators per image
SOURCE_KEYS = ("split_json", "captions", "images")
# Flickr photo ids are 10-digit numbers on real data; the world numbers its images from here (imgid 0 ->
# 1000000000.jpg), so a file name never looks like another dataset's.
FIRST_PHOTO_ID = 1_000_000_000
MAX_CAPTION_DRAWS = 100  # draws of cc_caption that may be spent on finding five different captions


def check_flickr_config(image_counts, sources) -> dict[str, int]:
    """{split: image count} of `world.flickr_images`, checked against `sources.flickr30k`."""
    if not isinstance(image_counts, Mapping):
        raise KeyError("config world.flickr_images: missing (a mapping train/val/test -> image count), needed "
                       "because sources.flickr30k is set")
    unknown = sorted(set(image_counts) - set(FLICKR_SPLITS))
    if unknown:
        raise ValueError(f"config world.flickr_images: unknown split(s) {unknown}; the Karpathy split has "
                         f"{list(FLICKR_SPLITS)}")
    counts = {split: image_counts.get(split, 0) for split in FLICKR_SPLITS}
    for split, n in counts.items():
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise ValueError(f"config world.flickr_images.{split}: expected an integer >= 0, got {n!r}")
    for split in ("train", "test"):
        if counts[split] < 2:
            # retrieval needs another image to rank against (and to draw negatives from)
            raise ValueError(f"config world.flickr_images.{split}: at least 2 images, got {counts[split]}")
    missing = [key for key in SOURCE_KEYS if key not in sources]
    if missing:
        raise KeyError(f"config sources.flickr30k: missing {missing}")
    return counts


def karpathy_tokens(caption: str) -> list[str]:
    """The `tokens` of a Karpathy split sentence: the caption lower-cased, split into words, punctuation gone."""
    return re.findall(r"[a-z0-9]+", caption.lower())


def five_captions(scene, text_rng: Callable[..., random.Random], seed: int, split: str, index: int) -> list[str]:
    """Five different captions of one scene, as five annotators would write; each draw of `cc_caption` has its
    own keyed stream, so the captions do not depend on how many draws an earlier image needed."""
    captions: list[str] = []
    for draw in range(MAX_CAPTION_DRAWS):
        caption = cc_caption(scene, text_rng(seed, "flickr30k", split, index, "caption", draw))
        if caption not in captions:
            captions.append(caption)
        if len(captions) == CAPTIONS_PER_IMAGE:
            return captions
    raise RuntimeError(f"flickr30k {split} image {index}: {MAX_CAPTION_DRAWS} caption draws gave only "
                       f"{len(captions)} different captions")


def write_flickr30k(world, image_counts, sources: Mapping[str, str],
                    text_rng: Callable[..., random.Random]) -> dict:
    """Write the world's Flickr30k (see the module docstring); returns its counts for world.json.

    `world` is the generator (vlbert_core/world/generate.py `_World`: `scene(*purpose)`, `path(template)`,
    `seed`, `quality`, `progress(n, desc)`); `text_rng(seed, *purpose)` is its keyed Python stream (passed in,
    not imported, so that this module and generate.py do not import each other).
    """
    counts = check_flickr_config(image_counts, sources)
    image_dir = world.path(sources["images"])
    images, token_lines = [], []
    imgid = 0
    for split in FLICKR_SPLITS:
        for i in world.progress(counts[split], f"flickr30k {split}"):
            scene = world.scene("flickr30k", split, i)
            filename = f"{FIRST_PHOTO_ID + imgid}.jpg"
            save_jpeg(render(scene), image_dir / filename, world.quality)
            captions = five_captions(scene, text_rng, world.seed, split, i)
            sentids = [imgid * CAPTIONS_PER_IMAGE + k for k in range(CAPTIONS_PER_IMAGE)]
            images.append({
                "filename": filename, "imgid": imgid, "split": split, "sentids": sentids,
                "sentences": [{"raw": caption, "tokens": karpathy_tokens(caption), "imgid": imgid, "sentid": sentid}
                              for caption, sentid in zip(captions, sentids)],
            })
            token_lines += [f"{filename}#{k}\t{caption}" for k, caption in enumerate(captions)]
            imgid += 1
    write_json(world.path(sources["split_json"]), {"images": images, "dataset": "flickr30k"})
    write_lines(world.path(sources["captions"]), token_lines)
    return {split: {"images": n, "captions": n * CAPTIONS_PER_IMAGE} for split, n in counts.items()}
