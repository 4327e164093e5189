"""Caption-based image retrieval (`tasks/retrieval.py`): the samples <Caption, Image>, the pair-score head, ViLBERT's
4-way training loss with a hard negative, and zero-shot scores from the pre-training alignment head.

Training, as ViLBERT's (Lu et al. 2019, Sec. 4; facebookresearch/vilbert-multi-task retreival_dataset.py): per
caption four candidates, each scored on its own, softmax cross-entropy with the true pair as the answer:
1. the caption with its own image;
2. the caption with a random other image;
3. the image with a random other caption (a caption of a random other image);
4. the caption with a hard negative image: among `hard_negatives` (default 3) random other training images, the
   one the current model scores highest, scored in eval mode without gradient, then scored again with gradient.
   (The authors draw the hard image from precomputed nearest neighbours of the true image, hard_negative.pkl;
   scoring a few random candidates with the current model needs no offline pass and tracks the model as it
   learns.)
The random draws use torch's global generator, which a fine-tuning checkpoint saves and restores, so a resumed
run draws the same candidates as an uninterrupted one.

Evaluation: every caption of the split with every image, image-major (one image's rows are consecutive), so the
frozen RoI features (`finetune.FrozenRoIFeatureCache`) and the decoded image are computed once per image.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from vlbert_core.images import DEFAULT_MAX_PIXELS
from vlbert_core.models.common.batch import ModelBatch, collate_samples
from vlbert_core.models.common.heads import AlignmentReadout
from vlbert_core.models.common.initialization import init_new_parameters
from vlbert_core.models.registry import family
from vlbert_core.utils import atomic_path, get_logger

from ..common import rois_for_key
from ..samples import ImageLoader, Tokens, image_and_boxes, truncate_pair

log = get_logger(__name__)

FIXED_CANDIDATES = 3  # true pair, caption + random image, random caption + image; the hard negative is the 4th


class PairScoreHead(nn.Module):
    """The pooled vector (VL-BERT: `[CLS]`; ViLBERT: h_IMG * h_CLS) -> Dropout -> Linear(width, 1): one matching
    score per (caption, image) row (ViLBERT's retrieval logit)."""

    def __init__(self, hidden_size: int, dropout: float = 0.1):
        super().__init__()
        self.dropout = nn.Dropout(dropout)
        self.classifier = nn.Linear(hidden_size, 1)
        init_new_parameters(self)

    def forward(self, output, batch) -> torch.Tensor:
        return self.classifier(self.dropout(output.pooled)).squeeze(-1)


class RetrievalPairData:
    """`[CLS] caption [SEP] [IMG]...` pairs with the image's detected RoIs.

    captions: (caption id, text, id of its own image or None); images: (image id, RoI key, path). Without
    `pairs`, every caption with every image, image-major (index = image position x captions + caption
    position); with `pairs`, the listed (caption position, image position) pairs (a user's queries).
    """

    SPECIAL_TOKENS = 2  # [CLS] and [SEP] around the caption

    def __init__(self, captions: Sequence[tuple], images: Sequence[tuple], *, rois: dict, rois_source: str,
                 tokens: Tokens, images_loader: ImageLoader, max_rois: int, max_text_len: int,
                 pairs: Sequence[tuple[int, int]] | None = None):
        self.captions = [(int(cid), str(text), None if own is None else int(own)) for cid, text, own in captions]
        self.images = [(int(iid), str(key), Path(path)) for iid, key, path in images]
        self.loader = images_loader
        self.tokens = tokens
        self.max_rois, self.max_text_len = int(max_rois), int(max_text_len)
        self.rois_source = rois_source
        self.rois = {key: rois_for_key(rois, key, rois_source) for _, key, _ in self.images}
        self.pairs = None if pairs is None else [(int(c), int(i)) for c, i in pairs]
        self._ids: dict[int, list[int]] = {}

    def __len__(self) -> int:
        return len(self.pairs) if self.pairs is not None else len(self.images) * len(self.captions)

    @property
    def num_images(self) -> int:
        return len(self.images)

    def pair(self, index: int) -> tuple[int, int]:
        """(caption position, image position) of sample `index`."""
        if self.pairs is not None:
            return self.pairs[index]
        image, caption = divmod(index, len(self.captions))
        return caption, image

    def caption_ids(self, position: int) -> list[int]:
        """The caption's word pieces, truncated to fit; tokenised once (every image repeats them)."""
        if position not in self._ids:
            ids, _ = truncate_pair(self.tokens.ids(self.captions[position][1]), None,
                                   self.max_text_len - self.SPECIAL_TOKENS)
            self._ids[position] = ids
        return self._ids[position]

    def pair_sample(self, caption: int, image: int) -> dict:
        image_id, key, path = self.images[image]
        record = self.rois[key]
        pixels, boxes = image_and_boxes(self.loader, path, record.boxes, self.max_rois,
                                        (record.image_w, record.image_h), f"RoI parquet {self.rois_source} key {key}")
        return {"sequence": self.tokens.sequence(self.caption_ids(caption), None, len(boxes)), "image": pixels,
                "boxes": boxes, "image_key": key, "image_id": image_id, "caption_id": self.captions[caption][0]}

    def sample(self, index: int) -> dict:
        return self.pair_sample(*self.pair(index))

    def collate(self, samples: list[dict]) -> tuple[ModelBatch, dict]:
        extras = {"image_keys": [s["image_key"] for s in samples], "image_id": [s["image_id"] for s in samples],
                  "caption_id": [s["caption_id"] for s in samples]}
        return collate_samples(samples), extras

    def prediction_rows(self, indices: Sequence[int], scores: Sequence[float]) -> list[dict]:
        """The rows `RetrievalTask.score` reads: one per run of consecutive samples of one image."""
        rows: list[dict] = []
        for index, value in zip(indices, scores):
            caption, image = self.pair(index)
            image_id, caption_id = self.images[image][0], self.captions[caption][0]
            if not rows or rows[-1]["image_id"] != image_id:
                rows.append({"image_id": image_id, "caption_ids": [], "scores": []})
            rows[-1]["caption_ids"].append(caption_id)
            rows[-1]["scores"].append(float(value))
        return rows


def _other(n: int, excluded: int, count: int) -> list[int]:
    """`count` distinct positions in range(n) other than `excluded`, drawn from torch's global generator."""
    drawn = torch.randperm(n - 1)[:count].tolist()
    return [j + (j >= excluded) for j in drawn]


class RetrievalTrainData:
    """One training example per caption (the first `max_examples` captions, if given): its three fixed candidates
    (the batch) and its hard-negative candidates (scored in `four_way_loss`, which picks one). Negatives come from
    every image and caption of the split."""

    def __init__(self, captions: Sequence[tuple], images: Sequence[tuple], *, hard_negatives: int, rois: dict,
                 rois_source: str, tokens: Tokens, images_loader: ImageLoader, max_rois: int, max_text_len: int,
                 max_examples: int | None = None):
        self.pairs = RetrievalPairData(captions, images, rois=rois, rois_source=rois_source, tokens=tokens,
                                       images_loader=images_loader, max_rois=max_rois, max_text_len=max_text_len)
        self.hard_negatives = int(hard_negatives)
        position = {image_id: j for j, (image_id, _, _) in enumerate(self.pairs.images)}
        self.own_image = []
        self.captions_of: dict[int, list[int]] = {}
        for c, (caption_id, _, own) in enumerate(self.pairs.captions):
            if own not in position:
                raise ValueError(f"retrieval: caption {caption_id} describes image {own}, which is not in the split")
            self.own_image.append(position[own])
            self.captions_of.setdefault(position[own], []).append(c)
        self.num_examples = len(self.own_image) if not max_examples else min(int(max_examples), len(self.own_image))
        if self.num_images < self.hard_negatives + 2:
            raise ValueError(f"retrieval: {self.num_images} training images; a random negative and "
                             f"finetune.retrieval.hard_negatives={self.hard_negatives} hard-negative candidates need "
                             f"at least {self.hard_negatives + 2}")

    def __len__(self) -> int:
        return self.num_examples

    @property
    def num_images(self) -> int:
        return self.pairs.num_images

    def sample(self, i: int) -> dict:
        own = self.own_image[i]
        random_image, *hard = _other(self.num_images, own, 1 + self.hard_negatives)
        (caption_image,) = _other(self.num_images, own, 1)
        captions = self.captions_of[caption_image]
        random_caption = captions[int(torch.randint(len(captions), ()))]
        pair = self.pairs.pair_sample
        return {"candidates": [pair(i, own), pair(i, random_image), pair(random_caption, own)],
                "hard": [pair(i, image) for image in hard], "caption_id": self.pairs.captions[i][0]}

    def collate(self, samples: list[dict]) -> tuple[ModelBatch, dict]:
        fixed = [c for s in samples for c in s["candidates"]]
        hard = [c for s in samples for c in s["hard"]]
        extras = {"image_keys": [c["image_key"] for c in fixed], "caption_id": [s["caption_id"] for s in samples],
                  "hard_batch": collate_samples(hard), "hard_image_keys": [c["image_key"] for c in hard],
                  "hard_negatives": self.hard_negatives}
        return collate_samples(fixed), extras


def four_way_loss(model, out: Mapping[str, torch.Tensor], extras: Mapping[str, Any]) -> tuple[torch.Tensor, dict]:
    """Softmax cross-entropy over each caption's four candidates, the true pair first (see the module docstring).

    `out["logits"]` [3B] are the fixed candidates' scores, caption by caption; the hard negative is picked here
    among `extras["hard_batch"]` ([K B] rows, K per caption) with the model in eval mode and no gradient, and the
    picked pair scored again in training mode, with gradient."""
    fixed = out["logits"].view(-1, FIXED_CANDIDATES)
    captions, k = fixed.shape[0], int(extras["hard_negatives"])
    hard_batch, hard_keys = extras["hard_batch"].to(fixed.device), extras["hard_image_keys"]
    was_training = model.training
    model.eval()
    with torch.no_grad():
        hard_scores = model.scores(hard_batch, {"image_keys": hard_keys})["logits"].view(captions, k)
    model.train(was_training)
    rows = torch.arange(captions, device=fixed.device) * k + hard_scores.argmax(dim=1)
    picked = hard_batch.select_rows(rows)
    picked_logits = model.scores(picked, {"image_keys": [hard_keys[r] for r in rows.tolist()]})["logits"]
    logits = torch.cat([fixed, picked_logits[:, None]], dim=1)
    target = torch.zeros(captions, dtype=torch.long, device=fixed.device)  # the true pair is candidate 0
    loss = F.cross_entropy(logits.float(), target)
    stats = {"accuracy": (logits.argmax(dim=1) == 0).float().mean().item(),
             # how often the hard negative outscores the true pair: the share of hard cases the loss sees
             "hard_beats_true": (logits[:, 3] >= logits[:, 0]).float().mean().item()}
    return loss, stats


# ---- zero-shot retrieval with the pre-training alignment head -------------------------------------

def alignment_readout(model_type: str) -> AlignmentReadout:
    """The one family-specific piece of zero-shot retrieval: where the family's pre-training caption-image head
    lives and what it reads (its registry record's alignment_readout)."""
    try:
        record = family(model_type)
    except ValueError:
        raise ValueError(f"zero-shot retrieval: no alignment head known for model type {model_type!r}") from None
    return record.load("alignment_readout")


PRETRAIN_METRICS_FILE = "metrics.jsonl"  # written by pre-training (vlbert_core/pretrain/loop.py) beside the model
ALIGNMENT_LOSS_KEY = "rel_loss"          # its column of the caption-image relation loss, both families


def load_alignment_head(directory: str | os.PathLike, model) -> tuple[nn.Module, AlignmentReadout]:
    """The trained alignment head of a pre-trained model directory, in eval mode, or an error saying why not."""
    from vlbert_core.models.common.heads import HEADS_FILE, read_pretraining_heads
    from vlbert_core.models.common.initialization import copy_tensors

    directory = Path(directory)
    readout = alignment_readout(model.model_type)
    saved = read_pretraining_heads(directory, readout.head_names)
    if readout.head not in saved:
        have = sorted(saved) if saved else f"no {HEADS_FILE}"
        raise ValueError(f"zero-shot retrieval needs the pre-training head {readout.head!r} of the {model.model_type} "
                         f"model in {directory}, which has {have}: it was pre-trained without the caption-image "
                         f"relation objective (VL-BERT: setting c; ViLBERT: setting vilbert) or saved without heads")
    # ViLBERT saves every head, trained or not: the run's metrics say whether the relation loss ever trained it
    metrics = directory / PRETRAIN_METRICS_FILE
    if metrics.is_file():
        rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
        if not any(ALIGNMENT_LOSS_KEY in row for row in rows):
            raise ValueError(f"zero-shot retrieval: the {readout.head!r} head in {directory / HEADS_FILE} was never "
                             f"trained: {metrics} has no {ALIGNMENT_LOSS_KEY!r} (a setting without the caption-image "
                             "relation objective)")
    head = readout.build(model.config)
    state = saved[readout.head]
    if set(state) != set(head.state_dict()):
        raise ValueError(f"{directory / HEADS_FILE}: head {readout.head!r} has keys {sorted(state)}, expected "
                         f"{sorted(head.state_dict())}")
    copy_tensors(head, state, {key: key for key in state}, where=f"{directory / HEADS_FILE} head {readout.head!r}")
    return head.eval(), readout


@torch.no_grad()
def zero_shot_scores(pretrained_dir: str | os.PathLike, out_path: str | os.PathLike | None = None, *,
                     sources: Mapping[str, str], model_cfg: "ModelSettings | Mapping[str, Any]",
                     rois_paths: Sequence[str | os.PathLike], split: str = "test", max_text_len: int = 64,
                     batch_size: int = 32, device: str = "cpu", max_image_pixels: int = DEFAULT_MAX_PIXELS) -> dict:
    """Zero-shot image retrieval: every caption of `split` with every image, scored by the probability of
    "matched" of the pre-training alignment head of the model in `pretrained_dir` (no fine-tuning).

    Returns the predictions bundle {"retrieval/<split>": rows} in the fine-tune job's format (rows as
    `RetrievalTask.score` reads them) and, with `out_path`, writes it as the fine-tune job writes predictions.json
    ({"model_dir", "predictions"}), so `scoring.evaluate_predictions("retrieval", split, out_path, ...)` gives
    R@1/5/10. `sources`: the config's sources.flickr30k; `rois_paths`: the split's RoI parquets
    (results/rois/flickr30k/<split>.parquet); `model_cfg`: the config's model section (max_rois, image_max_side);
    `max_image_pixels`: the config's cap on an image's pixels (vlbert_core/images.py), as fine-tuning applies it.
    The visual network runs once per image and batch: every batch holds one image's captions."""
    from vlbert_core.models.common.bert_init import load_tokenizer
    from vlbert_core.models.common.config import ModelSettings, visual_pixel_format
    from vlbert_core.models.registry import from_pretrained
    from vlbert_core.rois import read_rois

    from ..retrieval import RetrievalTask, load_split

    sizes = ModelSettings.of(model_cfg)
    model = from_pretrained(pretrained_dir).to(device).eval()
    head, readout = load_alignment_head(pretrained_dir, model)
    head.to(device)
    rois: dict = {}
    for path in rois_paths:
        rois.update(read_rois(path))
    data = load_split(sources, split)
    images_dir = Path(sources["images"])
    pairs = RetrievalPairData([(c.sentid, c.text, c.imgid) for c in data.captions],
                       [(image.imgid, image.key, images_dir / image.filename) for image in data.images],
                       rois=rois, rois_source=", ".join(map(str, rois_paths)),
                       tokens=Tokens(load_tokenizer(model.config.bert_path)),
                       images_loader=ImageLoader(sizes.image_max_side, pixel_format=visual_pixel_format(model.config),
                                                 min_side=sizes.image_min_side, max_pixels=max_image_pixels),
                       max_rois=sizes.max_rois, max_text_len=int(max_text_len))
    num_captions = len(pairs.captions)
    rows: list[dict] = []
    for image in range(pairs.num_images):
        first = image * num_captions
        for start in range(first, first + num_captions, int(batch_size)):
            indices = list(range(start, min(start + int(batch_size), first + num_captions)))
            batch, _ = pairs.collate([pairs.sample(i) for i in indices])
            output = model.encode(batch.to(device), rows_per_image=len(indices))  # one image: its CNN pass once
            logits = head(readout.vector(output)).float()
            matched = torch.softmax(logits, dim=1)[:, readout.matched_index]
            rows.extend(pairs.prediction_rows(indices, matched.cpu().tolist()))
    log.info("zero-shot retrieval (%s head of %s): %d captions x %d images scored", readout.head, pretrained_dir,
             num_captions, pairs.num_images)
    bundle = {f"{RetrievalTask.name}/{split}": rows}
    if out_path is not None:
        # the layout of evaluate.write_prediction_bundle (not imported: tasks.evaluate imports this package)
        with atomic_path(Path(out_path)) as tmp:
            tmp.write_text(json.dumps({"model_dir": str(pretrained_dir), "predictions": bundle}, indent=1) + "\n")
    return bundle
