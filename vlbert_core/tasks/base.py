"""What a fine-tuning task defines: the `Task` base class that each task's module subclasses.

The shared code (the training loop in `finetune`, prediction in `evaluate`, the metrics in
`scoring`, the code fingerprints, the workflow) asks a task object for everything that differs
between tasks, and never names a task itself. `vlbert_core.tasks.registry` maps names to classes.

Torch-free at import on purpose: the metric scripts and the Snakefile import every registered
task module without torch; the task methods that need torch import it where they run.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from importlib import import_module
from pathlib import Path
from typing import Any, ClassVar, Mapping, Sequence

NO_TEST_LABELS = "not run: test labels are held by the evaluation server"


@dataclass(frozen=True)
class TableColumn:
    """One metric column of a results table and the eval that measures it (eval_task None: not
    measurable here, `not_run_reason` says why). `vlbert_core.tables` builds the tables from these."""

    name: str
    title: str
    eval_task: str | None
    eval_split: str | None
    not_run_reason: str = ""
    split_label: str | None = None  # how the `_split` cell names the eval's split (None: as the eval JSON does)


@dataclass(frozen=True)
class Baseline:
    """A column's no-model score (percent; None: not computed) and what it is, in words."""

    value: float | None
    kind: str

    def fields(self) -> dict:
        """The eval JSON's keys for it."""
        return {"baseline": self.value, "baseline_kind": self.kind}


@dataclass(frozen=True)
class PaperTable:
    """A task's own table of the paper (Tables 1–3), measured at the full fine-tuning schedule."""

    name: str  # results/tables/<name>.csv; the `table` of tables/reported.csv
    title: str
    columns: tuple[TableColumn, ...]
    decimals: int  # the paper's precision in this table


@dataclass
class TaskHeads:
    """The modules a task puts on top of the model; saved under `head.` and `roi_classifier.`."""

    head: Any  # nn.Module
    roi_classifier: Any = None  # nn.Module of an auxiliary RoI loss, or None


@dataclass
class TaskLoss:
    """The loss of one training batch and the statistics logged beside it in metrics.jsonl."""

    loss: Any  # scalar tensor
    stats: dict[str, float] = field(default_factory=dict)


