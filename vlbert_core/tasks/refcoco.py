"""RefCOCO+: loaders of the UNC `refs(unc).p` pickle and the COCO `instances.json`, box IoU, and
the accuracy@0.5 metric.

One sample per (ref, sentence), as in the UNC splits (train / val / testA / testB). Boxes are
x1,y1,x2,y2 with x2 = x + w, y2 = y + h from the COCO `bbox` x,y,w,h, as the released VL-BERT code
builds them; their IoU is the one that code scores with (docs/metrics.md): widths, heights and
overlaps count pixels inclusively (x2 - x1 + 1), so boxes that only touch overlap by one pixel
row. Torch-free.
"""

from __future__ import annotations

import json
import os
import pickle
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from vlbert_core.utils import get_logger
from vlbert_core.safe_pickle import UnsafePickleError, load_pickle

from .base import (Baseline, PaperTable, TableColumn, Task, TaskHeads, TaskLoss, check_prediction_ids, check_text_fits,
                   model_side, query_text)

log = get_logger(__name__)

SPLITS = ("train", "val", "testA", "testB")
POSITIVE_IOU = 0.5  # a RoI is a positive training target when IoU > 0.5
CORRECT_IOU = 0.5  # a prediction is correct when IoU >= 0.5


def box_iou(boxes_a: np.ndarray, boxes_b: np.ndarray) -> np.ndarray:
    """IoU matrix (N x M) of x1,y1,x2,y2 boxes, pixel-inclusive as in VL-BERT's RefCOCO+ scoring.

    overlap = max(0, min(x2) - max(x1) + 1) * max(0, min(y2) - max(y1) + 1) and
    area = (x2 - x1 + 1) * (y2 - y1 + 1); a pair whose union is not positive (only boxes with
    x2 < x1 or y2 < y1 give one) has IoU 0.
    """
    a = np.asarray(boxes_a, dtype=np.float64).reshape(-1, 4)
    b = np.asarray(boxes_b, dtype=np.float64).reshape(-1, 4)
    ix1 = np.maximum(a[:, None, 0], b[None, :, 0])
    iy1 = np.maximum(a[:, None, 1], b[None, :, 1])
    ix2 = np.minimum(a[:, None, 2], b[None, :, 2])
    iy2 = np.minimum(a[:, None, 3], b[None, :, 3])
    inter = np.clip(ix2 - ix1 + 1, 0, None) * np.clip(iy2 - iy1 + 1, 0, None)
    area_a = (a[:, 2] - a[:, 0] + 1) * (a[:, 3] - a[:, 1] + 1)
    area_b = (b[:, 2] - b[:, 0] + 1) * (b[:, 3] - b[:, 1] + 1)
    union = area_a[:, None] + area_b[None, :] - inter
    with np.errstate(divide="ignore", invalid="ignore"):
        iou = np.where(union > 0, inter / np.where(union > 0, union, 1.0), 0.0)
    return iou


def xywh_to_xyxy(bbox) -> np.ndarray:
    """COCO x,y,w,h -> x1,y1,x2,y2, added in float64 as the scoring code does (a float32 sum
    can move an IoU across 0.5)."""
    x, y, w, h = (float(v) for v in bbox)
    return np.array([x, y, x + w, y + h], dtype=np.float64)


@dataclass
class RefExpression:
    ref_id: int
    sent_id: int
    ann_id: int
    image_id: int
    split: str
    sentence: str
    category_id: int
    image_key: str  # file stem of the COCO image
    image_w: int
    image_h: int
    gt_box: np.ndarray | None  # 4, x1,y1,x2,y2 in original pixels; None for a user's query


@dataclass
class RefcocoData:
    expressions: list[RefExpression]
    # ground-truth track candidates: every instance box of the image, by annotation id
    image_boxes: dict[int, np.ndarray]  # image_id -> N x 4
    image_ann_ids: dict[int, list[int]]
    image_files: dict[int, str]  # image_id -> file name


