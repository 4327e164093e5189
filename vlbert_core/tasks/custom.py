"""Your own image–text classification task: one `CustomClassificationTask` per `tasks.custom.<name>`
entry of the config.

An entry names a train and a val file (JSON Lines or CSV, one row per example with the fields
`image`, `text` and `label`), optionally the label list. `custom_rows.check_rows` reads both
files, resolves each image (a path, relative to the data file's folder, or an http(s)/file URL
fetched by the project's downloader) and gives every row a status:

- `ok`: used for training (train) or scored (val);
- `missing_image`: the file does not exist, or the URL answered "not found";
- `unreadable_image`: the file or the download is not a decodable image, or the download failed;
- `unknown_label`: the label is not in the label list (the entry's `labels`, else the train
  split's labels);
- `bad_row`: the row lacks a field, or its text is empty.

Every row, with its status and reason, goes to `results/custom/<name>/<split>.rows.jsonl`; the
counts go to the log and to the notes of `results/tables/custom_<name>.csv`. Nothing is dropped
silently, and a split left with no `ok` row is an error.

The model reads `[CLS] text [SEP] [IMG]...` and classifies the `[CLS]` output with Dropout ->
Linear (the authors' advice for classification, jackroos/VL-BERT issue #35); the metrics are
accuracy and macro-F1 on val, both in percent.

Torch-free at import, like the other task modules: the samples and the head live in
`tasks/modeling/custom.py`, the row checks in `tasks/custom_rows.py`, the table in
`tables/custom.py` (each imported by its own job only).
"""

from __future__ import annotations

import json
import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Mapping, Sequence

from vlbert_core.utils import get_logger

from .base import (
    Task,
    TaskHeads,
    TaskLoss,
    check_prediction_ids,
    check_text_fits,
    model_side,
    query_text,
    split_path,
)

log = get_logger(__name__)

SPLITS = ("train", "val")
FIELDS = ("image", "text", "label")
OK = "ok"
MISSING_IMAGE = "missing_image"
UNREADABLE_IMAGE = "unreadable_image"
UNKNOWN_LABEL = "unknown_label"
BAD_ROW = "bad_row"
ROW_STATUSES = (OK, MISSING_IMAGE, UNREADABLE_IMAGE, UNKNOWN_LABEL, BAD_ROW)
URL_SCHEMES = ("http", "https", "file")
CUSTOM_RESULTS = "results/custom"  # results/custom/<name>/: the checked rows, labels, downloaded images
DEFAULT_DOWNLOAD = {"timeout_s": 10, "retries": 2, "threads": 4, "max_bytes": 20_000_000}


@dataclass(frozen=True)
class CustomSpec:
    """One `tasks.custom.<name>` entry (config/schema.yaml describes the keys)."""

    name: str
    train: str
    val: str
    labels: tuple[str, ...] | None = None
    settings: tuple[str, ...] | None = None  # None: every fine-tuned setting
    schedule: str = "full"
    download: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def from_config(cls, name: str, entry: Mapping[str, Any]) -> CustomSpec:
        known = {"train", "val", "labels", "settings", "schedule", "download"}
        unknown = sorted(set(entry) - known)
        missing = [key for key in ("train", "val") if not entry.get(key)]
        if unknown or missing:
            raise ValueError(f"config tasks.custom.{name}: unknown keys {unknown}, missing keys {missing}; "
                             f"expected train, val and optionally {sorted(known - {'train', 'val'})}")
        if not name.replace("_", "").isalnum() or not name.isascii():
            raise ValueError(f"config tasks.custom.{name}: a task name is letters, digits and '_' "
                             "(it names files and wildcards)")
        labels = entry.get("labels")
        if labels is not None:
            labels = tuple(str(label) for label in labels)
            duplicated = sorted(label for label, n in Counter(labels).items() if n > 1)
            if len(labels) < 2 or duplicated:
                raise ValueError(f"config tasks.custom.{name}.labels: needs at least two distinct labels "
                                 f"(got {list(labels)}; repeated: {duplicated})")
        settings = entry.get("settings")
        return cls(name, str(entry["train"]), str(entry["val"]), labels,
                   None if settings is None else tuple(settings), str(entry.get("schedule", "full")),
                   {**DEFAULT_DOWNLOAD, **dict(entry.get("download") or {})})

    @property
    def task_name(self) -> str:
        return f"custom_{self.name}"

    @property
    def download_key(self) -> str:
        """The config key of `download` (its errors name it)."""
        return f"tasks.custom.{self.name}.download"

    @property
    def results_dir(self) -> str:
        return f"{CUSTOM_RESULTS}/{self.name}"

    def data_file(self, split: str) -> str:
        return {"train": self.train, "val": self.val}[split]

    def sources(self) -> dict[str, str]:
        """What the task's jobs read (the `sources` of the finetune, evaluate and RoI jobs): the
        checked rows of each split and the label list, both written by `custom_rows.check_rows`."""
        return {"rows": f"{self.results_dir}/{{split}}.rows.jsonl", "labels": f"{self.results_dir}/labels.json"}


