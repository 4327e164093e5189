"""The registry of fine-tuning tasks: task names -> `Task` classes (see `base.Task`).

The built-in tasks are registered here; another task registers itself with `register(cls)` before
the config is validated or a job runs. The config's own tasks (`tasks.custom.<name>`, see
`tasks/custom.py`) are registered per entry by `register_config_tasks(config)`: the Snakefile calls
it right after the schema, and every job script that looks tasks up calls it with `snakemake.config`. Every lookup of an unknown name is an error listing the
registered ones. Torch-free (the task modules import torch only where their methods run).
"""

from __future__ import annotations

from typing import Any, Mapping

from .base import PaperTable, TableColumn, Task
from .custom import CustomClassificationTask, CustomSpec
from .refcoco import RefcocoTask
from .retrieval import RetrievalTask
from .vcr import VcrQ2ATask, VcrQA2RTask
from .vqa import VqaTask

_TASKS: dict[str, type[Task]] = {}


def register(cls: type[Task]) -> type[Task]:
    """Add a task class under `cls.name` (usable as a class decorator); a name taken by another
    class, fine-tune or eval, is an error."""
    taken = {name: other for other in _TASKS.values() if other is not cls for name in _names(other)}
    clashes = [name for name in _names(cls) if name in taken]
    if clashes:
        raise ValueError(f"task {cls.__name__}: names {clashes} are already registered by "
                         f"{sorted({taken[n].__name__ for n in clashes})}")
    _TASKS[cls.name] = cls
    return cls


def register_custom(name: str, spec: Mapping[str, Any]) -> type[Task]:
    """Register the `CustomClassificationTask` of the config entry `tasks.custom.<name>`. The same
    entry again is a no-op (a job script registers what the Snakefile did); another entry under the
    same name is an error."""
    custom = CustomSpec.from_config(name, spec)
    registered = _TASKS.get(custom.task_name)
    if registered is not None and getattr(registered, "spec", None) == custom:
        return registered
    return register(CustomClassificationTask.task_class(custom))


def register_config_tasks(config: Mapping[str, Any]) -> list[str]:
    """Register a task per `tasks.custom.<name>` entry of the config; returns their task names."""
    entries = (config.get("tasks") or {}).get("custom") or {}
    return [register_custom(name, entry).name for name, entry in entries.items()]


# Task classes that are no task themselves but make one per config entry: their modules belong to
# their own family in the code fingerprints, whether or not the config has an entry.
TASK_TEMPLATES: tuple[type[Task], ...] = (CustomClassificationTask,)


def unregister(name: str) -> None:
    """Remove a task (tests register toy tasks for their own duration)."""
    _TASKS.pop(name, None)


def _names(cls: type[Task]) -> tuple[str, ...]:
    return (cls.name, *cls.eval_task_names(), *cls.derived_eval_tasks)


def registered_tasks() -> list[type[Task]]:
    """The registered task classes, in registration order."""
    return list(_TASKS.values())


def task_names() -> list[str]:
    """The registered fine-tune task names, in registration order."""
    return list(_TASKS)


def eval_task_names() -> list[str]:
    """Every eval task the registered tasks' fine-tunes predict."""
    return [name for cls in _TASKS.values() for name in cls.eval_task_names()]


def derived_eval_task_names() -> list[str]:
    """Every eval task the registered tasks derive from other eval tasks' predictions."""
    return [name for cls in _TASKS.values() for name in cls.derived_eval_tasks]


def get_task(name: str) -> Task:
    """The task fine-tuned under `name`, or an error listing the registered ones."""
    if name not in _TASKS:
        raise ValueError(f"unknown fine-tuning task {name!r}; registered tasks: {task_names()}")
    return _TASKS[name]()


def task_of_eval(eval_task: str) -> Task:
    """The task whose fine-tunes predict (or derive) `eval_task`."""
    for cls in _TASKS.values():
        if eval_task in cls.eval_task_names() or eval_task in cls.derived_eval_tasks:
            return cls()
    raise ValueError(f"unknown eval task {eval_task!r}; registered eval tasks: {eval_task_names()}")


def task_of_name(name: str) -> Task:
    """The task a fine-tune or eval task name belongs to."""
    return get_task(name) if name in _TASKS else task_of_eval(name)


