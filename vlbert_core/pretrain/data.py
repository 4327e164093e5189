"""Pre-training data: <Caption, Image> samples from the CC shards joined with their RoIs, <Text, ∅> samples
from the text shards, masked for the active tasks and mixed 1:1 per mini-batch.

Data parallelism: the shards are split over S independent *streams* (S = world size x streams per rank);
stream s reads shards[s::S] of each source, and rank r runs streams r*k .. r*k+k-1 (k streams per rank,
in the training process or one DataLoader worker each). Every stream contributes the same share of each
mini-batch, so the global batch of a step is the same set of samples whether S streams run in one
process or in S ranks: only the partition, never the world size, decides the data.

Streams are deterministic and resumable: each one cycles over epochs (shard order and a shuffle buffer
seeded by seed/stream/epoch), and its `state()` (epoch, raw samples consumed, plus what a replay cannot
rebuild) restores it exactly; every sample's masking draws from its own generator seeded by its
position, so a resumed run sees the very samples a straight run would.

Held-out captions: the first `held_out_per_shard` samples of every CC shard never enter pre-training;
`read_held_out_captions` returns them for the visual-clue check.
"""

from __future__ import annotations

import functools
import os
import random
from collections import Counter
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Iterator

import numpy as np
import torch
import webdataset as wds

from vlbert_core.damaged import read_shard_samples
from vlbert_core.detector.pixels import DEFAULT_PIXEL_FORMAT
from vlbert_core.images import DEFAULT_MAX_PIXELS, load_rgb
from vlbert_core.models.common.batch import ModelBatch, collate_samples, fit_image, image_to_tensor
from vlbert_core.models.common.inputs import (IGNORE_INDEX, boxes_with_whole_image, build_input_sequence,
                                             text_only_words)
from vlbert_core.preemption import leave_quietly_on_stop_signals
from vlbert_core.rois import RoIRecord, read_rois
from vlbert_core.utils import get_logger

from .masking import MaskingVocab, mask_rois, whole_word_mask
from .settings import PretrainSetting

log = get_logger(__name__)

SHUFFLE_BUFFER = 1000
SHUFFLE_INITIAL = 100
NEGATIVE_CAPTION_POOL = 64   # recent captions that mismatched pairs (setting c) draw from
MISMATCH_PROB = 0.5
IMAGE_EXTENSIONS = ("jpg", "jpeg", "png")
_SOURCE_CC, _SOURCE_TEXT = 1, 2  # seeds the shard order and the masking of each source


# ---- RoI parquets -----------------------------------------------------------------------------------

def usable_cc_rois(path: str | os.PathLike, keep_boxes: int) -> tuple[dict[str, RoIRecord], dict[str, str], int | None]:
    """The rows of a CC RoI parquet that pre-training uses: {key: record} of the ok rows (first keep_boxes
    boxes), {key: status} of the failed rows, and C (classes incl. background; None for a file without rows)."""
    entries: dict[str, RoIRecord] = {}
    failures: dict[str, str] = {}
    num_classes: int | None = None
    for row_index, (key, record) in enumerate(read_rois(path, keep_boxes=keep_boxes).items()):
        num_classes = record.num_classes
        if not record.ok:
            failures[key] = record.status
            continue
        if record.num_boxes < 1:
            raise ValueError(f"RoI parquet {path} row {row_index} (key {key!r}): an ok row without boxes")
        entries[key] = record
    return entries, failures, num_classes


def pair_shards_with_rois(cc_shards: list[str], roi_parquets: list[str]) -> list[tuple[str, str]]:
    """Each CC shard `{split}-{shard}.tar` goes with the RoI parquet of the same name."""
    by_stem = {Path(p).stem: str(p) for p in roi_parquets}
    pairs = []
    for shard in cc_shards:
        stem = Path(shard).name.removesuffix(".tar")
        if stem not in by_stem:
            raise ValueError(f"CC shard {shard} has no RoI parquet named {stem}.parquet among {sorted(by_stem)}")
        pairs.append((str(shard), by_stem[stem]))
    return pairs


# ---- pieces of a sample -------------------------------------------------------------------------------

