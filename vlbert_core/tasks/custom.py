"""Your own image–text classification task: one `CustomClassificationTask` per `tasks.custom.<name>`
entry of the config.

An entry names a train and a val file (JSON Lines or CSV, one row per example with the fields
`image`, `text` and `label`), optionally the label list. `check_rows` reads both files, resolves
each image (a path, relative to the data file's folder, or an http(s)/file URL fetched by the
project's downloader) and gives every row a status:

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
`tasks/modeling/custom.py`.
"""

from __future__ import annotations

import csv
import hashlib
import json
import os
import urllib.parse
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Mapping, Sequence

from PIL import Image

from vlbert_core.utils import atomic_path, get_logger

from .base import Task, TaskHeads, TaskLoss, check_prediction_ids, model_side, split_path

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
    def results_dir(self) -> str:
        return f"{CUSTOM_RESULTS}/{self.name}"

    def data_file(self, split: str) -> str:
        return {"train": self.train, "val": self.val}[split]

    def sources(self) -> dict[str, str]:
        """What the task's jobs read (the `sources` of the finetune, evaluate and RoI jobs): the
        checked rows of each split and the label list, both written by `check_rows`."""
        return {"rows": f"{self.results_dir}/{{split}}.rows.jsonl", "labels": f"{self.results_dir}/labels.json"}


# ---- reading the user's files --------------------------------------------------------------------

