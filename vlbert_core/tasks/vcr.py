"""VCR: loaders of the official `{split}.jsonl` + per-image metadata JSON, the mixed-token text
with object references, and the Q->A, QA->R and Q->AR metrics.

Text: VCR tokens are strings or lists of object indices (`[0, 2]`). As in the released VL-BERT
code, a reference becomes the object's name from the row's `objects` list ("person", "bottle");
a reference to several objects joins the names with "and". Every WordPiece of a name remembers
the object it came from, so the caller can give those word positions the referenced box's visual
feature (box i of the metadata is box i + 1 of the model input; box 0 is the whole image).

Torch-free (the derived-eval job scores Q->AR with it, without torch).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, Sequence

import numpy as np

from vlbert_core.utils import get_logger

from .base import (
    NO_TEST_LABELS,
    Baseline,
    PaperTable,
    TableColumn,
    Task,
    TaskHeads,
    TaskLoss,
    check_prediction_ids,
    check_text_fits,
    model_side,
    split_path,
)

log = get_logger(__name__)

NUM_CANDIDATES = 4
Q2AR = "vcr_q2ar"  # the derived eval task: answer and rationale both right
NO_OBJECT = -1  # reference value of a word that names no object


@dataclass
class VcrItem:
    annot_id: str
    img_fn: str  # relative to the VCR image folder
    metadata_fn: str  # relative to the VCR image folder
    objects: list[str]  # object names, index = object reference
    question: list  # mixed tokens: str or list[int]
    answer_choices: list[list]
    rationale_choices: list[list]
    answer_label: int | None  # None on the test split
    rationale_label: int | None


@dataclass
class VcrMetadata:
    boxes: np.ndarray  # N x 4 float32 x1,y1,x2,y2 in original pixels
    scores: np.ndarray  # N
    names: list[str]
    width: int
    height: int
    # per object, its segmentation polygons (each K x 2, x,y in original pixels); None when the file has none
    segms: list[list[np.ndarray]] | None = None


def instance_mask(polygons: Sequence[np.ndarray], box: Sequence[float], size: int) -> np.ndarray:
    """A size x size mask of an object inside its box (the released VCR model multiplies each RoI's stage-5
    output by it): the polygons are mapped into the box's size x size grid, x' = (x - x1) * size / (x2 - x1 + 1),
    clamped to [0, size - 1], and a cell (r, c) is 1 when its point lies inside a polygon or on its outline, as
    the authors' common/utils/mask.py rasterises them with skimage.draw.polygon. No polygon: the whole box."""
    if not polygons:
        return np.ones((size, size), dtype=np.float32)
    x1, y1, x2, y2 = (float(v) for v in box[:4])
    mask = np.zeros((size, size), dtype=bool)
    rows, cols = np.meshgrid(np.arange(size, dtype=np.float64), np.arange(size, dtype=np.float64), indexing="ij")
    for polygon in polygons:
        points = np.asarray(polygon, dtype=np.float64).reshape(-1, 2)
        xs = np.clip((points[:, 0] - x1) * size / (x2 - x1 + 1), 0, size - 1)
        ys = np.clip((points[:, 1] - y1) * size / (y2 - y1 + 1), 0, size - 1)
        inside = np.zeros((size, size), dtype=bool)
        on_outline = np.zeros((size, size), dtype=bool)
        for j in range(len(points)):
            xa, ya, xb, yb = xs[j - 1], ys[j - 1], xs[j], ys[j]
            crosses = (ya > rows) != (yb > rows)                       # even-odd rule, ray towards +x
            with np.errstate(divide="ignore", invalid="ignore"):
                x_at = xa + (rows - ya) * (xb - xa) / (yb - ya)
            inside ^= crosses & (cols < x_at)
            cross = (xb - xa) * (rows - ya) - (yb - ya) * (cols - xa)
            on_outline |= (np.abs(cross) <= 1e-9 * max(1.0, abs(xb - xa) + abs(yb - ya))) \
                & (cols >= min(xa, xb) - 1e-9) & (cols <= max(xa, xb) + 1e-9) \
                & (rows >= min(ya, yb) - 1e-9) & (rows <= max(ya, yb) + 1e-9)
        mask |= inside | on_outline
    return mask.astype(np.float32)