def status_counts(rows: Sequence[Mapping[str, Any]]) -> dict[str, int]:
    counts = Counter(row["status"] for row in rows)
    return {status: counts[status] for status in ROW_STATUSES if counts[status]}


def read_checked_rows(path: str | os.PathLike) -> list[dict]:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"checked rows {path} do not exist; rule custom_rows writes them")
    with path.open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def read_labels(path: str | os.PathLike) -> list[str]:
    summary = json.loads(Path(path).read_text(encoding="utf-8"))
    return list(summary["labels"])


def image_key(path: str) -> str:
    """The RoI parquet key of an image: its local path (rows showing the same image share it)."""
    return path


# ---- metrics -------------------------------------------------------------------------------------

def accuracy(predicted: Sequence[str], gold: Sequence[str]) -> float:
    """Percent of rows whose predicted label is the gold one."""
    if len(predicted) != len(gold) or not gold:
        raise ValueError(f"accuracy needs equally many predictions and gold labels, at least one "
                         f"({len(predicted)} vs {len(gold)})")
    return 100.0 * sum(p == g for p, g in zip(predicted, gold)) / len(gold)


def macro_f1(predicted: Sequence[str], gold: Sequence[str]) -> float:
    """Mean over the labels that occur in gold or predictions of F1 = 2TP / (2TP + FP + FN), in percent
    (scikit-learn's `f1_score(average="macro")`)."""
    if len(predicted) != len(gold) or not gold:
        raise ValueError(f"macro-F1 needs equally many predictions and gold labels, at least one "
                         f"({len(predicted)} vs {len(gold)})")
    scores = []
    for label in sorted(set(gold) | set(predicted)):
        tp = sum(p == label and g == label for p, g in zip(predicted, gold))
        fp = sum(p == label and g != label for p, g in zip(predicted, gold))
        fn = sum(p != label and g == label for p, g in zip(predicted, gold))
        scores.append(2 * tp / (2 * tp + fp + fn))
    return 100.0 * sum(scores) / len(scores)


# ---- the task ------------------------------------------------------------------------------------

