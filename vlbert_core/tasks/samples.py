"""Model-ready samples and batches of the three fine-tuning datasets.

Each `*Data` class turns loaded records (see `vqa`, `vcr`, `refcoco`) into sample dicts
(`sample(i)`) and pads a list of them into a `VLBertBatch` plus the task's targets
(`collate(samples)`). Images are shrunk so the longer side is at most `model.image_max_side`, and
the boxes are scaled by the same factor. Box 0 of every sample is the whole image.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from vlbert_core.detector.pixels import DEFAULT_PIXEL_FORMAT
from vlbert_core.model.batch import VLBertBatch, collate_samples, image_to_tensor
from vlbert_core.model.inputs import (
    TEXT,
    InputSequence,
    boxes_with_whole_image,
    build_input_sequence,
)
from vlbert_core.utils import get_logger

from . import vcr as vcr_lib
from .common import load_task_image, rois_for_key, scale_boxes
from .heads.common import IGNORE_INDEX
from .refcoco import POSITIVE_IOU, RefcocoData, box_iou
from .vqa import VqaQuestion, soft_targets

log = get_logger(__name__)


class ImageLoader:
    """Decoded, resized and normalised task images, cached (several questions share an image)."""

    def __init__(self, max_side: int, cache_size: int = 512, pixel_format: str = DEFAULT_PIXEL_FORMAT):
        self.max_side = int(max_side)
        self.pixel_format = pixel_format
        self._load = functools.lru_cache(maxsize=cache_size)(self._load_uncached)

    def _load_uncached(self, path: str) -> tuple[torch.Tensor, float, int, int]:
        img, scale, (orig_w, orig_h) = load_task_image(path, self.max_side)
        return image_to_tensor(img, self.pixel_format), scale, orig_w, orig_h

    def __call__(self, path: str | os.PathLike) -> tuple[torch.Tensor, float, int, int]:
        """(image [3, H, W], scale applied, original width, original height)."""
        return self._load(str(path))


class Tokens:
    """The tokenizer and its special ids."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.cls_id = tokenizer.cls_token_id
        self.sep_id = tokenizer.sep_token_id
        self.pad_id = tokenizer.pad_token_id
        self.mask_id = tokenizer.mask_token_id

    def ids(self, text: str) -> list[int]:
        return self.tokenizer.convert_tokens_to_ids(self.tokenizer.tokenize(text))

    def sequence(self, ids_a: list[int], ids_b: list[int] | None, num_rois: int) -> InputSequence:
        return build_input_sequence(ids_a, ids_b, num_rois, cls_id=self.cls_id, sep_id=self.sep_id,
                                    pad_id=self.pad_id)


def truncate_pair(a: list, b: list | None, max_tokens: int) -> tuple[list, list | None]:
    """Trim the longer of A and B from the end until both fit in `max_tokens` (BERT's rule)."""
    a = list(a)
    b = None if b is None else list(b)
    while len(a) + (len(b) if b is not None else 0) > max_tokens:
        if b is not None and len(b) > len(a):
            b.pop()
        else:
            a.pop()
    return a, b


def _image_and_boxes(images: ImageLoader, path: Path, boxes_orig: np.ndarray, max_rois: int,
                     size_hint: tuple[int, int] | None, source: str):
    image, scale, orig_w, orig_h = images(path)
    if size_hint is not None and (size_hint[0] != orig_w or size_hint[1] != orig_h):
        raise ValueError(f"{source}: boxes are given for a {size_hint[0]}x{size_hint[1]} image but "
                         f"{path} is {orig_w}x{orig_h}")
    boxes = boxes_with_whole_image(scale_boxes(boxes_orig, scale), image.shape[2], image.shape[1],
                                   max_rois)
    return image, torch.from_numpy(boxes)


class VqaData:
    """<Question, [MASK], Image> with detected RoIs; targets are the soft answer scores."""

    def __init__(self, questions: Sequence[tuple[VqaQuestion, Path]], rois: dict, rois_source: str,
                 tokens: Tokens, answers: list[str] | None, *, max_rois: int, max_text_len: int,
                 images: ImageLoader):
        self.questions = list(questions)
        self.tokens, self.images = tokens, images
        self.max_rois, self.max_text_len = int(max_rois), int(max_text_len)
        self.answer_index = None if answers is None else {a: i for i, a in enumerate(answers)}
        self.num_answers = 0 if answers is None else len(answers)
        self.rois_source = rois_source
        self.rois = {q.image_key: rois_for_key(rois, q.image_key, rois_source) for q, _ in self.questions}

    def __len__(self) -> int:
        return len(self.questions)

    def sample(self, i: int) -> dict:
        question, image_path = self.questions[i]
        record = self.rois[question.image_key]
        image, boxes = _image_and_boxes(self.images, image_path, record.boxes, self.max_rois,
                                        (record.image_w, record.image_h),
                                        f"RoI parquet {self.rois_source} key {question.image_key}")
        ids_a, _ = truncate_pair(self.tokens.ids(question.question), None, self.max_text_len - 4)
        sample = {"sequence": self.tokens.sequence(ids_a, [self.tokens.mask_id], len(boxes)),
                  "image": image, "boxes": boxes, "question_id": question.question_id,
                  "image_key": question.image_key}
        if self.answer_index is not None:
            target = torch.zeros(self.num_answers)
            for index, score in soft_targets(question, self.answer_index).items():
                target[index] = score
            sample["target"] = target
        return sample

    def collate(self, samples: list[dict]) -> tuple[VLBertBatch, dict]:
        extras = {"question_id": [s["question_id"] for s in samples],
                  "image_keys": [s["image_key"] for s in samples]}
        if "target" in samples[0]:
            extras["target"] = torch.stack([s["target"] for s in samples])
        return collate_samples(samples), extras


