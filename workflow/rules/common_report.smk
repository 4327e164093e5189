# Helpers: what the result tables and the run report read (rules tables, report), the report's figures,
# and the lines a successful run ends with (the tables and the report it has written).

import os
import sys
from pathlib import Path

from vlbert_core.tables.build import outcome_paths
from vlbert_core.tasks.registry import config_task_names, get_task


def table_evals(table):
    """What a table reads: the eval JSON of each measured column for each of its settings, and the
    predictions files of the paired tests against `none` (tables/build.py)."""
    spec = TABLE_SPECS[table]
    files = []
    for setting in spec.measured_settings(
        config["pretrain"]["settings"], bool(INIT_FROM)
    ):
        for eval_task, split in spec.eval_targets():
            files.append(eval_json(eval_task, setting, spec.schedule, split))
            args = (Path("results"), eval_task, setting, spec.schedule, split)
            files += [str(path) for path in outcome_paths(*args)]
    return list(dict.fromkeys(files))  # a derived eval reads the predictions of others


def in_paper_tables(task):
    """Whether the task has columns in Tables 1-4; a config-declared task has its own table (custom.smk), and
    retrieval is in the model comparison's (compare.smk)."""
    cls = get_task(task)
    return task not in config_task_names() and bool(
        cls.paper_table or cls.ablation_columns
    )


def report_finetune_metrics():
    """The metrics.jsonl of every fine-tune job behind the tables (half: Table 4, full: Tables 1-3)."""
    jobs = [(setting, "half") for setting in config["pretrain"]["settings"]]
    jobs += [(setting, "full") for setting in PAPER_TABLE_SETTINGS]
    return [
        f"results/finetune/{task}/{setting}/{schedule}/metrics.jsonl"
        for task in FINETUNE_TASKS
        if in_paper_tables(task)
        for setting, schedule in jobs
    ]


def report_figure(name):
    return report(
        f"results/report/{name}.png",
        caption=f"../report/{name}.rst",
        category="Run report",
    )


def print_where_results_are():
    """The last lines of a successful run: the tables and the report it has written, in the working directory."""
    written = [
        path for path in [*TABLES, *COMPARISON_TABLES, REPORT] if os.path.exists(path)
    ]
    if written:
        listing = "\n".join(f"  {path}" for path in written)
        print(f"\nResults (in {os.getcwd()}):\n{listing}", file=sys.stderr)
