"""Caption-based image retrieval on Flickr30k (ViLBERT, Lu et al. 2019, Sec. 4): loaders of the Karpathy split
JSON and the official captions file, the recall@K of the official protocol, and the task.

Data: the Karpathy split `dataset_flickr30k.json` (29,000 train / 1,014 val / 1,000 test images on real data, five
captions each) names each image's split and captions; the official captions file `results_20130124.token` must
list the same number of captions for every image of a split (a check that the two files belong together).
Images are `<filename>` in `sources.flickr30k.images`; an image's key (RoI parquets, feature cache) is its file
stem.

Training (tasks/modeling/retrieval.py): ViLBERT's 4-way multiple choice per caption. Evaluation, the official
protocol: every test caption is scored against every test image, and recall@K is the share of captions whose
own image is among the K best-scored images (image retrieval; 1,000 images x 5,000 captions on real data).

Ranks and ties: a caption's rank is 1 + the number of *other* images scored at least as high as its own image, so
a tie always counts against the true image. That is deterministic whatever the order of the images, and a
model that scores every pair alike gets rank N (R@1 = 0), never a lucky 100 %.

Prediction rows (what the fine-tune job writes, what `score` reads): one row per image and batch,
`{"image_id": imgid, "caption_ids": [sentid, ...], "scores": [float, ...]}`; every (caption, image) pair of the
split exactly once. The scored predictions file has one row per caption: its true image, its rank, the top-10
images and `hit_at_1` / `hit_at_5` / `hit_at_10`.

Torch-free at import, as every task module (vlbert_core/tasks/base.py).
"""

from __future__ import annotations

import json
import math
import os
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from vlbert_core.utils import get_logger

from .base import Baseline, TableColumn, Task, TaskHeads, TaskLoss, check_text_fits, model_side, query_text

log = get_logger(__name__)

RECALL_KS = (1, 5, 10)   # the recalls every retrieval paper reports
TOP_IMAGES_LISTED = 10   # images listed per caption in the scored predictions file
DEFAULT_HARD_NEGATIVES = 3  # finetune.retrieval.hard_negatives: random other images the hard negative is picked from


@dataclass(frozen=True)
class FlickrImage:
    imgid: int
    filename: str
    split: str

    @property
    def key(self) -> str:
        """The image's key in the RoI parquets: its file stem (`1000092795` for `1000092795.jpg`)."""
        return Path(self.filename).stem


@dataclass(frozen=True)
class FlickrCaption:
    sentid: int
    imgid: int  # the image it describes
    text: str


@dataclass
class RetrievalSplit:
    """The images of one split and their captions, in the split JSON's order."""

    images: list[FlickrImage]
    captions: list[FlickrCaption]


def _read_split_json(path: str | os.PathLike) -> list:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"Flickr30k split file {path} does not exist")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"Flickr30k split file {path} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict) or not isinstance(data.get("images"), list):
        raise ValueError(f"Flickr30k split file {path} has no 'images' list (the Karpathy split format)")
    return data["images"]


def load_karpathy_split(path: str | os.PathLike, split: str) -> RetrievalSplit:
    """The images and captions of `split` in the Karpathy split JSON; image and sentence ids are unique over the
    file, and each sentence names its own image."""
    entries = _read_split_json(path)
    images, captions = [], []
    seen_images: set[int] = set()
    seen_sentences: set[int] = set()
    splits: Counter = Counter()
    for i, entry in enumerate(entries):
        try:
            image = FlickrImage(int(entry["imgid"]), str(entry["filename"]), str(entry["split"]))
            sentences = [(int(s["sentid"]), int(s["imgid"]), s["raw"]) for s in entry["sentences"]]
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"Flickr30k split file {path} image #{i}: bad or missing field ({exc!r})") from None
        if image.imgid in seen_images:
            raise ValueError(f"Flickr30k split file {path}: imgid {image.imgid} appears twice")
        seen_images.add(image.imgid)
        splits[image.split] += 1
        for sentid, imgid, raw in sentences:
            if sentid in seen_sentences:
                raise ValueError(f"Flickr30k split file {path}: sentid {sentid} appears twice")
            seen_sentences.add(sentid)
            if imgid != image.imgid:
                raise ValueError(f"Flickr30k split file {path}: sentence {sentid} names imgid {imgid} but belongs "
                                 f"to image {image.imgid} ({image.filename})")
            if not isinstance(raw, str) or not raw.strip():
                raise ValueError(f"Flickr30k split file {path}: sentence {sentid} has no text")
        if image.split != split:
            continue
        if not sentences:
            raise ValueError(f"Flickr30k split file {path}: image {image.filename} has no sentences")
        images.append(image)
        captions += [FlickrCaption(sentid, imgid, raw) for sentid, imgid, raw in sentences]
    if not images:
        raise ValueError(f"Flickr30k split file {path} has no image in split {split!r} (it has {dict(splits)})")
    return RetrievalSplit(images, captions)