def _load_refs(path: Path) -> list[dict]:
    if not path.is_file():
        raise FileNotFoundError(f"RefCOCO+ refs {path} do not exist")
    try:
        try:
            refs = load_pickle(path, encoding="ASCII")
        except UnicodeDecodeError:
            # the published file was pickled by Python 2; its byte strings decode as latin-1
            refs = load_pickle(path, encoding="latin1")
    except UnsafePickleError:
        raise
    except pickle.UnpicklingError as exc:
        raise ValueError(f"RefCOCO+ refs {exc}") from exc
    if not isinstance(refs, list):
        raise ValueError(f"RefCOCO+ refs {path}: expected a list of refs, got {type(refs).__name__}")
    return refs


def _load_instances(path: Path) -> dict:
    if not path.is_file():
        raise FileNotFoundError(f"COCO instances {path} do not exist")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"COCO instances {path} is not valid JSON: {exc}") from exc
    for key in ("images", "annotations"):
        if not isinstance(data.get(key), list):
            raise ValueError(f"COCO instances {path} has no '{key}' list")
    return data


def load_refcoco(refs_path: str | os.PathLike, instances_path: str | os.PathLike,
                 split: str | None = None) -> RefcocoData:
    """Expressions of one UNC split (all splits when None) and the instance boxes of their images.

    Fields the pipeline does not use (tokens, raw, file_name of the ref, categories, ...) are
    ignored; a ref whose annotation or image is missing from the instances file is an error.
    """
    if split is not None and split not in SPLITS:
        raise ValueError(f"unknown RefCOCO+ split {split!r} (expected one of {SPLITS})")
    refs_path, instances_path = Path(refs_path), Path(instances_path)
    refs = _load_refs(refs_path)
    instances = _load_instances(instances_path)
    images = {}
    for i, img in enumerate(instances["images"]):
        try:
            images[int(img["id"])] = img
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"COCO instances {instances_path} image #{i}: {exc!r}") from exc
    anns: dict[int, dict] = {}
    boxes_by_image: dict[int, list[tuple[int, np.ndarray]]] = {}
    for i, ann in enumerate(instances["annotations"]):
        try:
            ann_id, image_id, box = int(ann["id"]), int(ann["image_id"]), xywh_to_xyxy(ann["bbox"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"COCO instances {instances_path} annotation #{i}: {exc!r}") from exc
        anns[ann_id] = ann
        boxes_by_image.setdefault(image_id, []).append((ann_id, box))

    expressions: list[RefExpression] = []
    used_images: set[int] = set()
    for i, ref in enumerate(refs):
        where = f"RefCOCO+ refs {refs_path} ref #{i}"
        try:
            ref_split = str(ref["split"])
            if split is not None and ref_split != split:
                continue
            ref_id, ann_id, image_id = int(ref["ref_id"]), int(ref["ann_id"]), int(ref["image_id"])
            sentences = list(ref["sentences"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{where}: bad or missing field ({exc!r})") from exc
        if ann_id not in anns:
            raise ValueError(f"{where} (ref_id {ref_id}): ann_id {ann_id} is not in {instances_path}")
        if image_id not in images:
            raise ValueError(f"{where} (ref_id {ref_id}): image_id {image_id} is not in "
                             f"{instances_path}")
        if int(anns[ann_id]["image_id"]) != image_id:
            raise ValueError(f"{where} (ref_id {ref_id}): ann_id {ann_id} belongs to image "
                             f"{anns[ann_id]['image_id']}, not {image_id}")
        img = images[image_id]
        if not sentences:
            raise ValueError(f"{where} (ref_id {ref_id}) has no sentences")
        for k, sent in enumerate(sentences):
            try:
                text, sent_id = str(sent["sent"]), int(sent["sent_id"])
            except (KeyError, TypeError, ValueError) as exc:
                raise ValueError(f"{where} (ref_id {ref_id}) sentence #{k}: {exc!r}") from exc
            expressions.append(RefExpression(
                ref_id=ref_id, sent_id=sent_id, ann_id=ann_id, image_id=image_id, split=ref_split,
                sentence=text, category_id=int(ref.get("category_id", anns[ann_id].get("category_id", 0))),
                image_key=Path(img["file_name"]).stem, image_w=int(img["width"]),
                image_h=int(img["height"]), gt_box=xywh_to_xyxy(anns[ann_id]["bbox"])))
        used_images.add(image_id)

    image_boxes, image_ann_ids = {}, {}
    for image_id in used_images:
        entries = sorted(boxes_by_image.get(image_id, []), key=lambda e: e[0])
        image_ann_ids[image_id] = [a for a, _ in entries]
        image_boxes[image_id] = np.stack([b for _, b in entries]).astype(np.float32)
    log.info("loaded %d RefCOCO+ expressions (%s) over %d images from %s", len(expressions),
             split or "all splits", len(used_images), refs_path)
    return RefcocoData(expressions=expressions, image_boxes=image_boxes,
                       image_ann_ids=image_ann_ids,
                       image_files={i: str(images[i]["file_name"]) for i in used_images})


def refcoco_image_paths(refs_path: str | os.PathLike, instances_path: str | os.PathLike,
                        images_dir: str | os.PathLike, split: str) -> dict[str, Path]:
    """{image file stem: path} of the images the refs of one split refer to."""
    data = load_refcoco(refs_path, instances_path, split)
    return {Path(name).stem: Path(images_dir) / name for name in data.image_files.values()}


def check_predicted_boxes(boxes, where: str) -> np.ndarray:
    """The predicted boxes as an N x 4 float array; a box that is not 4 finite numbers with
    x1 <= x2 and y1 <= y2 is an error naming its row."""
    rows = []
    for i, box in enumerate(boxes):
        try:
            values = np.asarray(box, dtype=np.float64)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{where}: prediction #{i} box {box!r} is not numeric ({exc})") from None
        if values.shape != (4,) or not np.all(np.isfinite(values)) \
                or values[2] < values[0] or values[3] < values[1]:
            raise ValueError(f"{where}: prediction #{i} box {box!r} is not x1,y1,x2,y2 with "
                             "x1 <= x2 and y1 <= y2")
        rows.append(values)
    return np.stack(rows) if rows else np.zeros((0, 4))


def refcoco_accuracy(predicted_boxes: np.ndarray, gt_boxes: np.ndarray) -> tuple[float, np.ndarray]:
    """(accuracy in percent, per-expression IoU): correct when IoU >= 0.5 (`CORRECT_IOU`)."""
    predicted = np.asarray(predicted_boxes, dtype=np.float64).reshape(-1, 4)
    gt = np.asarray(gt_boxes, dtype=np.float64).reshape(-1, 4)
    if len(predicted) != len(gt) or len(gt) == 0:
        raise ValueError(f"need as many predictions as expressions (>0); got {len(predicted)} "
                         f"and {len(gt)}")
    ious = np.array([box_iou(p, g)[0, 0] for p, g in zip(predicted, gt)])
    return 100.0 * float(np.sum(ious >= CORRECT_IOU)) / len(ious), ious


def score_refcoco(rows: list[dict], refs_path: str, instances_path: str, split: str,
                  where: str) -> tuple[float, list[dict]]:
    """Accuracy at IoU >= 0.5 between the chosen box and the referred object's box."""
    data = load_refcoco(refs_path, instances_path, split)
    expressions = {(e.ref_id, e.sent_id): e for e in data.expressions}
    check_prediction_ids([(r["ref_id"], r["sent_id"]) for r in rows], list(expressions),
                         "(ref_id, sent_id)", where)
    predicted = check_predicted_boxes([r.get("box") for r in rows], where)
    gt = np.stack([expressions[(r["ref_id"], r["sent_id"])].gt_box for r in rows])
    value, ious = refcoco_accuracy(predicted, gt)
    scored = [{**r, "iou": round(float(iou), 4), "correct": bool(iou >= CORRECT_IOU)}
              for r, iou in zip(rows, ious)]
    return value, scored


def candidate_chance(data: RefcocoData, candidates: dict[int, np.ndarray]) -> float:
    """Percent of expressions a uniformly drawn candidate of the image answers right, in expectation: per
    expression, the share of its image's candidate boxes ({image_id: N x 4}) at IoU >= 0.5 with the referred
    object's."""
    shares = [float((box_iou(candidates[e.image_id], e.gt_box[None]) >= CORRECT_IOU).mean())
              for e in data.expressions]
    return 100.0 * float(np.mean(shares)) if shares else 0.0


REFCOCO_TABLE = PaperTable(
    "table3_refcoco",
    "Table 3: RefCOCO+ accuracy (%)",
    (
        TableColumn("gt_val", "GT regions val", "refcoco_gt", "val"),
        TableColumn("gt_testA", "GT testA", "refcoco_gt", "testA"),
        TableColumn("gt_testB", "GT testB", "refcoco_gt", "testB"),
        TableColumn("det_val", "detected val", "refcoco_det", "val"),
        TableColumn("det_testA", "detected testA", "refcoco_det", "testA"),
        TableColumn("det_testB", "detected testB", "refcoco_det", "testB"),
    ),
    decimals=2,
)


class RefcocoTask(Task):
    """RefCOCO+: <Query, Image> -> one binary score per candidate box. Trained on both region
    tracks (every expression once with the ground-truth boxes, once with the detected RoIs) and
    evaluated on each: eval tasks `refcoco_gt` and `refcoco_det`.

    Prediction rows: `{"ref_id", "sent_id", "image_id", "box"}`, the chosen box in original pixels.
    """

    name = "refcoco"
    dataset = "refcoco"
    eval_tasks = ("refcoco_gt", "refcoco_det")
    metric = "accuracy@0.5"
    eval_splits = ("val", "testA", "testB")
    roi_dataset = "refcoco"
    owned_modules = ("tasks/refcoco.py", "tasks/modeling/refcoco.py")
    paper_table = REFCOCO_TABLE
    ablation_columns = (TableColumn("refcoco_det_val", "RefCOCO+ detected val", "refcoco_det", "val"),)
    example_key = ("ref_id", "sent_id")
    TRACKS = {"refcoco_gt": "gt", "refcoco_det": "det"}

    def prepare(self, meta, hparams, sources):
        # the authors' code makes box 0, the whole image, a candidate (refcoco/data/datasets/refcoco.py: it
        # prepends [0, 0, w - 1, h - 1] with ADD_IMAGE_AS_A_BOX and labels every box by IoU > 0.5;
        # resnet_vlbert_for_refcoco.py: inference_forward's argmax runs over every box)
        meta["whole_image_candidate"] = bool(hparams.get("whole_image_candidate", False))

    def build_data(self, split, meta, *, sources, tokens, images, max_rois, max_text_len, rois,
                   rois_source, eval_task=None, max_examples=None):
        ConcatData = model_side("samples", "ConcatData")
        RefcocoSamples = model_side("modeling.refcoco", "RefcocoSamples")

        data = load_refcoco(sources["refs"], sources["instances"], split)
        if max_examples:
            data.expressions = data.expressions[:max_examples]
        tracks = tuple(self.TRACKS.values()) if eval_task is None else (self.TRACKS[eval_task],)
        parts = [RefcocoSamples(data, track, sources["images"], tokens, max_rois=max_rois,
                                max_text_len=max_text_len, images=images,
                                rois=rois if track == "det" else None, rois_source=rois_source,
                                whole_image_candidate=meta.get("whole_image_candidate", False))
                 for track in tracks]
        return parts[0] if len(parts) == 1 else ConcatData(parts)

    def roi_image_paths(self, split, sources):
        return refcoco_image_paths(sources["refs"], sources["instances"], sources["images"], split)

    def build_heads(self, spec, meta):
        RefCOCOHead = model_side("modeling.refcoco", "RefCOCOHead")

        return TaskHeads(RefCOCOHead(spec.visual_width, spec.dropout, layout=spec.layout, hidden_act=spec.hidden_act))

    def loss(self, model, out, extras, meta):
        RefCOCOHead = model_side("modeling.refcoco", "RefCOCOHead")

        loss = RefCOCOHead.loss(out["logits"], extras["labels"], extras["candidate"])
        chosen = RefCOCOHead.predict(out["logits"], extras["candidate"])
        hit = extras["labels"].gather(1, chosen[:, None]).mean()
        return TaskLoss(loss, {"chosen_positive": hit.item()})

    def prediction_rows(self, model, data, indices, out, extras, meta, eval_task):
        rows = []
        chosen = model.head.predict(out["logits"], extras["candidate"]).tolist()
        for i, box_index in zip(indices, chosen):
            expr = data.data.expressions[i]
            box = data.box(i, box_index)
            rows.append({"ref_id": expr.ref_id, "sent_id": expr.sent_id, "image_id": expr.image_id,
                         "box": [round(float(v), 2) for v in box]})
        return rows

    def query_needs_rois(self, query):
        return query.get("boxes") is None  # the user's own candidate boxes take the ground-truth track

    def query_data(self, queries, meta, *, tokens, images, max_rois, max_text_len, rois, rois_source, workdir):
        RefcocoSamples = model_side("modeling.refcoco", "RefcocoSamples")

        tracks = {"det" if self.query_needs_rois(q) else "gt" for q in queries}
        if len(tracks) > 1:
            raise ValueError("RefCOCO+ queries: give candidate boxes for every query or for none "
                             "(then the detector's RoIs are the candidates)")
        expressions, image_boxes, image_files = [], {}, {}
        for i, query in enumerate(queries):
            text = query_text(query, i, "the referring expression")
            check_text_fits(len(tokens.ids(text)), max_text_len - RefcocoSamples.SPECIAL_TOKENS, max_text_len,
                            f"query #{i}: the expression")
            expressions.append(RefExpression(
                ref_id=i, sent_id=i, ann_id=-1, image_id=i, split="query", sentence=text, category_id=0,
                image_key=query["image_key"], image_w=int(query["image_w"]), image_h=int(query["image_h"]),
                gt_box=None))
            image_files[i] = str(query["image_path"])
            if query.get("boxes") is not None:
                boxes = check_predicted_boxes(query["boxes"], f"query #{i} candidate boxes")
                if len(boxes) == 0:
                    raise ValueError(f"query #{i}: the candidate box list is empty")
                image_boxes[i] = boxes.astype(np.float32)
        data = RefcocoData(expressions=expressions, image_boxes=image_boxes,
                           image_ann_ids={i: [] for i in image_boxes}, image_files=image_files)
        # image_files are local paths, absolute or relative to the working directory
        return RefcocoSamples(data, tracks.pop(), ".", tokens, max_rois=max_rois, max_text_len=max_text_len,
                              images=images, rois=rois, rois_source=rois_source,
                              whole_image_candidate=meta.get("whole_image_candidate", False))

    def query_results(self, model, data, indices, out, extras, meta, top_k):
        import torch

        # ranked by logit as the head's `predict` chooses (a sigmoid can round two logits to 1.0)
        logits = out["logits"].masked_fill(~extras["candidate"], float("-inf"))
        scores = torch.sigmoid(out["logits"])
        results = []
        for row, i in enumerate(indices):
            num_candidates = int(extras["candidate"][row].sum())
            order = logits[row].argsort(descending=True, stable=True)[: min(int(top_k), num_candidates)]
            ranked = [{"box": [round(float(v), 2) for v in data.box(i, k)], "score": round(float(scores[row, k]), 6)}
                      for k in order.tolist()]
            results.append({"box": ranked[0]["box"], "score": ranked[0]["score"], "track": data.track,
                            "num_candidates": num_candidates, "top": ranked})
        return results

    def score(self, eval_task, split, rows, sources, where):
        return score_refcoco(rows, sources["refs"], sources["instances"], split, where)

    def baseline(self, eval_task, split, sources, *, rois=(), max_rois=None):
        if eval_task != "refcoco_gt" and (not rois or max_rois is None):
            raise ValueError(f"{eval_task} {split}: its chance baseline needs the split's RoI parquets and "
                             "model.max_rois (the detected track's candidates)")
        data = load_refcoco(sources["refs"], sources["instances"], split)
        if eval_task == "refcoco_gt":
            return Baseline(candidate_chance(data, data.image_boxes), "chance: a box drawn uniformly from the "
                            "image's annotated objects (the ground-truth track's candidates)")
        from vlbert_core.rois import read_rois

        from .common import rois_for_key

        records, where = {}, ", ".join(map(str, rois))
        for path in rois:
            records.update(read_rois(path))
        candidates = {e.image_id: rois_for_key(records, e.image_key, where).boxes[: int(max_rois) - 1]
                      for e in data.expressions}
        return Baseline(candidate_chance(data, candidates), f"chance: a box drawn uniformly from the image's first "
                        f"{int(max_rois) - 1} detected RoIs (the detected track's candidates)")

    def baseline_reads_rois(self, eval_task):
        return eval_task == "refcoco_det"