def text_chunks(line_ids: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Lines of a document concatenated until >= max_tokens tokens, then cut to max_tokens (the rest of that
    line is dropped, as released); a shorter tail at the end of the document is kept."""
    chunks: list[list[int]] = []
    current: list[int] = []
    for ids in line_ids:
        if not ids:
            continue
        current.extend(ids)
        if len(current) >= max_tokens:
            chunks.append(current[:max_tokens])
            current = []
    if current:
        chunks.append(current)
    return chunks


def sample_rng(seed: int, stream: int, source: int, epoch: int, index: int, sub: int = 0) -> np.random.Generator:
    return np.random.default_rng([seed, stream, source, epoch, index, sub])


@dataclass
class StreamConfig:
    max_caption_len: int      # whole sequence budget of a caption: tokens + [CLS] + [SEP]
    max_text_len: int         # word pieces of a <Text, ∅> sample, plus [CLS] and [SEP] in the "bert" layout
    max_rois: int             # boxes per image incl. the whole-image box
    image_max_side: int
    seed: int
    stream: int = 0           # this stream's index s among the num_streams of the run
    num_streams: int = 1      # S = world size x streams per rank
    held_out_per_shard: int = 0  # first samples of every CC shard kept out of pre-training
    pixel_format: str = DEFAULT_PIXEL_FORMAT   # what the visual network's weights expect (detector/pixels.py)
    text_only_layout: str = "bert"  # how a <Text, ∅> sample is laid out (VLBertConfig.text_only_layout)
    image_min_side: int | None = None  # the released SCALES[0] (models/common/batch.py fitted_size)
    max_image_pixels: int = DEFAULT_MAX_PIXELS  # the config's cap on an image's pixels (vlbert_core/images.py)


def _stream_shards(shards: list, stream: int, num_streams: int, what: str) -> list:
    if not 0 <= stream < num_streams:
        raise ValueError(f"{what}: stream {stream} is not in 0..{num_streams - 1}")
    mine = shards[stream::num_streams]
    if not mine:
        raise ValueError(f"{what}: {len(shards)} shards cannot feed {num_streams} data streams (world size x "
                         f"pretrain.streams_per_rank); stream {stream} gets none")
    return mine


def _drop_shard_prefix(count: int):
    """A pipeline stage that drops the first `count` samples of every shard (the held-out captions)."""
    def stage(samples: Iterator[dict]) -> Iterator[dict]:
        seen: Counter = Counter()
        for sample in samples:
            url = sample["__url__"]
            if seen[url] < count:
                seen[url] += 1
                continue
            yield sample
    return stage


def _epoch_pipeline(urls: list[str], seed: int, stream: int, source: int, epoch: int,
                    held_out_per_shard: int = 0) -> Iterator[dict]:
    order = np.random.default_rng([seed, stream, source, epoch]).permutation(len(urls))
    # a stream reads its shards whole, epoch after epoch: each one's sha256 is verified once per process
    # (vlbert_core/damaged.py says why), its size on every open
    stages = [functools.partial(read_shard_samples, [urls[i] for i in order], verify_checksum=True)]
    if held_out_per_shard:
        stages.append(_drop_shard_prefix(held_out_per_shard))
    stages.append(wds.shuffle(SHUFFLE_BUFFER, SHUFFLE_INITIAL, rng=random.Random(f"{seed}/{stream}/{source}/{epoch}")))
    return iter(wds.DataPipeline(*stages))


def decode_cc_sample(raw: dict, rois: RoIRecord, image_max_side: int, max_rois: int,
                     pixel_format: str = DEFAULT_PIXEL_FORMAT, image_min_side: int | None = None, *,
                     max_pixels: int = DEFAULT_MAX_PIXELS) -> dict:
    """The caption, the image (fitted to image_max_side / image_min_side, normalised as `pixel_format`) and its
    boxes (box 0 = whole image) with their class scores (a zero row for box 0), from one raw CC sample and its
    RoI row. An image over `max_pixels` (the config's max_image_pixels; the shards the pipeline writes are far
    smaller) raises ImageTooLarge, one that does not decode ImageUnreadable, each naming the shard and sample."""
    image_field = next(ext for ext in IMAGE_EXTENSIONS if ext in raw)
    img = load_rgb(raw[image_field], max_pixels=max_pixels,
                   name=f"{raw.get('__key__')!r} of CC shard {raw.get('__url__')}")
    original = img.size
    img, _ = fit_image(img, image_max_side, image_min_side)
    width, height = img.size
    # the RoIs are in pixels of the image the detector saw (rois.image_w x image_h)
    scale = np.array([width / rois.image_w, height / rois.image_h] * 2, dtype=np.float32)
    boxes = boxes_with_whole_image(rois.boxes * scale, (width, height), original, max_rois)
    class_scores = np.concatenate([np.zeros((1, rois.class_scores.shape[1]), np.float32), rois.class_scores])
    return {"key": raw.get("__key__"), "caption": raw["txt"].decode("utf-8").strip(), "image": image_to_tensor(img, pixel_format),
            "boxes": torch.from_numpy(boxes), "class_scores": class_scores[: boxes.shape[0]]}


def _has_image_and_caption(raw: dict) -> bool:
    return "txt" in raw and any(ext in raw for ext in IMAGE_EXTENSIONS)


def read_cc_samples(shard_pairs: list[tuple[str, str]], first: int, stop: int, cfg: StreamConfig) -> list[dict]:
    """The CC samples at positions first..stop-1 of every shard whose RoI row is ok, decoded as by
    `decode_cc_sample`, in shard order."""
    samples = []
    for url, parquet in shard_pairs:
        entries, _, _ = usable_cc_rois(parquet, cfg.max_rois - 1)
        # the first samples of every shard only: its size is checked, its sha256 would cost a read of all of it
        for position, raw in enumerate(read_shard_samples([url], verify_checksum=False)):
            if position >= stop:
                break
            rois = entries.get(raw.get("__key__"))
            if position >= first and rois is not None and _has_image_and_caption(raw):
                samples.append(decode_cc_sample(raw, rois, cfg.image_max_side, cfg.max_rois, cfg.pixel_format,
                                                cfg.image_min_side, max_pixels=cfg.max_image_pixels))
    return samples


def read_held_out_captions(shard_pairs: list[tuple[str, str]], per_shard: int, cfg: StreamConfig) -> list[dict]:
    """The held-out CC samples: the first `per_shard` of every shard, which no stream trains on."""
    return read_cc_samples(shard_pairs, 0, per_shard, cfg)


# ---- the streams -------------------------------------------------------------------------------------

class CaptionImageStream:
    """Endless <Caption, Image> samples with their MLM / RoI / relationship targets."""

    def __init__(self, shard_pairs: list[tuple[str, str]], tokenizer, vocab: MaskingVocab, cfg: StreamConfig,
                 setting: PretrainSetting, num_object_classes: int):
        self.pairs = _stream_shards(shard_pairs, cfg.stream, cfg.num_streams, "CC shards")
        self.tokenizer, self.vocab, self.cfg, self.setting = tokenizer, vocab, cfg, setting
        self.num_object_classes = num_object_classes
        self._rois: dict[str, tuple[dict[str, RoIRecord], dict[str, str]]] = {}
        self.epoch, self.consumed = 0, 0
        self.recent_captions: list[str] = []
        self.skipped: Counter = Counter()
        self._iterator: Iterator[dict] | None = None

    def state(self) -> dict:
        return {"epoch": self.epoch, "consumed": self.consumed, "recent_captions": list(self.recent_captions),
                "skipped": dict(self.skipped)}

    def load_state(self, state: dict) -> None:
        self.epoch, self.consumed = int(state["epoch"]), int(state["consumed"])
        self.recent_captions = list(state["recent_captions"])
        self.skipped = Counter(state["skipped"])
        self._iterator = None

    def _rois_of(self, url: str) -> tuple[dict[str, RoIRecord], dict[str, str]]:
        if url not in self._rois:
            parquet = dict(self.pairs)[url]
            entries, failures, num_classes = usable_cc_rois(parquet, self.cfg.max_rois - 1)
            if num_classes is not None and num_classes != self.num_object_classes:
                raise ValueError(f"RoI parquet {parquet}: {num_classes} classes, the detector has {self.num_object_classes}")
            self._rois[url] = (entries, failures)
        return self._rois[url]

    def _start_epoch(self) -> None:
        self._iterator = _epoch_pipeline([u for u, _ in self.pairs], self.cfg.seed, self.cfg.stream, _SOURCE_CC,
                                         self.epoch, self.cfg.held_out_per_shard)
        self._emitted_in_epoch, self._replayed = 0, self.consumed
        for _ in range(self.consumed):  # resume: replay the raw stream without decoding it
            next(self._iterator)

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        while True:
            if self._iterator is None:
                self._start_epoch()
            try:
                raw = next(self._iterator)
            except StopIteration:
                if self._emitted_in_epoch == 0 and self._replayed == 0:
                    raise ValueError(f"CC shards {[u for u, _ in self.pairs]} yield no usable sample (skipped: "
                                     f"{dict(self.skipped)}; held out: the first {self.cfg.held_out_per_shard} "
                                     f"of each shard)") from None
                log.info("CC epoch %d done: %d raw samples; skipped so far %s", self.epoch, self.consumed,
                         dict(self.skipped))
                self.epoch, self.consumed, self._iterator = self.epoch + 1, 0, None
                continue
            index = self.consumed
            self.consumed += 1
            sample = self._make_sample(raw, index)
            if sample is not None:
                self._emitted_in_epoch += 1
                return sample

    def _make_sample(self, raw: dict, index: int) -> dict | None:
        key, url = raw.get("__key__"), raw.get("__url__")
        if not _has_image_and_caption(raw):
            self.skipped["missing_image_or_caption"] += 1
            log.warning("CC shard %s sample %r lacks an image or a caption (has %s); skipped",
                        url, key, sorted(k for k in raw if not k.startswith("__")))
            return None
        entries, failures = self._rois_of(url)
        rois = entries.get(key)
        if rois is None:
            # every CC sample is accounted for: its RoI row failed (download/decode) or does not exist
            self.skipped[f"roi_{failures[key]}" if key in failures else "no_roi_row"] += 1
            return None
        decoded = decode_cc_sample(raw, rois, self.cfg.image_max_side, self.cfg.max_rois,
                                   self.cfg.pixel_format, self.cfg.image_min_side, max_pixels=self.cfg.max_image_pixels)
        caption, boxes = decoded["caption"], decoded["boxes"]
        rng = sample_rng(self.cfg.seed, self.cfg.stream, _SOURCE_CC, self.epoch, index)

        relationship = IGNORE_INDEX
        if self.setting.relationship:
            relationship = 1
            pool = [c for c in self.recent_captions if c != caption]
            shown_caption = caption
            if pool and rng.random() < MISMATCH_PROB:
                shown_caption, relationship = pool[int(rng.integers(len(pool)))], 0
            self.recent_captions = (self.recent_captions + [caption])[-NEGATIVE_CAPTION_POOL:]
            caption = shown_caption

        ids = self.tokenizer(caption, add_special_tokens=False)["input_ids"][: self.cfg.max_caption_len - 2]
        if not ids:
            self.skipped["empty_caption"] += 1
            return None
        masked_ids, labels = whole_word_mask(ids, self.tokenizer.convert_ids_to_tokens(ids), rng, self.vocab)
        num_rois = boxes.shape[0]
        if self.setting.masked_roi_cls:
            selected, masked = mask_rois(num_rois, rng)
        else:
            selected = masked = np.zeros(num_rois, dtype=bool)
        seq = build_input_sequence(masked_ids, None, num_rois, cls_id=self.tokenizer.cls_token_id,
                                   sep_id=self.tokenizer.sep_token_id, pad_id=self.tokenizer.pad_token_id)
        mlm_labels = seq.word_labels(labels)
        return {
            "key": key, "sequence": seq, "mlm_labels": mlm_labels, "image": decoded["image"], "boxes": boxes,
            "roi_masked": torch.from_numpy(masked), "roi_selected": torch.from_numpy(selected),
            "roi_labels": torch.from_numpy(decoded["class_scores"]), "relationship": relationship,
        }


class TextStream:
    """Endless <Text, ∅> samples of up to max_text_len tokens cut from the documents of the text shards."""

    def __init__(self, shards: list[str], tokenizer, vocab: MaskingVocab, cfg: StreamConfig):
        self.shards = _stream_shards(list(shards), cfg.stream, cfg.num_streams, "text shards")
        self.tokenizer, self.vocab, self.cfg = tokenizer, vocab, cfg
        self.epoch, self.docs_consumed, self.chunks_done = 0, 0, 0
        self.skipped: Counter = Counter()
        self._iterator: Iterator[dict] | None = None
        self._pending: list[list[int]] = []   # chunks of the current document not yet emitted

    def state(self) -> dict:
        return {"epoch": self.epoch, "docs_consumed": self.docs_consumed, "chunks_done": self.chunks_done,
                "skipped": dict(self.skipped)}

    def load_state(self, state: dict) -> None:
        self.epoch, self.docs_consumed = int(state["epoch"]), int(state["docs_consumed"])
        self.chunks_done = int(state["chunks_done"])
        self.skipped = Counter(state["skipped"])
        self._iterator, self._pending = None, []

    def _doc_chunks(self, raw: dict) -> list[list[int]]:
        if "txt" not in raw:
            self.skipped["missing_text"] += 1
            log.warning("text shard %s sample %r has no .txt; skipped", raw.get("__url__"), raw.get("__key__"))
            return []
        lines = [line.strip() for line in raw["txt"].decode("utf-8").splitlines() if line.strip()]
        if not lines:
            self.skipped["empty_document"] += 1
            return []
        line_ids = self.tokenizer(lines, add_special_tokens=False)["input_ids"]
        return text_chunks(line_ids, text_only_words(self.cfg.max_text_len, self.cfg.text_only_layout))

    def _start_epoch(self) -> None:
        self._iterator = _epoch_pipeline(self.shards, self.cfg.seed, self.cfg.stream, _SOURCE_TEXT, self.epoch)
        self._emitted_in_epoch, self._replayed = 0, self.docs_consumed
        if self.docs_consumed:  # resume: skip whole documents raw, then the chunks already emitted
            for _ in range(self.docs_consumed - 1):
                next(self._iterator)
            self._pending = self._doc_chunks(next(self._iterator))[self.chunks_done:]

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        while not self._pending:
            if self._iterator is None:
                self._start_epoch()
                continue
            try:
                raw = next(self._iterator)
            except StopIteration:
                if self._emitted_in_epoch == 0 and self._replayed == 0:
                    raise ValueError(f"text shards {self.shards} hold no usable document "
                                     f"({self.docs_consumed} read, skipped {dict(self.skipped)})") from None
                log.info("text epoch %d done: %d documents", self.epoch, self.docs_consumed)
                self.epoch, self.docs_consumed, self.chunks_done, self._iterator = self.epoch + 1, 0, 0, None
                continue
            self.docs_consumed += 1
            self.chunks_done = 0
            self._pending = self._doc_chunks(raw)
        ids = self._pending.pop(0)
        self._emitted_in_epoch += 1
        rng = sample_rng(self.cfg.seed, self.cfg.stream, _SOURCE_TEXT, self.epoch, self.docs_consumed, self.chunks_done)
        self.chunks_done += 1
        masked_ids, labels = whole_word_mask(ids, self.tokenizer.convert_ids_to_tokens(ids), rng, self.vocab)
        seq = build_input_sequence(masked_ids, None, None, cls_id=self.tokenizer.cls_token_id,
                                   sep_id=self.tokenizer.sep_token_id, pad_id=self.tokenizer.pad_token_id,
                                   text_only_layout=self.cfg.text_only_layout)
        return {"sequence": seq, "mlm_labels": seq.word_labels(labels), "relationship": IGNORE_INDEX}


# ---- batches -----------------------------------------------------------------------------------------

@dataclass
class PretrainBatch:
    inputs: ModelBatch
    mlm_labels: torch.Tensor                  # Long [B, L], IGNORE_INDEX where there is no target
    roi_labels: torch.Tensor | None           # Float [B, R, C] detector class scores (soft targets)
    roi_selected: torch.Tensor | None         # Bool [B, R] RoIs with a classification target
    relationship_labels: torch.Tensor         # Long [B]: 1 matched, 0 mismatched, IGNORE_INDEX none

    def to(self, device) -> "PretrainBatch":
        return PretrainBatch(**{f.name: (v.to(device) if v is not None else None)
                                for f in fields(self) for v in [getattr(self, f.name)]})


def collate_pretrain(samples: list[dict]) -> PretrainBatch:
    inputs = collate_samples(samples)
    length = inputs.input_ids.shape[1]
    mlm_labels = torch.full((len(samples), length), IGNORE_INDEX, dtype=torch.long)
    for i, s in enumerate(samples):
        if len(s["mlm_labels"]) != len(s["sequence"].input_ids):
            raise ValueError(f"collate_pretrain: sample {i}: {len(s['mlm_labels'])} MLM labels for "
                             f"{len(s['sequence'].input_ids)} elements")
        mlm_labels[i, : len(s["mlm_labels"])] = torch.as_tensor(s["mlm_labels"])
    roi_labels = roi_selected = None
    if inputs.boxes is not None:
        num_boxes = inputs.boxes.shape[1]
        num_classes = next(s["roi_labels"].shape[1] for s in samples if s.get("roi_labels") is not None)
        roi_labels = torch.zeros(len(samples), num_boxes, num_classes)
        roi_selected = torch.zeros(len(samples), num_boxes, dtype=torch.bool)
        for i, s in enumerate(samples):
            if s.get("roi_labels") is not None:
                roi_labels[i, : s["roi_labels"].shape[0]] = s["roi_labels"]
                roi_selected[i, : s["roi_selected"].shape[0]] = s["roi_selected"]
    relationship = torch.tensor([s["relationship"] for s in samples], dtype=torch.long)
    return PretrainBatch(inputs, mlm_labels, roi_labels, roi_selected, relationship)


class DataStream:
    """One data-parallel stream: a CC stream (and a text stream when the setting uses the text corpus) and
    its share of every mini-batch."""

    def __init__(self, cc: CaptionImageStream, text: TextStream | None, cc_per_step: int, text_per_step: int):
        if cc_per_step < 1 or (text is not None and text_per_step < 1):
            raise ValueError(f"samples per stream and step must be >= 1, got cc {cc_per_step}, text {text_per_step}")
        self.cc, self.text = cc, text
        self.cc_per_step, self.text_per_step = cc_per_step, text_per_step

    def next_samples(self) -> list[dict]:
        samples = [next(self.cc) for _ in range(self.cc_per_step)]
        if self.text is not None:
            samples += [next(self.text) for _ in range(self.text_per_step)]
        return samples

    def state(self) -> dict:
        return {"cc": self.cc.state(), "text": None if self.text is None else self.text.state()}

    def load_state(self, state: dict) -> None:
        self.cc.load_state(state["cc"])
        if self.text is not None:
            self.text.load_state(state["text"])


class _StreamWorkers(torch.utils.data.IterableDataset):
    """DataLoader worker w runs stream w and yields (its samples of one step, its state after them)."""

    def __init__(self, streams: list[DataStream]):
        self.streams = streams

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        stream = self.streams[info.id]
        while True:
            samples = stream.next_samples()
            yield samples, stream.state()


def _as_is(item):
    return item


class PretrainBatches:
    """The mini-batches of one rank: each step, every one of its streams adds its share (cc_batch_size /
    k CC samples, + text_batch_size / k text samples when the setting uses the text corpus: the 1:1 mix of
    the paper), in stream order.

    With `workers`, each stream runs in its own DataLoader worker process (decoding overlaps training);
    the DataLoader hands out the workers' items in turn, so the batches are the same as without.
    """

    def __init__(self, streams: list[DataStream], *, workers: bool = False):
        if not streams:
            raise ValueError("PretrainBatches: no data stream")
        self.streams, self.workers = streams, workers
        self._states = [s.state() for s in streams]   # after the last batch handed out
        self._loader_iter = None

    @property
    def samples_per_batch(self) -> int:
        return sum(s.cc_per_step + (s.text_per_step if s.text is not None else 0) for s in self.streams)

    def state(self) -> dict:
        return {"streams": [dict(s) for s in self._states]}

    def load_state(self, state: dict) -> None:
        if len(state["streams"]) != len(self.streams):
            raise ValueError(f"data state has {len(state['streams'])} streams, this rank runs {len(self.streams)} "
                             f"(pretrain.streams_per_rank changed?)")
        for stream, stream_state in zip(self.streams, state["streams"]):
            stream.load_state(stream_state)
        self._states = [s.state() for s in self.streams]
        self._loader_iter = None

    def skipped(self) -> Counter:
        """Samples skipped so far by this rank's streams, by reason (text reasons prefixed with text_)."""
        total: Counter = Counter()
        for state in self._states:
            total.update(state["cc"]["skipped"])
            if state["text"] is not None:
                total.update({f"text_{k}": v for k, v in state["text"]["skipped"].items()})
        return total

    def __iter__(self):
        return self

    def __next__(self) -> PretrainBatch:
        samples: list[dict] = []
        if not self.workers:
            for j, stream in enumerate(self.streams):
                samples += stream.next_samples()
                self._states[j] = stream.state()
        else:
            if self._loader_iter is None:
                # Its own generator: the DataLoader draws its workers' base seed from it instead of the global
                # RNG, whose draws (dropout) a resumed run must repeat from its checkpoint; the streams keep
                # their own random state.
                loader = torch.utils.data.DataLoader(_StreamWorkers(self.streams), batch_size=None,
                                                     num_workers=len(self.streams), collate_fn=_as_is,
                                                     worker_init_fn=leave_quietly_on_stop_signals,
                                                     generator=torch.Generator().manual_seed(0))
                self._loader_iter = iter(loader)
            for j in range(len(self.streams)):
                part, self._states[j] = next(self._loader_iter)
                samples += part
        return collate_pretrain(samples)