class VcrData:
    """<Question, Answer, Image> (Q->A) or <Question+Answer, Rationale, Image> (QA->R) with GT boxes.

    Word positions that name an object take that object's box as their visual feature (their
    `roi_index` points at it); other words take box 0, the whole image. One sample holds the
    four candidate sequences of a question, which share the image and boxes.
    """

    def __init__(self, items: Sequence[vcr_lib.VcrItem], mode: str, images_dir: str | os.PathLike,
                 tokens: Tokens, object_vocab: list[str], *, max_rois: int, max_text_len: int,
                 images: ImageLoader, with_labels: bool = True):
        if mode not in ("q2a", "qa2r"):
            raise ValueError(f"unknown VCR mode {mode!r}")
        self.items, self.mode = list(items), mode
        self.images_dir = Path(images_dir)
        self.tokens, self.images = tokens, images
        self.object_index = {name: i for i, name in enumerate(object_vocab)}
        self.max_rois, self.max_text_len = int(max_rois), int(max_text_len)
        self.with_labels = with_labels
        self._metadata = functools.lru_cache(maxsize=1024)(vcr_lib.load_vcr_metadata)
        self.dropped_references = 0
        if with_labels:
            unlabeled = [it.annot_id for it in self.items if vcr_lib.candidate_label(it, mode) is None]
            if unlabeled:
                raise ValueError(f"VCR {mode}: {len(unlabeled)} questions have no label, e.g. "
                                 f"{unlabeled[:3]}")

    def __len__(self) -> int:
        return len(self.items)

    def encode_candidate(self, text_a: list, text_b: list, objects: list[str],
                         num_boxes: int) -> InputSequence:
        """One candidate sequence with object references linked to their boxes."""
        ids_a, refs_a = vcr_lib.tokenize_with_refs(self.tokens.tokenizer, text_a, objects)
        ids_b, refs_b = vcr_lib.tokenize_with_refs(self.tokens.tokenizer, text_b, objects)
        budget = self.max_text_len - 3
        ids_a, ids_b = truncate_pair(ids_a, ids_b, budget)
        refs_a, refs_b = refs_a[: len(ids_a)], refs_b[: len(ids_b)]
        seq = self.tokens.sequence(ids_a, ids_b, num_boxes)
        # text layout: [CLS] A [SEP] B [SEP]
        text_refs = [vcr_lib.NO_OBJECT, *refs_a, vcr_lib.NO_OBJECT, *refs_b, vcr_lib.NO_OBJECT]
        for position, obj in enumerate(text_refs):
            assert seq.element_kind[position] == TEXT
            if obj == vcr_lib.NO_OBJECT:
                continue
            if obj + 1 < num_boxes:
                seq.roi_index[position] = obj + 1
            else:
                # the object's box was cut by max_rois; the word keeps the whole-image feature
                self.dropped_references += 1
        return seq

    def sample(self, i: int) -> dict:
        item = self.items[i]
        meta_path = self.images_dir / item.metadata_fn
        meta = self._metadata(meta_path)
        vcr_lib.check_metadata_matches(item, meta, str(meta_path))
        image, boxes = _image_and_boxes(self.images, self.images_dir / item.img_fn, meta.boxes,
                                        self.max_rois, (meta.width, meta.height),
                                        f"VCR metadata {meta_path}")
        text_a, choices = vcr_lib.candidate_texts(item, self.mode)
        sequences = [self.encode_candidate(text_a, b, item.objects, len(boxes)) for b in choices]
        box_classes = torch.full((len(boxes),), IGNORE_INDEX, dtype=torch.long)
        for obj, name in enumerate(item.objects[: len(boxes) - 1]):
            box_classes[obj + 1] = self.object_index.get(name, IGNORE_INDEX)
        sample = {"sequences": sequences, "image": image, "boxes": boxes,
                  "box_classes": box_classes, "annot_id": item.annot_id, "image_key": item.img_fn}
        label = vcr_lib.candidate_label(item, self.mode)
        sample["label"] = -1 if label is None else int(label)
        return sample

    def collate(self, samples: list[dict]) -> tuple[VLBertBatch, dict]:
        """Question-major rows: row 4q + k is candidate k of question q."""
        flat = [{"sequence": seq, "image": s["image"], "boxes": s["boxes"]}
                for s in samples for seq in s["sequences"]]
        batch = collate_samples(flat)
        num_boxes = batch.boxes.shape[1]
        box_classes = torch.full((len(flat), num_boxes), IGNORE_INDEX, dtype=torch.long)
        for q, s in enumerate(samples):
            n = s["box_classes"].shape[0]
            box_classes[q * vcr_lib.NUM_CANDIDATES:(q + 1) * vcr_lib.NUM_CANDIDATES, :n] = s["box_classes"]
        extras = {"label": torch.tensor([s["label"] for s in samples], dtype=torch.long),
                  "box_classes": box_classes, "annot_id": [s["annot_id"] for s in samples],
                  "image_keys": [s["image_key"] for s in samples for _ in s["sequences"]]}
        return batch, extras