def read_data_file(path: str | os.PathLike) -> list[dict]:
    """The rows of a .jsonl or .csv file, each with its 1-based `line` (JSONL line or CSV record)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"custom task data file {path} does not exist")
    suffix = path.suffix.lower()
    rows: list[dict] = []
    if suffix == ".jsonl":
        with path.open(encoding="utf-8") as f:
            for number, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as err:
                    raise ValueError(f"{path} line {number}: not valid JSON ({err})") from None
                if not isinstance(record, dict):
                    raise ValueError(f"{path} line {number}: expected a JSON object, got {type(record).__name__}")
                rows.append({**record, "line": number})
    elif suffix == ".csv":
        with path.open(encoding="utf-8", newline="") as f:
            reader = csv.DictReader(f)
            missing = [name for name in FIELDS if name not in (reader.fieldnames or [])]
            if missing:
                raise ValueError(f"{path}: the CSV header {reader.fieldnames} lacks the columns {missing}")
            for number, record in enumerate(reader, start=2):  # line 1 is the header
                rows.append({**record, "line": number})
    else:
        raise ValueError(f"custom task data file {path}: expected a .jsonl or .csv file")
    if not rows:
        raise ValueError(f"custom task data file {path} has no rows")
    return rows


def _is_url(image: str) -> bool:
    return urllib.parse.urlsplit(image).scheme.lower() in URL_SCHEMES


def _decodable(path: Path) -> str:
    """'' when the file decodes as an image, else why not."""
    try:
        with Image.open(path) as img:
            img.convert("RGB")
    except (OSError, ValueError, Image.DecompressionBombError) as err:
        return f"cannot decode {path}: {err}"
    return ""


class _ImageResolver:
    """Local image paths of the rows: paths as they are, URLs fetched once into `download_dir`."""

    def __init__(self, download_dir: Path, download: Mapping[str, Any]):
        self.download_dir = download_dir
        self.download = dict(download)
        self._downloader = None
        self._fetched: dict[str, tuple[str | None, str, str]] = {}

    def resolve(self, image: str, base: Path) -> tuple[str | None, str, str]:
        """(local path or None, status, reason)."""
        if _is_url(image):
            if image not in self._fetched:
                self._fetched[image] = self._fetch(image)
            local, status, reason = self._fetched[image]
            if status != OK:
                return local, status, reason
            path = Path(local)
        else:
            path = Path(image) if Path(image).is_absolute() else base / image
            if not path.is_file():
                return None, MISSING_IMAGE, f"no such file: {path}"
        reason = _decodable(path)
        return (str(path), OK, "") if not reason else (str(path), UNREADABLE_IMAGE, reason)

    def _fetch(self, url: str) -> tuple[str | None, str, str]:
        from vlbert_core.data import make_downloader, status

        if self._downloader is None:
            self._downloader = make_downloader(self.download)
        result = self._downloader.fetch(url)
        if result.data is None:
            kind = MISSING_IMAGE if result.status == status.NOT_FOUND else UNREADABLE_IMAGE
            return None, kind, f"download {result.status}: {result.error}"
        suffix = Path(urllib.parse.urlsplit(url).path).suffix.lower()
        name = hashlib.sha1(url.encode("utf-8")).hexdigest()[:20] + (suffix if suffix.isascii() and len(suffix) <= 5 else "")
        target = self.download_dir / name
        with atomic_path(target) as tmp:
            tmp.write_bytes(result.data)
        return str(target), OK, ""

    def close(self) -> None:
        if self._downloader is not None:
            self._downloader.close()


def _check_split(spec: CustomSpec, split: str, resolver: _ImageResolver, labels: Sequence[str] | None) -> list[dict]:
    """Every row of the split with its status; `labels` None: every label is known (the train split
    when the entry gives no label list, which then takes its labels from the ok train rows)."""
    data_file = Path(spec.data_file(split))
    checked = []
    for row in read_data_file(data_file):
        out = {"id": f"{split}-{row['line']:07d}", "line": row["line"], "image": row.get("image"),
               "text": row.get("text"), "label": row.get("label"), "path": None, "status": OK, "reason": ""}
        lacking = [name for name in FIELDS if row.get(name) in (None, "")]
        if lacking:
            out.update(status=BAD_ROW, reason=f"lacks {lacking}")
        elif not isinstance(row["text"], str) or not row["text"].strip():
            out.update(status=BAD_ROW, reason="text is not a non-empty string")
        else:
            out["label"] = str(row["label"])
            path, status, reason = resolver.resolve(str(row["image"]), data_file.parent)
            out.update(path=path, status=status, reason=reason)
            if status == OK and labels is not None and out["label"] not in labels:
                out.update(status=UNKNOWN_LABEL, reason=f"label {out['label']!r} is not one of {list(labels)}")
        checked.append(out)
    return checked


def status_counts(rows: Sequence[Mapping[str, Any]]) -> dict[str, int]:
    counts = Counter(row["status"] for row in rows)
    return {status: counts[status] for status in ROW_STATUSES if counts[status]}


def check_rows(spec: CustomSpec, out_dir: str | os.PathLike | None = None) -> dict[str, Any]:
    """Check both splits, write `<split>.rows.jsonl` and `labels.json` into `out_dir` (default
    results/custom/<name>) and return the summary (labels, status counts per split).

    Downloaded images go to `<out_dir>/images/`. Raises when a split has no usable row.
    """
    out_dir = Path(out_dir or spec.results_dir)
    resolver = _ImageResolver(out_dir / "images", spec.download)
    try:
        train = _check_split(spec, "train", resolver, spec.labels)
        labels = list(spec.labels) if spec.labels else list(dict.fromkeys(r["label"] for r in train if r["status"] == OK))
        val = _check_split(spec, "val", resolver, labels)
    finally:
        resolver.close()
    summary: dict[str, Any] = {"name": spec.name, "labels": labels, "counts": {}, "files": {}}
    for split, rows in (("train", train), ("val", val)):
        counts = status_counts(rows)
        summary["counts"][split] = counts
        summary["files"][split] = spec.data_file(split)
        skipped = {s: n for s, n in counts.items() if s != OK}
        log.info("custom task %s, %s (%s): %d rows, %d ok, skipped %s", spec.name, split, spec.data_file(split),
                 len(rows), counts.get(OK, 0), skipped or "none")
        for row in rows:
            if row["status"] != OK:
                log.warning("  %s line %d: %s (%s)", spec.data_file(split), row["line"], row["status"], row["reason"])
        if not counts.get(OK):
            raise ValueError(f"custom task {spec.name}: the {split} file {spec.data_file(split)} has no usable row "
                             f"after the checks ({counts}); see the reasons above")
    if len(labels) < 2:
        raise ValueError(f"custom task {spec.name}: the train split has {len(labels)} label(s) {labels}; a "
                         "classifier needs at least two (give `labels:` or more varied rows)")
    for split, rows in (("train", train), ("val", val)):
        with atomic_path(out_dir / f"{split}.rows.jsonl") as tmp:
            tmp.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    with atomic_path(out_dir / "labels.json") as tmp:
        tmp.write_text(json.dumps(summary, indent=1) + "\n", encoding="utf-8")
    return summary


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
    owned_modules = ("tasks/custom.py", "tasks/modeling/custom.py")

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

    def build_heads(self, config, meta):
        ClassifierHead = model_side("modeling.custom", "ClsClassifierHead")

        return TaskHeads(ClassifierHead(config.hidden_size, len(meta["labels"]), config.hidden_dropout_prob))

    def loss(self, model, out, extras, meta):
        logits = out["logits"]
        loss = model.head.loss(logits, extras["target"])
        correct = (logits.argmax(dim=1) == extras["target"]).float().mean()
        return TaskLoss(loss, {"accuracy": correct.item()})

    def prediction_rows(self, model, data, indices, out, extras, meta, eval_task):
        best = out["logits"].argmax(dim=1).tolist()
        return [{"id": data.rows[i]["id"], "label": meta["labels"][k]} for i, k in zip(indices, best)]

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


# ---- the table -----------------------------------------------------------------------------------

TABLE_HEADER = ["task", "setting", "schedule", "model", "dataset", "split", "accuracy", "macro_f1",
                "val_examples", "train_examples", "rows_skipped", "note"]


def _counts_text(counts: Mapping[str, int]) -> str:
    skipped = ", ".join(f"{n} {status}" for status, n in counts.items() if status != OK)
    return f"{sum(counts.values())} rows, {counts.get(OK, 0)} ok" + (f", skipped {skipped}" if skipped else "")


def write_custom_table(spec: CustomSpec, eval_paths: Mapping[str, str | os.PathLike], summary_path: str | os.PathLike,
                       csv_path: str | os.PathLike, md_path: str | os.PathLike, *, dataset: str,
                       model_cfg: Mapping[str, Any]) -> list[dict]:
    """`results/tables/custom_<name>.csv` and its Markdown twin: accuracy and macro-F1 on val of each
    fine-tuned setting (`eval_paths`: {setting: eval JSON}), with the row accounting of `check_rows`
    (`summary_path`, its labels.json) in the notes."""
    from vlbert_core.tables.build import describe_model, format_number, read_eval, write_csv

    summary = json.loads(Path(summary_path).read_text(encoding="utf-8"))
    counts = summary["counts"]
    skipped = sum(n for split in SPLITS for status, n in counts[split].items() if status != OK)
    model = describe_model(dict(model_cfg))
    rows = []
    for setting, path in eval_paths.items():
        record = read_eval(Path(path))
        if "macro_f1" not in record:
            raise ValueError(f"eval JSON {path} has no 'macro_f1'; it is not a custom task's evaluation")
        rows.append({"task": spec.task_name, "setting": setting, "schedule": spec.schedule, "model": model,
                     "dataset": dataset, "split": record["split"], "accuracy": float(record["value"]),
                     "macro_f1": float(record["macro_f1"]), "val_examples": record["num_examples"],
                     "train_examples": counts["train"].get(OK, 0), "rows_skipped": skipped,
                     "note": f"train: {_counts_text(counts['train'])}; val: {_counts_text(counts['val'])}"})
    write_csv(rows, TABLE_HEADER, Path(csv_path))
    lines = [f"# Custom task `{spec.name}`: accuracy and macro-F1 on val", "",
             "| setting | accuracy | macro-F1 | val examples |", "|---|---|---|---|"]
    lines += [f"| {r['setting']} | {format_number(r['accuracy'], 1)} | {format_number(r['macro_f1'], 1)} | "
              f"{r['val_examples']} |" for r in rows]
    lines += ["", f"{model}, fine-tuned with schedule `{spec.schedule}` from each pre-training setting; "
              f"labels {summary['labels']}.", ""]
    for split in SPLITS:
        lines.append(f"- {split} (`{summary['files'][split]}`): {_counts_text(counts[split])}; every row with "
                     f"its status and reason: `{split_path(spec.sources()['rows'], split)}`.")
    with atomic_path(md_path) as tmp:
        tmp.write_text("\n".join(lines) + "\n", encoding="utf-8")
    log.info("wrote %s (%d settings)", csv_path, len(rows))
    return rows