def _check_tokens(tokens, num_objects: int, where: str) -> list:
    if not isinstance(tokens, list) or not tokens:
        raise ValueError(f"{where}: expected a non-empty token list, got {tokens!r}")
    for tok in tokens:
        if isinstance(tok, str):
            continue
        if not isinstance(tok, list) or not tok or not all(isinstance(i, int) for i in tok):
            raise ValueError(f"{where}: token {tok!r} is neither a string nor a list of object "
                             "indices")
        bad = [i for i in tok if not 0 <= i < num_objects]
        if bad:
            raise ValueError(f"{where}: object reference {bad} out of range for "
                             f"{num_objects} objects")
    return tokens


def vcr_item_from_row(row: dict, where: str) -> VcrItem:
    """One row of a VCR jsonl file, validated (references in range, 4 choices, labels 0..3)."""
    if not isinstance(row, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(row).__name__}")
    try:
        objects = [str(o) for o in row["objects"]]
        annot_id = str(row["annot_id"])
        item = VcrItem(
            annot_id=annot_id, img_fn=str(row["img_fn"]),
            metadata_fn=str(row["metadata_fn"]), objects=objects,
            question=_check_tokens(row["question"], len(objects), f"{where} question"),
            answer_choices=[_check_tokens(c, len(objects), f"{where} answer {k}")
                            for k, c in enumerate(row["answer_choices"])],
            rationale_choices=[_check_tokens(c, len(objects), f"{where} rationale {k}")
                               for k, c in enumerate(row["rationale_choices"])],
            answer_label=row.get("answer_label"),
            rationale_label=row.get("rationale_label"))
    except KeyError as exc:
        raise ValueError(f"{where}: missing field {exc}") from exc
    for name, choices in (("answer_choices", item.answer_choices),
                          ("rationale_choices", item.rationale_choices)):
        if len(choices) != NUM_CANDIDATES:
            raise ValueError(f"{where}: {name} has {len(choices)} entries, "
                             f"expected {NUM_CANDIDATES}")
    for name in ("answer_label", "rationale_label"):
        label = getattr(item, name)
        if label is not None and label not in range(NUM_CANDIDATES):
            raise ValueError(f"{where}: {name} {label!r} is not in 0..3")
    return item


def load_vcr(jsonl_path: str | os.PathLike) -> list[VcrItem]:
    """All rows of a VCR jsonl file, validated (references in range, 4 choices, labels 0..3).

    Fields the pipeline does not use (movie, question_orig, interesting_scores, ...) are ignored.
    """
    path = Path(jsonl_path)
    if not path.is_file():
        raise FileNotFoundError(f"VCR file {path} does not exist")
    items: list[VcrItem] = []
    seen: set[str] = set()
    with path.open() as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"VCR file {path} line {line_no}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{where}: not valid JSON: {exc}") from exc
            item = vcr_item_from_row(row, where)
            annot_id = item.annot_id
            if annot_id in seen:
                raise ValueError(f"{where}: duplicate annot_id {annot_id!r}")
            seen.add(annot_id)
            items.append(item)
    log.info("loaded %d VCR questions from %s", len(items), path)
    return items