class Task:
    """One fine-tuning task. Subclasses set the class attributes and implement the methods.

    Names: `name` is the fine-tune task (the key under `finetune:` of the config and the
    `{task}` of results/finetune/); `eval_tasks` are the names its predictions are scored under
    (RefCOCO+ has one per region track); `derived_eval_tasks` are scored from other eval tasks'
    predictions (VCR's Q->AR): `derived_inputs` names those eval tasks and `derive` writes the
    derived eval JSON, in the workflow's rule `derive_eval`.
    """

    name: ClassVar[str]
    dataset: ClassVar[str]  # key under `sources:` of the config; also the task family of the fingerprints
    eval_tasks: ClassVar[tuple[str, ...]] = ()  # () means (name,)
    derived_eval_tasks: ClassVar[tuple[str, ...]] = ()
    metric: ClassVar[str]  # the `metric` field of the eval JSON
    train_split: ClassVar[str] = "train"
    eval_splits: ClassVar[tuple[str, ...]] = ("val",)
    # the detected-RoI dataset the task reads (results/rois/<roi_dataset>/<split>.parquet), or None
    # when it uses the dataset's own boxes only
    roi_dataset: ClassVar[str | None] = None
    required_hparams: ClassVar[tuple[str, ...]] = ()
    rows_per_image: ClassVar[int] = 1  # consecutive batch rows that share one image (VCR: 4 candidates)
    # modules (relative to the vlbert_core package) that only this task's dataset uses; a job of
    # another task leaves them out of its code fingerprint
    owned_modules: ClassVar[tuple[str, ...]] = ()
    # the results tables: the task's table of the paper (one object shared by the classes of one
    # table) and its columns of Table 4, the ablation
    paper_table: ClassVar[PaperTable | None] = None
    ablation_columns: ClassVar[tuple[TableColumn, ...]] = ()
    # its columns of the model comparison (results/tables/model_comparison.csv, VL-BERT vs ViLBERT at Table 4's
    # schedule); None: its ablation columns
    comparison_columns: ClassVar[tuple[TableColumn, ...] | None] = None
    # the paired test of the tables' `_p_vs_none` columns (vlbert_core.stats): the fields that name an
    # example in a scored predictions row, the row's per-example outcome, and the test that fits it
    example_key: ClassVar[tuple[str, ...]] = ()
    outcome_field: ClassVar[str] = "correct"
    paired_test: ClassVar[str] = "mcnemar"  # 0/1 outcomes; "bootstrap" for soft scores
    # the task's files when it declares them itself (a `tasks.custom` entry) instead of under the
    # config's `sources:`; the workflow passes them to its jobs as `sources`
    own_sources: ClassVar[Mapping[str, str] | None] = None
    world_dataset: ClassVar[bool] = True  # rule `world` writes the dataset for the embedded world

    @classmethod
    def eval_task_names(cls) -> tuple[str, ...]:
        return cls.eval_tasks or (cls.name,)

    # ---- data ------------------------------------------------------------------------------------

    def prepare(self, meta: dict, hparams: Mapping[str, Any], sources: Mapping[str, str]) -> None:
        """Add to `meta` what the head and the data need from the training split (a vocabulary)."""

    def build_data(self, split: str, meta: Mapping[str, Any], *, sources: Mapping[str, str], tokens,
                   images, max_rois: int, max_text_len: int, rois: dict, rois_source: str,
                   eval_task: str | None = None, max_examples: int | None = None):
        """The samples of one split (an object with `__len__`, `sample(i)`, `collate(samples)`);
        `eval_task` None: the training samples."""
        raise NotImplementedError

    def log_training_data(self, data, meta: Mapping[str, Any]) -> None:
        """A last word on the training data, after training."""

    def roi_image_paths(self, split: str, sources: Mapping[str, str]) -> dict[str, Path]:
        """{image key: image path} of the split's images that need detected RoIs (`roi_dataset`)."""
        raise NotImplementedError(f"task {self.name} reads no detected RoIs")

    # ---- model -----------------------------------------------------------------------------------

    def build_heads(self, spec, meta: Mapping[str, Any]) -> TaskHeads:
        """The modules on top of the model for this task, from the model's `HeadSpec` (its output widths and
        conventions, vlbert_core/models/common/output.py) and the task meta. A head reads the model's `EncoderOutput`
        only, so the task serves every model family."""
        raise NotImplementedError

    def scores(self, model, output, batch) -> dict:
        """The head outputs of a batch, by name; `model` is the `FinetuneModel`."""
        return {"logits": model.head(output, batch)}

    def loss(self, model, out: dict, extras: Mapping[str, Any], meta: Mapping[str, Any]) -> TaskLoss:
        """The loss of one training batch, from the head outputs `out` (`scores`) and the targets."""
        raise NotImplementedError

    def prediction_rows(self, model, data, indices: list[int], out: dict, extras: Mapping[str, Any],
                        meta: Mapping[str, Any], eval_task: str) -> list[dict]:
        """The prediction rows of one batch (CPU scores), in the format `score` reads."""
        raise NotImplementedError

    # ---- a user's queries (python -m vlbert_core.predict, docs/predict.md) -------------------------

    def query_needs_rois(self, query: Mapping[str, Any]) -> bool:
        """Whether the query's image needs the detector's RoIs (`rois` of `query_data`)."""
        return self.roi_dataset is not None

    def query_download(self, config: Mapping[str, Any]) -> tuple[str, Mapping[str, Any] | None]:
        """(config key, settings) of the downloader that fetches a query's image URL: the run's
        `cc.download`, unless the task's data names its own."""
        return "cc.download", (config.get("cc") or {}).get("download")

    def queries_from_file(self, path: str | Path, *, key: str | None = None,
                          images_dir: str | Path | None = None) -> list[dict]:
        """Queries read from a file in the dataset's own annotation format (`key`: one of its ids)."""
        raise NotImplementedError(f"task {self.name} reads no queries from annotation files; "
                                  f"give --image and --text")

    def query_data(self, queries: list[dict], meta: Mapping[str, Any], *, tokens, images, max_rois: int,
                   max_text_len: int, rois: dict, rois_source: str, workdir: Path):
        """The samples of a user's queries, of the class `build_data` returns (so the model sees what
        the evaluation gives it). Each query holds the user's fields (`text`, ...) and those the
        predict API adds: `image_path` (a local file), `image_key`, `image_w`, `image_h`. Text that
        does not fit `max_text_len` is an error (`check_text_fits`), never truncated. `workdir`: a
        scratch directory for files the samples read, kept while the prediction runs."""
        raise NotImplementedError(f"task {self.name} does not answer a user's queries")

    def query_results(self, model, data, indices: list[int], out: dict, extras: Mapping[str, Any],
                      meta: Mapping[str, Any], top_k: int) -> list[dict]:
        """What the model answers to each query of one batch (CPU scores), JSON-able."""
        raise NotImplementedError(f"task {self.name} does not answer a user's queries")

    # ---- metric ----------------------------------------------------------------------------------

    def score(self, eval_task: str, split: str, rows: list[dict], sources: Mapping[str, str],
              where: str) -> tuple[float, list[dict]]:
        """(metric value in percent, rows to write as the predictions file) against the official
        annotation files; torch-free. Each row carries its per-example outcome (`outcome_field`)."""
        raise NotImplementedError

    def derived_inputs(self, derived: str) -> tuple[str, ...]:
        """The eval tasks whose prediction files the derived eval task `derived` is scored from."""
        raise ValueError(f"task {self.name} derives no eval task {derived!r}; it derives "
                         f"{list(self.derived_eval_tasks)}")

    def derive(self, derived: str, predictions: Mapping[str, str | Path], json_path: str | Path, *,
               split: str, setting: str, schedule: str, dataset: str) -> dict:
        """Score the derived eval task `derived` from `predictions` ({eval task in
        `derived_inputs(derived)`: its predictions file}) and write its eval JSON to `json_path`
        (atomically); returns the JSON's fields. Torch-free."""
        raise ValueError(f"task {self.name} derives no eval task {derived!r}; it derives "
                         f"{list(self.derived_eval_tasks)}")

    def outcome_eval_tasks(self, eval_task: str) -> tuple[str, ...]:
        """The eval tasks whose predictions files hold `eval_task`'s per-example outcomes."""
        return (eval_task,)

    def example_outcomes(self, eval_task: str, prediction_files: Sequence[Path]) -> dict[tuple, float]:
        """{example key: outcome} of one eval, from the predictions files of `outcome_eval_tasks`."""
        if not self.example_key:
            raise ValueError(f"task {self.name} names no example_key, so its predictions cannot be "
                             "compared example by example")
        (path,) = prediction_files
        outcomes = {}
        for i, row in enumerate(read_scored_predictions(path)):
            try:
                key, value = tuple(row[k] for k in self.example_key), float(row[self.outcome_field])
            except (KeyError, TypeError, ValueError) as exc:
                raise ValueError(f"predictions {path} row #{i}: no usable {exc!r} among "
                                 f"{[*self.example_key, self.outcome_field]}") from None
            if key in outcomes:
                raise ValueError(f"predictions {path} row #{i}: example {key} appears twice")
            outcomes[key] = value
        return outcomes

    def baseline(self, eval_task: str, split: str, sources: Mapping[str, str], *, rois: Sequence[str] = (),
                 max_rois: int | None = None) -> Baseline:
        """What a model that learns nothing scores on this split (chance, or the training split's majority
        answer), from the annotation files (and, where `baseline_reads_rois`, the split's RoI parquets `rois`,
        of which the model sees the first `max_rois` - 1 boxes); torch-free. The eval JSON and the tables
        carry it."""
        return Baseline(None, f"no baseline defined for eval task {eval_task}")

    def baseline_reads_rois(self, eval_task: str) -> bool:
        """Whether `baseline` of `eval_task` needs the split's detected-RoI parquets (its candidates)."""
        return False

    def secondary_metrics(self, eval_task: str, split: str, scored_rows: list[dict]) -> dict[str, float]:
        """More numbers for the eval JSON beside `metric`, from the rows `score` returned (the custom
        task's macro-F1)."""
        return {}