class CustomClassificationTask(Task):
    """An image–text classification task declared in the config; `task_class(spec)` makes the class
    of one entry (the registry keeps classes, one per task name)."""

    spec: ClassVar[CustomSpec]
    name = "custom"
    dataset = "custom"  # the family of the template itself; each entry's class has its own
    metric = "accuracy"
    owned_modules = ("tasks/custom.py", "tasks/custom_rows.py", "tasks/modeling/custom.py", "tables/custom.py")

    @classmethod
    def task_class(cls, spec: CustomSpec) -> type[CustomClassificationTask]:
        attrs = {"spec": spec, "name": spec.task_name, "dataset": spec.task_name, "roi_dataset": spec.task_name,
                 "own_sources": spec.sources(), "world_dataset": False}
        return type(f"CustomClassificationTask_{spec.name}", (cls,), attrs)

    def _rows(self, split: str, sources: Mapping[str, str]) -> list[dict]:
        return [r for r in read_checked_rows(split_path(sources["rows"], split)) if r["status"] == OK]

    def prepare(self, meta, hparams, sources):
        meta["labels"] = read_labels(sources["labels"])

    def build_data(self, split, meta, *, sources, tokens, images, max_rois, max_text_len, rois,
                   rois_source, eval_task=None, max_examples=None):
        CustomData = model_side("modeling.custom", "CustomData")

        rows = self._rows(split, sources)
        rows = rows[:max_examples] if max_examples else rows
        return CustomData(rows, rois or {}, rois_source, tokens, meta["labels"], max_rois=max_rois,
                          max_text_len=max_text_len, images=images)

    def log_training_data(self, data, meta):
        log.info("custom task %s: trained on %d rows over %d labels", self.name, len(data), len(meta["labels"]))

    def roi_image_paths(self, split, sources):
        return {image_key(r["path"]): Path(r["path"]) for r in self._rows(split, sources)}

    def build_heads(self, spec, meta):
        ClassifierHead = model_side("modeling.custom", "ClsClassifierHead")

        return TaskHeads(ClassifierHead(spec.pooled_width, len(meta["labels"]), spec.dropout))

    def loss(self, model, out, extras, meta):
        logits = out["logits"]
        loss = model.head.loss(logits, extras["target"])
        correct = (logits.argmax(dim=1) == extras["target"]).float().mean()
        return TaskLoss(loss, {"accuracy": correct.item()})

    def prediction_rows(self, model, data, indices, out, extras, meta, eval_task):
        best = out["logits"].argmax(dim=1).tolist()
        return [{"id": data.rows[i]["id"], "label": meta["labels"][k]} for i, k in zip(indices, best)]

    # ---- a user's queries (python -m vlbert_core.predict) -----------------------------------------

    def query_download(self, config):
        return self.spec.download_key, self.spec.download

    def query_data(self, queries, meta, *, tokens, images, max_rois, max_text_len, rois, rois_source, workdir):
        CustomData = model_side("modeling.custom", "CustomData")

        rows, keyed_rois = [], {}
        for i, query in enumerate(queries):
            text = query_text(query, i, "the sentence")
            check_text_fits(len(tokens.ids(text)), max_text_len - CustomData.SPECIAL_TOKENS, max_text_len,
                            f"query #{i}: the text")
            # the samples key RoIs by image path, as the RoI parquet of rule extract_task_rois does
            keyed_rois[image_key(query["image_path"])] = rois[query["image_key"]]
            rows.append({"id": f"query{i}", "text": text, "label": None, "path": query["image_path"]})
        return CustomData(rows, keyed_rois, rois_source, tokens, meta["labels"], max_rois=max_rois,
                          max_text_len=max_text_len, images=images)

    def query_results(self, model, data, indices, out, extras, meta, top_k):
        import torch

        # ranked by logit as `prediction_rows` chooses; trained with cross-entropy, the softmax is
        # the model's probability of each label
        probabilities = torch.softmax(out["logits"].float(), dim=1)
        ranked = probabilities.argsort(dim=1, descending=True, stable=True)[:, : min(int(top_k), probabilities.shape[1])]
        results = []
        for row_probabilities, row_ranked in zip(probabilities, ranked):
            labels = [{"label": meta["labels"][j], "probability": round(float(row_probabilities[j]), 6)}
                      for j in row_ranked.tolist()]
            results.append({"label": labels[0]["label"], "labels": labels})
        return results

    def score(self, eval_task, split, rows, sources, where):
        gold = {r["id"]: r["label"] for r in self._rows(split, sources)}
        for i, row in enumerate(rows):
            if not isinstance(row.get("id"), str) or not isinstance(row.get("label"), str):
                raise ValueError(f"{where}: prediction #{i} is {row!r}; expected a string id and label")
        check_prediction_ids([r["id"] for r in rows], list(gold), "row id", where)
        out = [{"id": r["id"], "label": r["label"], "gold": gold[r["id"]]} for r in rows]
        return accuracy([r["label"] for r in out], [r["gold"] for r in out]), out

    def secondary_metrics(self, eval_task, split, scored_rows):
        return {"macro_f1": macro_f1([r["label"] for r in scored_rows], [r["gold"] for r in scored_rows])}