def read_captions_file(path: str | os.PathLike) -> dict[str, int]:
    """{image filename: number of captions} of the official captions file (`<filename>#<k><TAB><caption>` lines)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"Flickr30k captions file {path} does not exist")
    counts: Counter = Counter()
    with path.open(encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            name, tab, caption = line.rstrip("\n").partition("\t")
            filename, hash_sign, k = name.rpartition("#")
            if not tab or not hash_sign or not k.isdigit() or not caption.strip():
                raise ValueError(f"Flickr30k captions file {path} line {number}: expected "
                                 f"'<filename>#<k><TAB><caption>', got {line[:80]!r}")
            counts[filename] += 1
    return dict(counts)


def check_captions_file(path: str | os.PathLike, split: RetrievalSplit, split_json: str | os.PathLike) -> None:
    """Every image of the split has as many captions in the official captions file as in the split JSON."""
    in_file = read_captions_file(path)
    in_json = Counter(c.imgid for c in split.captions)
    wrong = [(image.filename, in_json[image.imgid], in_file.get(image.filename, 0)) for image in split.images
             if in_file.get(image.filename, 0) != in_json[image.imgid]]
    if wrong:
        raise ValueError(f"Flickr30k captions file {path} does not go with {split_json}: {len(wrong)} images have "
                         f"another number of captions, e.g. (filename, in the split JSON, in the captions file) "
                         f"{wrong[:3]}")


def load_split(sources: Mapping[str, str], split: str) -> RetrievalSplit:
    """The split from `sources.flickr30k` (split_json, captions), the two files checked against each other."""
    data = load_karpathy_split(sources["split_json"], split)
    check_captions_file(sources["captions"], data, sources["split_json"])
    return data


# ---- the metric ----------------------------------------------------------------------------------

def score_matrix(rows: Sequence[Mapping[str, Any]], data: RetrievalSplit, where: str) -> np.ndarray:
    """[captions, images] scores from prediction rows, in the split's order; every pair of the split exactly
    once, or an error naming `where` and the pair."""
    caption_index = {c.sentid: i for i, c in enumerate(data.captions)}
    image_index = {image.imgid: j for j, image in enumerate(data.images)}
    scores = np.zeros((len(caption_index), len(image_index)), dtype=np.float64)
    seen = np.zeros(scores.shape, dtype=bool)
    for n, row in enumerate(rows):
        image_id, caption_ids, values = row.get("image_id"), row.get("caption_ids"), row.get("scores")
        if not isinstance(caption_ids, list) or not isinstance(values, list) or len(caption_ids) != len(values):
            raise ValueError(f"{where}: prediction #{n} is not {{'image_id', 'caption_ids': [...], 'scores': [...]}} "
                             "with as many scores as caption ids")
        if image_id not in image_index:
            raise ValueError(f"{where}: prediction #{n}: image_id {image_id!r} is not an image of the split")
        j = image_index[image_id]
        for caption_id, value in zip(caption_ids, values):
            if caption_id not in caption_index:
                raise ValueError(f"{where}: prediction #{n}: caption_id {caption_id!r} is not a caption of the split")
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
                raise ValueError(f"{where}: prediction #{n}: caption {caption_id} has score {value!r}; expected a "
                                 "finite number")
            i = caption_index[caption_id]
            if seen[i, j]:
                raise ValueError(f"{where}: caption {caption_id} with image {image_id} is predicted twice")
            seen[i, j] = True
            scores[i, j] = value
    if not seen.all():
        missing = np.argwhere(~seen)
        examples = [(data.captions[i].sentid, data.images[j].imgid) for i, j in missing[:3]]
        raise ValueError(f"{where}: predictions do not cover the split: {len(missing)} of {seen.size} "
                         f"(caption, image) pairs missing, e.g. {examples}")
    return scores


def true_image_ranks(scores: np.ndarray, true_columns: np.ndarray) -> np.ndarray:
    """1-based rank of each caption's own image: 1 + the number of other images scored at least as high (a tie
    counts against the true image)."""
    true_scores = scores[np.arange(len(scores)), true_columns]
    return (scores >= true_scores[:, None]).sum(axis=1)  # the true image itself counts once: the 1 of the rank


def recall_at_k(ranks: Sequence[int] | np.ndarray, k: int) -> float:
    """Percent of captions whose own image ranks k or better."""
    ranks = np.asarray(ranks)
    if ranks.size == 0:
        raise ValueError("recall@K needs at least one caption")
    return 100.0 * float((ranks <= k).sum()) / ranks.size


def top_images(scores_row: np.ndarray, true_column: int, image_ids: np.ndarray, k: int) -> list[int]:
    """The k best image ids of one caption, in the order its rank counts them: score descending, then on a tie
    the other images before the true one, then image id."""
    is_true = np.zeros(len(scores_row), dtype=np.int8)
    is_true[true_column] = 1
    order = np.lexsort((image_ids, is_true, -scores_row))  # the last key sorts first
    return [int(image_ids[j]) for j in order[:k]]


def score_retrieval(rows: Sequence[Mapping[str, Any]], data: RetrievalSplit, where: str) -> tuple[float, list[dict]]:
    """(R@1 in percent, one scored row per caption) of image retrieval over the split's images."""
    scores = score_matrix(rows, data, where)
    image_column = {image.imgid: j for j, image in enumerate(data.images)}
    true_columns = np.array([image_column[c.imgid] for c in data.captions])
    ranks = true_image_ranks(scores, true_columns)
    image_ids = np.array([image.imgid for image in data.images])
    scored = []
    for i, caption in enumerate(data.captions):
        rank = int(ranks[i])
        scored.append({"caption_id": caption.sentid, "image_id": caption.imgid, "rank": rank,
                       "num_images": len(data.images),
                       "top_images": top_images(scores[i], int(true_columns[i]), image_ids, TOP_IMAGES_LISTED),
                       **{f"hit_at_{k}": rank <= k for k in RECALL_KS}})
    return recall_at_k(ranks, 1), scored