def model_side(module: str, name: str):
    """`name` from the torch-side module `vlbert_core.tasks.<module>` (`samples`, `modeling.vqa`).

    A task module reaches its samples and heads through this, not an import statement, on purpose:
    the scoring jobs import every task module for its metric, and their code fingerprint
    (`vlbert_core.fingerprint`, which follows import statements) must not cover the model. The
    fine-tune and prediction code imports `samples` and `modeling` itself, so its fingerprint does.
    """
    return getattr(import_module(f"{__package__}.{module}"), name)


def read_scored_predictions(path: str | Path) -> list[dict]:
    """The rows of a predictions file written by `scoring.evaluate_predictions` (a JSON list)."""
    try:
        rows = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"predictions file {path} is missing; run its `evaluate` job first") from None
    except json.JSONDecodeError as err:
        raise ValueError(f"predictions file {path} is not valid JSON: {err}") from None
    if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
        raise ValueError(f"predictions file {path} is not a JSON list of rows")
    return rows


def split_path(template: str | Path, split: str) -> str:
    """A `sources:` path template with its `{split}` filled in."""
    return str(template).format(split=split)


def check_prediction_ids(predicted: list, expected: list, what: str, where: str) -> None:
    """Every id of the split predicted exactly once, or an error naming `where` and the ids."""
    seen: set = set()
    for key in predicted:
        if key in seen:
            raise ValueError(f"{where}: {what} {key!r} is predicted twice")
        seen.add(key)
    missing = [k for k in expected if k not in seen]
    extra = sorted(seen - set(expected), key=str)
    if missing or extra:
        raise ValueError(f"{where}: predictions do not match the split: {len(missing)} {what}s "
                         f"missing (e.g. {missing[:3]}), {len(extra)} unknown (e.g. {extra[:3]})")


def query_text(query: Mapping[str, Any], index: int, what: str) -> str:
    """The non-empty `text` of query #index, or an error naming the query and `what` it should be."""
    text = query.get("text")
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"query #{index}: needs a non-empty text ({what}), got {text!r}")
    return text


def check_text_fits(num_pieces: int, max_pieces: int, max_text_len: int, where: str) -> None:
    """A query's text must fit the model's length: the evaluation truncates, a user's query is refused."""
    if num_pieces > max_pieces:
        raise ValueError(f"{where} is {num_pieces} word pieces; the model takes at most {max_pieces} "
                         f"(max_text_len {max_text_len} less its special tokens): shorten it")