class RefcocoSamples:
    """<Query, Image> with one binary target per candidate box (IoU > 0.5 with the referred box).

    Track `gt`: every instance box of the image; track `det`: the detected RoIs of the image.
    """

    def __init__(self, data: RefcocoData, track: str, images_dir: str | os.PathLike, tokens: Tokens,
                 *, max_rois: int, max_text_len: int, images: ImageLoader,
                 rois: dict | None = None, rois_source: str = ""):
        if track not in ("gt", "det"):
            raise ValueError(f"unknown RefCOCO+ track {track!r} (expected 'gt' or 'det')")
        if track == "det" and rois is None:
            raise ValueError("the detected-regions track needs the RoI records")
        self.data, self.track = data, track
        self.images_dir = Path(images_dir)
        self.tokens, self.images = tokens, images
        self.max_rois, self.max_text_len = int(max_rois), int(max_text_len)
        self.candidates: dict[int, np.ndarray] = {}
        for expr in data.expressions:
            if expr.image_id in self.candidates:
                continue
            if track == "gt":
                boxes = data.image_boxes[expr.image_id]
            else:
                boxes = rois_for_key(rois, expr.image_key, rois_source).boxes
            if len(boxes) == 0:
                raise ValueError(f"RefCOCO+ {track} track: image {expr.image_key} has no candidate box")
            self.candidates[expr.image_id] = np.asarray(boxes, dtype=np.float32)[: self.max_rois - 1]

    def __len__(self) -> int:
        return len(self.data.expressions)

    def sample(self, i: int) -> dict:
        expr = self.data.expressions[i]
        candidates = self.candidates[expr.image_id]
        image, boxes = _image_and_boxes(
            self.images, self.images_dir / self.data.image_files[expr.image_id], candidates,
            self.max_rois, (expr.image_w, expr.image_h),
            f"RefCOCO+ image {expr.image_key}")
        ids, _ = truncate_pair(self.tokens.ids(expr.sentence), None, self.max_text_len - 2)
        labels = torch.zeros(len(boxes))
        labels[1:] = torch.from_numpy((box_iou(candidates, expr.gt_box)[:, 0] > POSITIVE_IOU)
                                      .astype(np.float32))
        candidate = torch.ones(len(boxes), dtype=torch.bool)
        candidate[0] = False
        return {"sequence": self.tokens.sequence(ids, None, len(boxes)), "image": image,
                "boxes": boxes, "labels": labels, "candidate": candidate, "index": i,
                "image_key": f"{expr.image_key}/{self.track}"}

    def collate(self, samples: list[dict]) -> tuple[VLBertBatch, dict]:
        batch = collate_samples(samples)
        num_boxes = batch.boxes.shape[1]
        labels = torch.zeros(len(samples), num_boxes)
        candidate = torch.zeros(len(samples), num_boxes, dtype=torch.bool)
        for row, s in enumerate(samples):
            labels[row, : len(s["labels"])] = s["labels"]
            candidate[row, : len(s["candidate"])] = s["candidate"]
        return batch, {"labels": labels, "candidate": candidate,
                       "index": [s["index"] for s in samples],
                       "image_keys": [s["image_key"] for s in samples]}


class ConcatData:
    """Several datasets with the same collate, one after the other (RefCOCO+ gt + det tracks)."""

    def __init__(self, parts: Sequence):
        if not parts:
            raise ValueError("ConcatData needs at least one dataset")
        self.parts = list(parts)
        self.offsets = np.cumsum([0] + [len(p) for p in self.parts])

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def sample(self, i: int) -> dict:
        part = int(np.searchsorted(self.offsets, i, side="right")) - 1
        return self.parts[part].sample(i - int(self.offsets[part]))

    def collate(self, samples: list[dict]):
        return self.parts[0].collate(samples)


def iterate_batches(data, batch_size: int, *, shuffle: bool, generator: torch.Generator | None = None):
    """Yield (indices, batch, extras) over one pass of the data."""
    n = len(data)
    order = torch.randperm(n, generator=generator).tolist() if shuffle else list(range(n))
    for start in range(0, n, batch_size):
        indices = order[start:start + batch_size]
        batch, extras = data.collate([data.sample(i) for i in indices])
        yield indices, batch, extras
