# The core helpers every workflow module uses: config access (the settings, tasks and tables of this
# config, the wildcard constraints), the params each job depends on (`code` fingerprints, `stable`
# config sections, `run_params`: the run context), the software and the resources of a pre-training.
# Keeping the params in one place is what makes `params:` invalidate exactly the right jobs.
# The other helpers, by concern: common_data.smk (sources, shards, RoIs), common_tasks.smk (models,
# predictions, eval paths, your own tasks), common_weights.smk (stand-ins, manifests, conversions),
# common_seeds.smk (seeded rules, seed tables), common_report.smk (tables' and report's inputs).

import functools
import json

from vlbert_core.fingerprint import code_fingerprint
from vlbert_core.pretrain.launch import Launch
from vlbert_core.pretrain.settings import RELEASED_SETTING
from vlbert_core.run_context import FIELDS as RUN_CONTEXT_FIELDS
from vlbert_core.tables import table_specs
from vlbert_core.tables.comparison import comparison_settings
from vlbert_core.tasks.registry import (
    derived_eval_task_names,
    eval_task_names,
    get_task,
    task_names,
)

# Every rule's software, for `--software-deployment-method conda` (relative to workflow/rules/).
CONDA_ENV = "../../envs/vlbert.yaml"


@functools.cache  # called once per job while planning; the value depends on (script, task) only
def code(script, task=None):
    """Fingerprint of the code a job of workflow/scripts/<script>.py runs, for `params: code=`.

    Snakemake sees an edit of a rule's script, not of the vlbert_core modules it imports; this
    hash covers both (vlbert_core/fingerprint.py), and a task's fingerprint leaves out the other
    tasks' modules. The files are read next to this Snakefile, not from the installed package.
    """
    return code_fingerprint(workflow.basedir, f"workflow/scripts/{script}.py", task)


def stable(section):
    """A config section as a job param, keys sorted at every level.

    Snakemake re-runs a job when the text of its params changes; sorting makes that text depend on
    the values only, so reordering keys in a YAML file re-runs nothing.
    """
    return json.loads(json.dumps(section, sort_keys=True))


def run_params(*names):
    """The run context's config values a job depends on, as `**run_params(...)` in its params: `seed`,
    `device`, `max_image_pixels` (vlbert_core/run_context.py; its script reads them back with
    RunContext.from_params). Name only those the job uses: each is a re-run trigger."""
    unknown = [name for name in names if name not in RUN_CONTEXT_FIELDS]
    if unknown or not names:
        raise ValueError(
            f"run_params: {unknown or 'no names'}; the run context's fields: {RUN_CONTEXT_FIELDS}"
        )
    return {name: config[name] for name in names}


# pretrain.init_from: a converted released VL-BERT (python -m vlbert_core.convert vl-bert). When set,
# setting `released` fine-tunes it directly (no pretrain job) and Tables 1-3 carry its row.
INIT_FROM = config["pretrain"].get("init_from")
# pretrain.continue_init_from: the settings that pre-train continue from INIT_FROM (and its heads) instead of BERT.
CONTINUE_FROM = INIT_FROM if config["pretrain"].get("continue_init_from") else None
if config["pretrain"].get("continue_init_from") and not INIT_FROM:
    raise ValueError(
        "config: pretrain.continue_init_from is true but pretrain.init_from names no model directory"
    )
# Tables 1-3 compare "w/o pre-training" with the full model (and the released one) at the full schedule.
PAPER_TABLE_SETTINGS = ["none", "full"] + ([RELEASED_SETTING] if INIT_FROM else [])
FINETUNE_SETTINGS = list(config["pretrain"]["settings"]) + (
    [RELEASED_SETTING] if INIT_FROM else []
)
# VL-BERT vs ViLBERT (compare.smk), not part of the default run
COMPARISON_TABLES = [
    f"results/tables/{name}.{ext}"
    for name in ("model_comparison", "retrieval")
    for ext in ("csv", "md")
]
# The settings only the model comparison fine-tunes (compare.smk): ViLBERT's
COMPARISON_ONLY_SETTINGS = [
    s for s in comparison_settings() if s not in FINETUNE_SETTINGS
]
# The tasks, their datasets and eval tasks: vlbert_core/tasks/registry.py.
FINETUNE_TASKS = task_names()
EVAL_TASKS = eval_task_names()
# The held-out splits the registered tasks are evaluated on (rule evaluate)
EVAL_SPLITS = sorted(
    {split for task in FINETUNE_TASKS for split in get_task(task).eval_splits}
)
# Eval tasks scored from other eval tasks' predictions (rule derive_eval).
DERIVED_EVAL_TASKS = derived_eval_task_names()

# Tables 1-4, their columns from the registered tasks (vlbert_core/tables/build.py)
TABLE_SPECS = table_specs()
TABLES = expand(
    "results/tables/{table}.{ext}", table=list(TABLE_SPECS), ext=["csv", "md"]
)


wildcard_constraints:
    shard=r"\d{5}",
    split=r"[A-Za-z0-9_]+",
    setting="|".join(FINETUNE_SETTINGS + COMPARISON_ONLY_SETTINGS),
    schedule="|".join(config["finetune"]["schedules"]),
    finetune_task="|".join(FINETUNE_TASKS),
    eval_task="|".join(EVAL_TASKS),
    seed=r"\d+",
    fseed=r"\d+",


def pretrain_resources():
    """Resources of a pre-training job: its SLURM allocation follows pretrain.launch.

    One node: the job step gets all processes_per_node GPUs and torchrun (or the script itself)
    starts the processes. Several nodes: `mpi` keeps the SLURM plugin from wrapping the job in its
    own one-task srun, so the script's `srun --ntasks-per-node=1 torchrun ...` can reach every node;
    tasks = nodes gives one launcher task per node and --gpus-per-node the GPUs of each.
    tasks_per_gpu=0 stops the plugin from turning `tasks` into --ntasks-per-gpu.
    """
    launch = Launch.from_config(config["pretrain"].get("launch"))
    cuda = config["device"] == "cuda"
    resources = {
        "mem_mb": 8000,
        "runtime": 600,
        "nodes": launch.nodes,
        "tasks_per_gpu": 0,
    }
    if launch.nodes == 1:
        resources["gpu"] = launch.processes_per_node if cuda else 0
    else:
        resources.update(mpi="srun", tasks=launch.nodes)
        if cuda:
            resources["slurm_extra"] = f"--gpus-per-node={launch.processes_per_node}"
    return resources