def config_task_names() -> list[str]:
    """The registered tasks declared by the config (`tasks.custom`), not by code."""
    return [cls.name for cls in _TASKS.values() if cls.own_sources is not None]


def dataset_sources(dataset: str, sources: Mapping[str, Any]) -> dict:
    """The files of a task dataset: the config's `sources.<dataset>`, or those a config-declared task
    names itself (`Task.own_sources`)."""
    for cls in _TASKS.values():
        if cls.dataset == dataset and cls.own_sources is not None:
            return dict(cls.own_sources)
    if dataset not in sources:
        raise ValueError(f"config sources: no entry {dataset!r} (it has {sorted(sources)})")
    return dict(sources[dataset])


def world_task_datasets() -> list[str]:
    """The task datasets rule `world` writes for the embedded world."""
    return list(dict.fromkeys(cls.dataset for cls in _TASKS.values() if cls.world_dataset))


def task_datasets() -> list[str]:
    """The datasets (keys under `sources:`) of the registered tasks, in registration order."""
    return list(dict.fromkeys(cls.dataset for cls in _TASKS.values()))


def roi_datasets() -> list[str]:
    """The datasets whose images get detected RoIs for a registered task."""
    return list(dict.fromkeys(cls.roi_dataset for cls in _TASKS.values() if cls.roi_dataset))


def task_of_roi_dataset(dataset: str) -> Task:
    """The (first) registered task that reads the detected RoIs of `dataset`."""
    for cls in _TASKS.values():
        if cls.roi_dataset == dataset:
            return cls()
    raise ValueError(f"no registered task reads detected RoIs of dataset {dataset!r}; "
                     f"those that do: {roi_datasets()}")


def dataset_splits(dataset: str) -> list[str]:
    """The splits of `dataset` its registered tasks read: the training split, then the eval splits."""
    splits = [s for cls in _TASKS.values() if cls.dataset == dataset for s in (cls.train_split, *cls.eval_splits)]
    if not splits:
        raise ValueError(f"no registered task reads dataset {dataset!r}; registered datasets: {task_datasets()}")
    return list(dict.fromkeys(splits))


def paper_tables() -> list[PaperTable]:
    """The registered tasks' tables of the paper, in registration order; a table that several
    classes share (VCR's Q->A and QA->R) comes once."""
    tables: dict[str, PaperTable] = {}
    for cls in _TASKS.values():
        table = cls.paper_table
        if table is not None and tables.setdefault(table.name, table) != table:
            raise ValueError(f"task {cls.__name__}: table {table.name!r} differs from the one another "
                             "registered task defines under that name")
    return list(tables.values())


def ablation_columns() -> list[TableColumn]:
    """The registered tasks' columns of Table 4, the ablation, in registration order."""
    return [col for cls in _TASKS.values() for col in cls.ablation_columns]


def comparison_columns() -> list[TableColumn]:
    """The registered tasks' columns of the model comparison (VL-BERT vs ViLBERT), in registration order."""
    return [col for cls in _TASKS.values()
            for col in (cls.ablation_columns if cls.comparison_columns is None else cls.comparison_columns)]


FINETUNE_OPTIONS = ("schedules", "tune_frcnn", "sentence_readout")  # the keys of `finetune:` that are not tasks


def check_finetune_config(finetune: Mapping[str, Any], sources: Mapping[str, Any]) -> None:
    """The config's `finetune:` section names registered tasks only, has a section for each, with the
    task's own required keys, and `sources:` has each task's dataset. Run right after the schema."""
    unknown = [key for key in finetune if key not in FINETUNE_OPTIONS and key not in _TASKS]
    if unknown:
        raise ValueError(f"config finetune: unknown tasks {unknown}; registered tasks: {task_names()}")
    missing = [name for name in _TASKS if name not in finetune]
    if missing:
        raise ValueError(f"config finetune: no section for the registered tasks {missing}")
    for cls in _TASKS.values():
        lacking = [key for key in cls.required_hparams if key not in finetune[cls.name]]
        if lacking:
            raise ValueError(f"config finetune.{cls.name} lacks keys {lacking}")
        if cls.own_sources is None and cls.dataset not in sources:
            raise ValueError(f"config sources: task {cls.name} needs sources.{cls.dataset}")


for _builtin in (VcrQ2ATask, VcrQA2RTask, VqaTask, RefcocoTask, RetrievalTask):
    register(_builtin)