# ---- the task ------------------------------------------------------------------------------------

class RetrievalTask(Task):
    """Caption-based image retrieval on Flickr30k with detected RoIs: a matching score per (caption, image) from
    the model's pooled vector, trained as ViLBERT's 4-way multiple choice, evaluated with R@1/5/10 over every
    test caption x every test image.

    One eval task, `retrieval`, on split `test`: its metric is R@1 and R@5 / R@10 (and the number of images
    ranked) are secondary metrics of the same eval JSON, since all three come from one captions x images score
    matrix: separate eval tasks would run the costly predictions three times. Not part of Tables 1-4 or of
    the default run (no paper table, no ablation column).
    """

    name = "retrieval"
    dataset = "flickr30k"
    metric = "recall_at_1"
    eval_splits = ("test",)
    roi_dataset = "flickr30k"
    owned_modules = ("tasks/retrieval.py", "tasks/modeling/retrieval.py")
    paper_table = None
    ablation_columns = ()
    # R@1 of the fine-tuned model; R@5 / R@10 and the zero-shot recalls are in results/tables/retrieval.csv
    comparison_columns = (TableColumn("retrieval_r1", "Flickr30k image retrieval R@1 test", "retrieval", "test"),)
    example_key = ("caption_id",)
    outcome_field = "hit_at_1"  # the caption's own image ranks first
    paired_test = "mcnemar"

    def prepare(self, meta, hparams, sources):
        hard = int(hparams.get("hard_negatives", DEFAULT_HARD_NEGATIVES))
        if hard < 1:
            raise ValueError(f"finetune.{self.name}.hard_negatives must be at least 1, got {hard}")
        meta["hard_negatives"] = hard

    def build_data(self, split, meta, *, sources, tokens, images, max_rois, max_text_len, rois, rois_source,
                   eval_task=None, max_examples=None):
        data = load_split(sources, split)
        images_dir = Path(sources["images"])
        image_entries = [(image.imgid, image.key, images_dir / image.filename) for image in data.images]
        captions = [(c.sentid, c.text, c.imgid) for c in data.captions]
        common = dict(rois=rois or {}, rois_source=rois_source, tokens=tokens, images_loader=images,
                      max_rois=max_rois, max_text_len=max_text_len)
        if eval_task is None:
            RetrievalTrainData = model_side("modeling.retrieval", "RetrievalTrainData")
            return RetrievalTrainData(captions, image_entries, hard_negatives=int(meta["hard_negatives"]),
                                      max_examples=max_examples, **common)
        RetrievalPairData = model_side("modeling.retrieval", "RetrievalPairData")
        return RetrievalPairData(captions, image_entries, **common)

    def log_training_data(self, data, meta):
        log.info("retrieval: trained on %d captions of %d images, 4 candidates each (hard negative picked among "
                 "%d images)", len(data), data.num_images, meta["hard_negatives"])

    def roi_image_paths(self, split, sources):
        images_dir = Path(sources["images"])
        return {image.key: images_dir / image.filename
                for image in load_karpathy_split(sources["split_json"], split).images}

    def build_heads(self, spec, meta):
        PairScoreHead = model_side("modeling.retrieval", "PairScoreHead")

        return TaskHeads(PairScoreHead(spec.pooled_width, spec.dropout))

    def loss(self, model, out, extras, meta):
        four_way_loss = model_side("modeling.retrieval", "four_way_loss")

        loss, stats = four_way_loss(model, out, extras)
        return TaskLoss(loss, stats)

    def prediction_rows(self, model, data, indices, out, extras, meta, eval_task):
        return data.prediction_rows(indices, out["logits"].tolist())

    # ---- a user's queries: each (image, caption) query gets the pair's matching score ----------------

    def query_data(self, queries, meta, *, tokens, images, max_rois, max_text_len, rois, rois_source, workdir):
        RetrievalPairData = model_side("modeling.retrieval", "RetrievalPairData")

        texts: dict[str, int] = {}
        image_entries: dict[str, tuple] = {}
        pairs = []
        for i, query in enumerate(queries):
            text = query_text(query, i, "the caption")
            check_text_fits(len(tokens.ids(text)), max_text_len - RetrievalPairData.SPECIAL_TOKENS, max_text_len,
                            f"query #{i}: the caption")
            caption_id = texts.setdefault(text, len(texts))
            key = query["image_key"]
            image_entries.setdefault(key, (len(image_entries), key, Path(query["image_path"])))
            pairs.append((caption_id, image_entries[key][0]))
        captions = [(caption_id, text, None) for text, caption_id in texts.items()]
        return RetrievalPairData(captions, list(image_entries.values()), rois=rois, rois_source=rois_source,
                                 tokens=tokens, images_loader=images, max_rois=max_rois, max_text_len=max_text_len,
                                 pairs=pairs)

    def query_results(self, model, data, indices, out, extras, meta, top_k):
        # the head's logit: trained by a softmax over four candidates, it ranks images for one caption (higher is
        # a better match) but is no probability; rank_images() orders a folder by it
        return [{"score": round(float(v), 6)} for v in out["logits"].tolist()]

    # ---- metric ----------------------------------------------------------------------------------

    def score(self, eval_task, split, rows, sources, where):
        return score_retrieval(rows, load_split(sources, split), where)

    def baseline(self, eval_task, split, sources, *, rois=(), max_rois=None):
        num_images = len(load_split(sources, split).images)
        return Baseline(100.0 / num_images, f"chance: 1 of the split's {num_images} images ranked first")

    def secondary_metrics(self, eval_task, split, scored_rows):
        ranks = [row["rank"] for row in scored_rows]
        numbers: dict[str, float] = {f"recall_at_{k}": recall_at_k(ranks, k) for k in RECALL_KS if k != 1}
        numbers["num_images"] = scored_rows[0]["num_images"] if scored_rows else 0
        return numbers


IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png")


def rank_images(predictor, caption: str, images: str | os.PathLike | Sequence[str], top_k: int = 5) -> list[dict]:
    """The `top_k` images that best match `caption`, best first: `[{"image", "score", "rank"}]`.

    `predictor` is a `vlbert_core.predict.Predictor` of a fine-tuned retrieval model (passed in: this module
    must not import the predictor, which imports the task registry); `images` a folder (its .jpg/.jpeg/.png
    files) or a list of image paths or URLs. Ties go to the image listed first (folders: sorted by name)."""
    if isinstance(images, (str, os.PathLike)) and Path(images).is_dir():
        folder = Path(images)
        sources = [str(p) for p in sorted(folder.iterdir()) if p.suffix.lower() in IMAGE_SUFFIXES]
        if not sources:
            raise ValueError(f"folder {folder} has no {'/'.join(IMAGE_SUFFIXES)} image")
    elif isinstance(images, (str, os.PathLike)):
        raise ValueError(f"{images} is not a folder; give a folder or a list of images")
    else:
        sources = [str(s) for s in images]
    answers = predictor.predict([{"image": source, "text": caption} for source in sources], top_k=1)
    order = sorted(range(len(answers)), key=lambda n: (-answers[n]["score"], n))
    return [{"image": answers[n]["image"], "score": answers[n]["score"], "rank": r + 1}
            for r, n in enumerate(order[: int(top_k)])]
