"""What a fine-tuning task defines: the `Task` base class that each task's module subclasses.

The shared code (the training loop in `finetune`, prediction in `evaluate`, the metrics in
`scoring`, the code fingerprints, the workflow) asks a task object for everything that differs
between tasks, and never names a task itself. `vlbert_core.tasks.registry` maps names to classes.

Torch-free at import on purpose: the metric scripts and the Snakefile import every registered
task module without torch; the task methods that need torch import it where they run.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from importlib import import_module
from pathlib import Path
from typing import Any, ClassVar, Mapping


@dataclass
class TaskHeads:
    """The modules a task puts on top of VL-BERT; saved under `head.` and `roi_classifier.`."""

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
    predictions by a workflow script of their own (VCR's Q->AR).
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

    def build_heads(self, config, meta: Mapping[str, Any]) -> TaskHeads:
        """The modules on top of VL-BERT for this task (a `VLBertConfig` and the task meta)."""
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

    # ---- metric ----------------------------------------------------------------------------------

    def score(self, eval_task: str, split: str, rows: list[dict], sources: Mapping[str, str],
              where: str) -> tuple[float, list[dict]]:
        """(metric value in percent, rows to write as the predictions file) against the official
        annotation files; torch-free."""
        raise NotImplementedError

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