def load_vcr_metadata(path: str | os.PathLike) -> VcrMetadata:
    """Boxes ([x1,y1,x2,y2,score] rows), names, width and height of one VCR image."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"VCR metadata {path} does not exist")
    try:
        meta = json.loads(path.read_text())
        raw = np.asarray(meta["boxes"], dtype=np.float32).reshape(-1, 5)
        names = [str(n) for n in meta["names"]]
        width, height = int(meta["width"]), int(meta["height"])
        segms = None
        if meta.get("segms"):   # absent or empty: no segmentation, each object is its whole box
            segms = [[np.asarray(polygon, dtype=np.float32).reshape(-1, 2) for polygon in obj] for obj in meta["segms"]]
    except (json.JSONDecodeError, KeyError, ValueError, TypeError) as exc:
        raise ValueError(f"VCR metadata {path}: {exc!r}") from exc
    if len(names) != len(raw):
        raise ValueError(f"VCR metadata {path}: {len(raw)} boxes but {len(names)} names")
    if segms is not None and len(segms) != len(raw):
        raise ValueError(f"VCR metadata {path}: {len(raw)} boxes but {len(segms)} segms")
    return VcrMetadata(boxes=raw[:, :4].copy(), scores=raw[:, 4].copy(), names=names,
                       width=width, height=height, segms=segms)


def check_metadata_matches(item: VcrItem, meta: VcrMetadata, source: str) -> None:
    if meta.names != item.objects:
        raise ValueError(f"VCR annot_id {item.annot_id}: objects {item.objects} differ from the "
                         f"names {meta.names} in {source}")


def mixed_tokens_to_words(tokens: Sequence, objects: Sequence[str]) -> list[tuple[str, int]]:
    """Mixed VCR tokens -> [(word, object index or NO_OBJECT)].

    `["is", [0, 2], "here"]` with objects person, dog, car ->
    is, person(0), and, car(2), here.
    """
    words: list[tuple[str, int]] = []
    for tok in tokens:
        if isinstance(tok, str):
            words.append((tok, NO_OBJECT))
            continue
        for k, obj in enumerate(tok):
            if k > 0:
                words.append(("and", NO_OBJECT))
            words.append((objects[obj], obj))
    return words


class _Tokenizer(Protocol):
    def tokenize(self, text: str) -> list[str]: ...
    def convert_tokens_to_ids(self, tokens: list[str]) -> list[int]: ...


def tokenize_with_refs(tokenizer: _Tokenizer, tokens: Sequence,
                       objects: Sequence[str]) -> tuple[list[int], list[int]]:
    """WordPiece ids of mixed VCR tokens and, per id, the referenced object (or NO_OBJECT)."""
    ids: list[int] = []
    refs: list[int] = []
    for word, obj in mixed_tokens_to_words(tokens, objects):
        pieces = tokenizer.convert_tokens_to_ids(tokenizer.tokenize(word))
        ids.extend(pieces)
        refs.extend([obj] * len(pieces))
    return ids, refs


def words_to_text(tokens: Sequence, objects: Sequence[str]) -> str:
    return " ".join(w for w, _ in mixed_tokens_to_words(tokens, objects))


def candidate_texts(item: VcrItem, mode: str) -> tuple[list, list[list]]:
    """(sentence A tokens, the 4 sentence B token lists) of one question.

    Q->A: A = question, B = each answer. QA->R: A = question + the correct answer (the standard
    VCR protocol conditions QA->R on the right answer), B = each rationale.
    """
    if mode == "q2a":
        return item.question, item.answer_choices
    if mode == "qa2r":
        if item.answer_label is None:
            raise ValueError(f"VCR annot_id {item.annot_id}: QA->R needs answer_label")
        return item.question + item.answer_choices[item.answer_label], item.rationale_choices
    raise ValueError(f"unknown VCR mode {mode!r} (expected 'q2a' or 'qa2r')")


def candidate_label(item: VcrItem, mode: str) -> int | None:
    return item.answer_label if mode == "q2a" else item.rationale_label


def vcr_correct(predictions: Sequence[int], labels: Sequence[int], where: str = "VCR") -> list[bool]:
    """Per question: the chosen candidate (argmax of the model's 4 scores) is the labelled one.

    A prediction or label that is not an integer 0..3 is an error naming its position.
    """
    if len(predictions) != len(labels):
        raise ValueError(f"{where}: {len(predictions)} predictions for {len(labels)} labels")
    correct = []
    for i, (prediction, label) in enumerate(zip(predictions, labels)):
        for name, value in (("prediction", prediction), ("label", label)):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) \
                    or not 0 <= value < NUM_CANDIDATES:
                raise ValueError(f"{where}: entry #{i} has {name} {value!r}; expected an integer "
                                 f"0..{NUM_CANDIDATES - 1}")
        correct.append(int(prediction) == int(label))
    return correct


def vcr_q2ar_correct(q2a_pred: Sequence[int], qa2r_pred: Sequence[int],
                     labels: Sequence[tuple[int, int]], where: str = "VCR Q->AR") -> list[bool]:
    """Per question: right only when both the answer and the rationale are right.

    `labels` holds (answer_label, rationale_label) pairs, aligned with the predictions. The
    QA->R prediction is the one made with the right answer in the query: when the answer is
    wrong the question is wrong whatever the rationale, so this equals conditioning on the
    predicted answer as the leaderboard does.
    """
    if not len(q2a_pred) == len(qa2r_pred) == len(labels):
        raise ValueError(f"Q->AR needs aligned inputs; got {len(q2a_pred)} Q->A predictions, "
                         f"{len(qa2r_pred)} QA->R predictions and {len(labels)} labels")
    answers = vcr_correct(q2a_pred, [a for a, _ in labels], f"{where} (answers)")
    rationales = vcr_correct(qa2r_pred, [r for _, r in labels], f"{where} (rationales)")
    return [a and r for a, r in zip(answers, rationales)]


def vcr_accuracy(correct: Sequence[bool]) -> float:
    """Accuracy in percent: correct / questions * 100, unrounded (the authors' code rounds only
    when printing)."""
    if not correct:
        raise ValueError("VCR accuracy needs at least one question")
    return 100.0 * sum(bool(c) for c in correct) / len(correct)


def read_vcr_predictions(path: str | os.PathLike) -> dict[str, dict]:
    """{annot_id: row} of a VCR predictions file (rows: annot_id, label, prediction,
    probabilities), written as JSON lines or as one JSON list."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"VCR predictions {path} do not exist")
    text = path.read_text()
    if text.lstrip().startswith("["):
        try:
            entries = list(enumerate(json.loads(text), start=1))
        except json.JSONDecodeError as exc:
            raise ValueError(f"VCR predictions {path}: not valid JSON: {exc}") from exc
        where = "entry"
    else:
        entries = []
        for line_no, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                entries.append((line_no, json.loads(line)))
            except json.JSONDecodeError as exc:
                raise ValueError(f"VCR predictions {path} line {line_no}: {exc}") from exc
        where = "line"
    rows: dict[str, dict] = {}
    for number, row in entries:
        try:
            annot_id = str(row["annot_id"])
            int(row["prediction"]), int(row["label"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"VCR predictions {path} {where} {number}: {exc!r} in {row!r}") from exc
        if annot_id in rows:
            raise ValueError(f"VCR predictions {path} {where} {number}: duplicate annot_id "
                             f"{annot_id!r}")
        rows[annot_id] = row
    return rows


def q2ar_correct_from_prediction_files(q2a_path: str | os.PathLike,
                                       qa2r_path: str | os.PathLike) -> dict[str, bool]:
    """{annot_id: Q->AR right} from the two prediction files, in annot_id order."""
    q2a = read_vcr_predictions(q2a_path)
    qa2r = read_vcr_predictions(qa2r_path)
    if set(q2a) != set(qa2r):
        only_a = sorted(set(q2a) - set(qa2r))[:5]
        only_r = sorted(set(qa2r) - set(q2a))[:5]
        raise ValueError(f"Q->A predictions {q2a_path} and QA->R predictions {qa2r_path} cover "
                         f"different questions (only in Q->A: {only_a}; only in QA->R: {only_r})")
    if not q2a:
        raise ValueError(f"no predictions in {q2a_path}")
    ids = sorted(q2a)
    correct = vcr_q2ar_correct([q2a[i]["prediction"] for i in ids],
                               [qa2r[i]["prediction"] for i in ids],
                               [(q2a[i]["label"], qa2r[i]["label"]) for i in ids],
                               f"Q->AR from {q2a_path} and {qa2r_path}")
    return dict(zip(ids, correct))


def q2ar_from_prediction_files(q2a_path: str | os.PathLike,
                               qa2r_path: str | os.PathLike) -> tuple[float, int]:
    """(Q->AR accuracy in percent, number of questions) from the two prediction files."""
    correct = list(q2ar_correct_from_prediction_files(q2a_path, qa2r_path).values())
    return vcr_accuracy(correct), len(correct)


def write_q2ar_json(q2a_path: str | os.PathLike, qa2r_path: str | os.PathLike,
                    json_path: str | os.PathLike, *, split: str, setting: str, schedule: str,
                    dataset: str) -> dict:
    """The Q->AR eval JSON from the two prediction files (written atomically).

    `predictions` names the Q->A file and `predictions_qa2r` the QA->R file; `model_dir` is None
    because the number comes from two fine-tuned models (named in those files' eval JSONs).
    """
    from vlbert_core.utils import atomic_path

    value, count = q2ar_from_prediction_files(q2a_path, qa2r_path)
    result = {"task": Q2AR, "metric": "accuracy", "value": value, "split": split,
              "num_examples": count, "predictions": str(q2a_path),
              "predictions_qa2r": str(qa2r_path), "setting": setting, "schedule": schedule,
              "model_dir": None, "dataset": dataset,
              **Baseline(100.0 / NUM_CANDIDATES ** 2, f"chance: 1 of the {NUM_CANDIDATES} answers, then 1 of the "
                                                       f"{NUM_CANDIDATES} rationales").fields()}
    with atomic_path(json_path) as tmp:
        tmp.write_text(json.dumps(result, indent=1) + "\n")
    log.info("%s %s: accuracy = %.2f over %d questions", Q2AR, split, value, count)
    return result


_REFERENCE = re.compile(r"\[\s*(\d+(?:\s*,\s*\d+)*)\s*\]")


def parse_references(text, num_objects: int, where: str) -> list:
    """A user's text -> VCR mixed tokens: `[0]` or `[0,2]` refer to objects by index, the rest are
    words. "Why is [0] smiling ?" -> ["Why", "is", [0], "smiling", "?"]. A token list in VCR's own
    format is checked and kept."""
    if isinstance(text, list):
        return _check_tokens(text, num_objects, where)
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"{where}: expected a text or a VCR token list, got {text!r}")
    tokens: list = []
    for k, part in enumerate(_REFERENCE.split(text)):
        if k % 2:
            tokens.append([int(i) for i in part.split(",")])
        else:
            tokens.extend(part.split())
    return _check_tokens(tokens, num_objects, where)


def write_query_metadata(path: Path, objects: list, width: int, height: int, where: str) -> list[str]:
    """The VCR metadata file of a user's objects ([{"name", "box": [x1, y1, x2, y2]}], in original
    pixels); returns their names."""
    if not isinstance(objects, list) or not objects:
        raise ValueError(f"{where}: needs objects [{{'name', 'box': [x1, y1, x2, y2]}}, ...] or a "
                         f"VCR metadata file, got {objects!r}")
    rows, names = [], []
    for k, obj in enumerate(objects):
        box = obj.get("box") if isinstance(obj, dict) else None
        name = obj.get("name") if isinstance(obj, dict) else None
        try:
            x1, y1, x2, y2 = (float(v) for v in box)
        except (TypeError, ValueError):
            raise ValueError(f"{where}: object #{k} {obj!r} needs a name and a box [x1, y1, x2, y2]") from None
        if not isinstance(name, str) or not name.strip() or not (0 <= x1 <= x2 and 0 <= y1 <= y2):
            raise ValueError(f"{where}: object #{k} {obj!r} needs a name and a box x1 <= x2, y1 <= y2 "
                             f"inside the {width}x{height} image")
        rows.append([x1, y1, x2, y2, 1.0])
        names.append(name.strip())
    path.write_text(json.dumps({"boxes": rows, "names": names, "width": int(width), "height": int(height)}))
    return names


def build_object_vocab(items: Sequence[VcrItem]) -> list[str]:
    """Sorted object names of the training questions: the classes of the auxiliary RoI loss."""
    names = sorted({name for item in items for name in item.objects})
    if not names:
        raise ValueError("no VCR object names to build the RoI-classification vocabulary from")
    return names


def score_vcr(rows: list[dict], jsonl_path: str, mode: str, where: str) -> tuple[float, list[dict]]:
    """Accuracy over the 4 candidates; the label (of `mode`, q2a or qa2r) comes from the official
    jsonl, not the predictions."""
    items = {item.annot_id: item for item in load_vcr(jsonl_path)}
    check_prediction_ids([r["annot_id"] for r in rows], list(items), "annot_id", where)
    scored = []
    for r in rows:
        item = items[r["annot_id"]]
        label = candidate_label(item, mode)
        if label is None:
            raise ValueError(f"{jsonl_path}: item {item.annot_id} has no label; cannot score VCR {mode}")
        scored.append({**r, "label": int(label)})
    correct = vcr_correct([r.get("prediction") for r in scored], [r["label"] for r in scored], where)
    return vcr_accuracy(correct), [{**r, "correct": c} for r, c in zip(scored, correct)]


# Table 1 of the paper; Q->AR is derived from the Q->A and QA->R predictions
VCR_TABLE = PaperTable(
    "table1_vcr",
    "Table 1: VCR accuracy (%)",
    (
        TableColumn("q2a_val", "Q→A val", "vcr_q2a", "val"),
        TableColumn("q2a_test", "Q→A test", None, None, NO_TEST_LABELS),
        TableColumn("qa2r_val", "QA→R val", "vcr_qa2r", "val"),
        TableColumn("qa2r_test", "QA→R test", None, None, NO_TEST_LABELS),
        TableColumn("q2ar_val", "Q→AR val", "vcr_q2ar", "val"),
        TableColumn("q2ar_test", "Q→AR test", None, None, NO_TEST_LABELS),
    ),
    decimals=1,
)


class VcrTask(Task):
    """VCR with the dataset's own boxes: four candidate sequences per question, a `[CLS]` score
    each, plus the auxiliary RoI classification with linguistic clues. `mode` picks Q->A or QA->R.

    Prediction rows: `{"annot_id", "prediction", "probabilities"}`.
    """

    mode: str
    dataset = "vcr"
    metric = "accuracy"
    rows_per_image = NUM_CANDIDATES
    owned_modules = ("tasks/vcr.py", "tasks/modeling/vcr.py")
    paper_table = VCR_TABLE
    example_key = ("annot_id",)

    def prepare(self, meta, hparams, sources):
        items = load_vcr(split_path(sources["annotations"], self.train_split))
        meta["object_names"] = build_object_vocab(items)
        meta["aux_roi_loss_weight"] = float(hparams["aux_roi_loss_weight"])
        # the authors pad every VCR image to a fixed canvas after normalising (FixPadding with the test SCALES,
        # vcr/data/transforms/build.py), which the border RoIs' features see; null: padded to the batch
        canvas = hparams.get("fixed_canvas")
        meta["fixed_canvas"] = None if canvas is None else [int(v) for v in canvas]

    def build_data(self, split, meta, *, sources, tokens, images, max_rois, max_text_len, rois,
                   rois_source, eval_task=None, max_examples=None):
        VcrData = model_side("modeling.vcr", "VcrData")

        items = load_vcr(split_path(sources["annotations"], split))
        items = items[:max_examples] if max_examples else items
        return VcrData(items, self.mode, sources["images"], tokens, meta.get("object_names") or [],
                       max_rois=max_rois, max_text_len=max_text_len, images=images,
                       instance_mask_size=meta.get("instance_mask_size"), fixed_canvas=meta.get("fixed_canvas"))

    def log_training_data(self, data, meta):
        if data.dropped_references:
            log.info("%d object-reference word pieces pointed at boxes cut by max_rois=%d; they "
                     "took the whole-image feature", data.dropped_references, meta["max_rois"])

    def build_heads(self, spec, meta):
        VCRHead = model_side("modeling.vcr", "VCRHead")
        VCRRoIClassifier = model_side("modeling.vcr", "VCRRoIClassifier")

        return TaskHeads(VCRHead(spec.pooled_width, spec.dropout, layout=spec.layout),
                         VCRRoIClassifier(spec.visual_width, len(meta["object_names"]), spec.dropout,
                                          layout=spec.layout, hidden_act=spec.hidden_act))

    def scores(self, model, output, batch):
        result = {"scores": model.head(output, batch, NUM_CANDIDATES)}
        if model.training:
            result["roi_logits"] = model.roi_classifier(output, batch)
        return result

    def loss(self, model, out, extras, meta):
        VCRHead = model_side("modeling.vcr", "VCRHead")
        VCRRoIClassifier = model_side("modeling.vcr", "VCRRoIClassifier")

        answer_loss = VCRHead.loss(out["scores"], extras["label"])
        roi_loss = VCRRoIClassifier.loss(out["roi_logits"], extras["box_classes"])
        accuracy = (out["scores"].argmax(dim=1) == extras["label"]).float().mean()
        return TaskLoss(answer_loss + float(meta["aux_roi_loss_weight"]) * roi_loss,
                        {"answer_loss": answer_loss.item(), "roi_cls_loss": roi_loss.item(),
                         "accuracy": accuracy.item()})

    def prediction_rows(self, model, data, indices, out, extras, meta, eval_task):
        import torch

        rows = []
        # the choice is the argmax of the scores, as the authors' code takes it (softmax can tie
        # two scores that differ)
        choices = out["scores"].argmax(dim=1).tolist()
        probabilities = torch.softmax(out["scores"], dim=1)
        for i, choice, probs in zip(indices, choices, probabilities):
            rows.append({"annot_id": data.items[i].annot_id, "prediction": int(choice),
                         "probabilities": [round(float(p), 6) for p in probs]})
        return rows

    def queries_from_file(self, path, *, key=None, images_dir=None):
        path = Path(path)
        text = path.read_text() if path.is_file() else ""
        try:  # one VCR row written as a (possibly pretty-printed) JSON object
            row = json.loads(text)
        except json.JSONDecodeError:
            row = None
        if isinstance(row, dict):
            items = [vcr_item_from_row(row, f"VCR question file {path}")]
        else:
            items = load_vcr(path)
        if key is not None:
            items = [it for it in items if it.annot_id == str(key)]
            if not items:
                raise ValueError(f"VCR file {path} has no question with annot_id {key!r}")
        images_dir = Path(images_dir) if images_dir is not None else path.parent
        queries = []
        for item in items:
            image, metadata = images_dir / item.img_fn, images_dir / item.metadata_fn
            if not image.is_file() or not metadata.is_file():
                raise FileNotFoundError(f"VCR annot_id {item.annot_id}: {image} or {metadata} does not exist; "
                                        f"--images-dir names the folder img_fn and metadata_fn are relative to")
            check_metadata_matches(item, load_vcr_metadata(metadata), str(metadata))
            query = {"annot_id": item.annot_id, "image": str(image), "metadata": str(metadata),
                     "text": item.question}
            if self.mode == "q2a":
                query["choices"] = item.answer_choices
            else:
                if item.answer_label is None:
                    raise ValueError(f"VCR annot_id {item.annot_id} in {path}: QA->R is conditioned on the "
                                     f"right answer, and the question has no answer_label")
                query.update(answer=item.answer_choices[item.answer_label], choices=item.rationale_choices)
            queries.append(query)
        return queries

    def query_data(self, queries, meta, *, tokens, images, max_rois, max_text_len, rois, rois_source, workdir):
        VcrData = model_side("modeling.vcr", "VcrData")

        items = []
        for i, query in enumerate(queries):
            where = f"query #{i}"
            if query.get("metadata"):
                names = load_vcr_metadata(query["metadata"]).names
                metadata = Path(query["metadata"])
            else:
                metadata = Path(workdir) / f"query{i}.json"
                names = write_query_metadata(metadata, query.get("objects"), query["image_w"], query["image_h"],
                                             where)
            question = parse_references(query.get("text"), len(names), f"{where} question")
            choices = query.get("choices")
            if not isinstance(choices, list) or len(choices) != NUM_CANDIDATES:
                what = "answers" if self.mode == "q2a" else "rationales"
                raise ValueError(f"{where}: needs {NUM_CANDIDATES} candidate {what}, got {choices!r}")
            choices = [parse_references(c, len(names), f"{where} choice {k}") for k, c in enumerate(choices)]
            item = VcrItem(annot_id=str(query.get("annot_id", i)), img_fn=str(query["image_path"]),
                           metadata_fn=str(metadata), objects=names, question=question,
                           answer_choices=choices, rationale_choices=[], answer_label=None, rationale_label=None)
            if self.mode == "qa2r":
                if query.get("answer") is None:
                    raise ValueError(f"{where}: a QA->R model ranks rationales for a question and its answer; "
                                     f"give the answer")
                # the one given answer is the one the rationales are ranked for
                answer = parse_references(query["answer"], len(names), f"{where} answer")
                item.answer_choices, item.answer_label, item.rationale_choices = [answer], 0, choices
            text_a, candidates = candidate_texts(item, self.mode)
            ids_a, _ = tokenize_with_refs(tokens.tokenizer, text_a, names)
            for k, text_b in enumerate(candidates):
                ids_b, _ = tokenize_with_refs(tokens.tokenizer, text_b, names)
                check_text_fits(len(ids_a) + len(ids_b), max_text_len - VcrData.SPECIAL_TOKENS, max_text_len,
                                f"{where}: the question and choice {k}")
            items.append(item)
        # img_fn and metadata_fn are local paths, absolute or relative to the working directory
        return VcrData(items, self.mode, ".", tokens, meta.get("object_names") or [], max_rois=max_rois,
                       max_text_len=max_text_len, images=images, with_labels=False,
                       fixed_canvas=meta.get("fixed_canvas"))

    def query_results(self, model, data, indices, out, extras, meta, top_k):
        import torch

        probabilities = torch.softmax(out["scores"], dim=1)
        results = []
        for row, i in enumerate(indices):
            item = data.items[i]
            _, candidates = candidate_texts(item, self.mode)
            order = out["scores"][row].argsort(descending=True, stable=True).tolist()  # argmax first
            results.append({"mode": self.mode, "choice": order[0],
                            "ranking": [{"choice": k, "text": words_to_text(candidates[k], item.objects),
                                         "probability": round(float(probabilities[row, k]), 6)} for k in order]})
        return results

    def score(self, eval_task, split, rows, sources, where):
        return score_vcr(rows, split_path(sources["annotations"], split), self.mode, where)

    def baseline(self, eval_task, split, sources, *, rois=(), max_rois=None):
        return Baseline(100.0 / NUM_CANDIDATES, f"chance: 1 of the {NUM_CANDIDATES} candidates")



class VcrQ2ATask(VcrTask):
    """VCR Q->A: <Question, Answer candidate, Image>."""

    name = "vcr_q2a"
    mode = "q2a"
    # Q->AR is right when both Q->A and QA->R are: scored from both tasks' predictions
    derived_eval_tasks = (Q2AR,)
    ablation_columns = (TableColumn("vcr_q2a_val", "VCR Q→A val", "vcr_q2a", "val"),)

    def derived_inputs(self, derived):
        if derived == Q2AR:
            return (VcrQ2ATask.name, VcrQA2RTask.name)
        return super().derived_inputs(derived)

    def derive(self, derived, predictions, json_path, *, split, setting, schedule, dataset):
        inputs = self.derived_inputs(derived)
        missing = [name for name in inputs if name not in predictions]
        if missing:
            raise ValueError(f"{derived} {split}: no predictions file given for {missing} "
                             f"(got {sorted(predictions)})")
        return write_q2ar_json(predictions[VcrQ2ATask.name], predictions[VcrQA2RTask.name], json_path,
                               split=split, setting=setting, schedule=schedule, dataset=dataset)

    def outcome_eval_tasks(self, eval_task):
        if eval_task in self.derived_eval_tasks:
            return self.derived_inputs(eval_task)
        return super().outcome_eval_tasks(eval_task)

    def example_outcomes(self, eval_task, prediction_files):
        if eval_task != Q2AR:
            return super().example_outcomes(eval_task, prediction_files)
        correct = q2ar_correct_from_prediction_files(*prediction_files)
        return {(annot_id,): float(c) for annot_id, c in correct.items()}


class VcrQA2RTask(VcrTask):
    """VCR QA->R: <Question + right Answer, Rationale candidate, Image>."""

    name = "vcr_qa2r"
    mode = "qa2r"
    ablation_columns = (TableColumn("vcr_qa2r_val", "VCR QA→R val", "vcr_qa2r", "val"),)
