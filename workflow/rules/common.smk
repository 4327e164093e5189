# Helpers shared by the workflow modules: which files exist for this config, and the params each job
# depends on. Keeping these in one place is what makes `params:` invalidate exactly the right jobs.

import functools
import os
import sys
import json
import re
from pathlib import Path

from vlbert_core.fingerprint import code_fingerprint
from vlbert_core.pretrain.launch import Launch
from vlbert_core.pretrain.settings import RELEASED_SETTING, get_setting
from vlbert_core.tables import table_specs
from vlbert_core.tables.build import outcome_paths
from vlbert_core.tables.seeds import check_seeds, seed_eval_paths
from vlbert_core.tables.retrieval import retrieval_eval_paths
from vlbert_core.tables.comparison import (
    check_comparison_seeds,
    comparison_eval_paths,
    comparison_pretrain_paths,
    comparison_settings,
)
from vlbert_core.tables.finetune_seeds import (
    check_finetune_seeds,
    finetune_seed_eval_paths,
)
from snakemake.io import flag
from vlbert_core.tasks.custom import CustomSpec

# Every rule's software, for `--software-deployment-method conda` (relative to workflow/rules/).
CONDA_ENV = "../../envs/vlbert.yaml"
from vlbert_core.tasks.registry import (
    config_task_names,
    dataset_sources,
    dataset_splits,
    derived_eval_task_names,
    eval_task_names,
    get_task,
    roi_datasets,
    task_names,
    task_of_eval,
    task_of_name,
    world_task_datasets,
)


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


def cc_shard_ids(split):
    return [f"{i:05d}" for i in range(config["cc"]["num_shards"][split])]


def cc_shards(split):
    return expand(
        "results/shards/cc/{split}-{shard}.tar", split=split, shard=cc_shard_ids(split)
    )


def cc_roi_parquets(split):
    return expand(
        "results/rois/cc/{split}-{shard}.parquet",
        split=split,
        shard=cc_shard_ids(split),
    )


def text_shards(corpus):
    n = config["text"]["num_shards"]
    return [f"results/shards/text/{corpus}-{i:05d}.tar" for i in range(n)]


def pretrain_cc_shards(wildcards):
    return [tar for split in config["cc"]["splits"] for tar in cc_shards(split)]


def pretrain_roi_parquets(wildcards):
    return [pq for split in config["cc"]["splits"] for pq in cc_roi_parquets(split)]


def pretrain_start(wildcards):
    """The model directory a pre-training continues (pretrain.continue_init_from), or None: from BERT."""
    return CONTINUE_FROM if get_setting(wildcards.setting).trains else None


def pretrain_start_input(wildcards):
    start = pretrain_start(wildcards)
    return [f"{start}/model.safetensors"] if start else []


def pretrain_text_shards(wildcards):
    return [tar for corpus in config["text"]["corpora"] for tar in text_shards(corpus)]


def source_files(dataset, splits):
    """The raw files of a task dataset, with `{split}` templates filled in."""
    files = []
    for key, path in dataset_sources(dataset, config["sources"]).items():
        if key == "images":
            continue  # image folders are not tracked as files; their annotation files are
        files.extend(sorted({path.format(split=s) for s in splits}))
    return files


def finetune_dataset(task):
    return get_task(task).dataset


def eval_to_finetune_task(eval_task):
    return task_of_eval(eval_task).name


def task_rois(task, splits):
    """The detected-RoI parquets a task reads (none for a task that uses its dataset's own boxes)."""
    dataset = task_of_name(task).roi_dataset
    return (
        [f"results/rois/{dataset}/{split}.parquet" for split in splits]
        if dataset
        else []
    )


def pretrained_model(wildcards):
    """The model a fine-tune starts from: our pre-training of the setting, or pretrain.init_from."""
    if wildcards.setting == RELEASED_SETTING:
        return f"{INIT_FROM}/model.safetensors"
    return f"results/pretrain/{wildcards.setting}/model.safetensors"


def finetune_predictions(task, setting, schedule):
    return f"results/finetune/{task}/{setting}/{schedule}/predictions.json"


def eval_splits(task):
    """The held-out splits a fine-tuned model predicts (the task's own)."""
    return list(get_task(task).eval_splits)


def eval_targets(task):
    """(eval task, split) pairs a fine-tune job predicts (RefCOCO+: one eval task per region track)."""
    eval_tasks = get_task(task).eval_task_names()
    return [
        [eval_task, split] for eval_task in eval_tasks for split in eval_splits(task)
    ]


def eval_json(eval_task, setting, schedule, split):
    return f"results/eval/{eval_task}/{setting}/{schedule}/{split}.json"


def eval_predictions(eval_task, setting, schedule, split):
    return f"results/eval/{eval_task}/{setting}/{schedule}/{split}.predictions.json"


def derived_eval_inputs(derived_task, setting, schedule, split):
    """{eval task: its predictions file} a derived eval task is scored from (its task's `derived_inputs`)."""
    return {
        eval_task: eval_predictions(eval_task, setting, schedule, split)
        for eval_task in task_of_eval(derived_task).derived_inputs(derived_task)
    }


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


def print_where_results_are():
    """The last lines of a successful run: the tables and the report it has written, in the working directory."""
    written = [
        path for path in [*TABLES, *COMPARISON_TABLES, REPORT] if os.path.exists(path)
    ]
    if written:
        listing = "\n".join(f"  {path}" for path in written)
        print(f"\nResults (in {os.getcwd()}):\n{listing}", file=sys.stderr)


def world_outputs():
    src = config["sources"]
    files = list(src["cc"].values()) + [src["books"], src["wiki"]]
    for dataset in world_task_datasets():
        files += source_files(dataset, dataset_splits(dataset))
    files += source_files("detector", ["train", "val"])
    return sorted(set(files))


def roi_tsv(dataset, split, shard=None):
    """The bottom-up TSV of a dataset's split (and CC shard): rois.source with {split}/{shard} filled in."""
    path = ROI_SOURCES[dataset].replace("{split}", split)
    return path.replace("{shard}", shard) if shard is not None else path


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


def in_paper_tables(task):
    """Whether the task has columns in Tables 1-4; a config-declared task has its own table (custom.smk), and
    retrieval is in the model comparison's (compare.smk)."""
    cls = get_task(task)
    return task not in config_task_names() and bool(
        cls.paper_table or cls.ablation_columns
    )


def report_figure(name):
    return report(
        f"results/report/{name}.png",
        caption=f"../report/{name}.rst",
        category="Run report",
    )


# ---- Published weights made by the workflow (weights.smk): stand-ins and conversions ----

STAND_INS = config["stand_ins"]
MANIFEST_STAND_INS = {
    path: entry for path, entry in STAND_INS.items() if entry["kind"] == "manifest"
}
BERT_STAND_INS = {
    path: entry for path, entry in STAND_INS.items() if entry["kind"] == "bert"
}
MANIFEST_DIR = Path(workflow.basedir) / "tests" / "data" / "manifests"
CONVERSIONS = config["convert"]
FILE_CONVERSIONS = {
    path: entry
    for path, entry in CONVERSIONS.items()
    if entry["converter"] != "vl-bert"
}
VLBERT_CONVERSIONS = {
    path: entry
    for path, entry in CONVERSIONS.items()
    if entry["converter"] == "vl-bert"
}
CONVERSION_FILE_KEYS = (
    "input",
    "bert_path",
    "visual_weights",
)  # entry keys naming files the converter reads


def bert_checkpoint_input():
    """model.bert_path as a job input when rule stand_in_bert makes it (a hand-obtained one is read by the job)."""
    path = config["model"]["bert_path"]
    return [path] if path in BERT_STAND_INS else []


def conversion_inputs(entry):
    return {key: entry[key] for key in CONVERSION_FILE_KEYS if entry.get(key)}


# Table 4 over training seeds (config/seeds.yaml, workflow/rules/seeds.smk): each seed's pre-training,
# fine-tuning and evals under results/seeds/<seed>/; the config's own seed is the default run.
SEED_DIR = "results/seeds/{seed}/"
# The default run's comparison over fine-tuning seeds: the config seed's pre-trained models fine-tuned
# again, under results/finetune_seeds/<fseed>/.
FINETUNE_SEED_DIR = "results/finetune_seeds/{fseed}/"


def seeded_outputs(rule, seed_dir=SEED_DIR):
    """A rule's named outputs moved under `seed_dir` (results/seeds/{seed}/), flags (directory, temp)
    kept, so a seeded copy of the rule writes what the rule writes."""
    outputs = rule.rule.output
    named = dict(outputs.items())
    if len(named) != len(outputs):
        raise ValueError(f"the seeded copy of {rule.name} needs every output named")
    seeded = {}
    for name, path in named.items():
        seeded[name] = f"{seed_dir}{str(path).removeprefix('results/')}"
        for key, value in path.flags.items():
            seeded[name] = flag(seeded[name], key, value)
    return seeded


def inputs_with(rule, **changed):
    """A rule's named inputs with some replaced (a `with: input:` of a reused rule replaces them all)."""
    inputs = rule.rule.input
    named = dict(inputs.items())
    if len(named) != len(inputs):
        raise ValueError(f"the seeded copy of {rule.name} needs every input named")
    return {**named, **changed}


def seed_pretrained_model(wildcards):
    setting = wildcards.setting
    return f"results/seeds/{wildcards.seed}/pretrain/{setting}/model.safetensors"


def seeded_finetune_predictions(seed_dir):
    """Input function of a seeded eval job under `seed_dir`: the predictions of its seeded fine-tune job."""

    def predictions(wildcards):
        task = eval_to_finetune_task(wildcards.eval_task)
        path = finetune_predictions(task, wildcards.setting, wildcards.schedule)
        return seed_dir.format(**dict(wildcards.items())) + path.removeprefix(
            "results/"
        )

    return predictions


def finetune_seed_table_evals(wildcards):
    """The eval JSONs of the comparison over fine-tuning seeds (config `finetune_seeds`; the config's
    seed: results/)."""
    check_finetune_seeds(config["finetune_seeds"], PAPER_TABLE_SETTINGS)
    args = ("results", config["finetune_seeds"], config["seed"], PAPER_TABLE_SETTINGS)
    return [str(path) for path in finetune_seed_eval_paths(*args)]


def comparison_evals(wildcards):
    """The eval JSONs of the model comparison: every seed of compare.seeds x its settings x Table 4 column."""
    check_comparison_seeds(config["compare"]["seeds"])
    args = ("results", config["compare"]["seeds"], config["seed"])
    return [str(path) for path in comparison_eval_paths(*args)]


def retrieval_evals(wildcards):
    """The retrieval table's eval JSONs: fine-tuned for every comparison setting, zero-shot for those with a head."""
    args = ("results", config["compare"]["seeds"], config["seed"])
    return [str(path) for path in retrieval_eval_paths(*args)]


def comparison_pretrained(wildcards):
    """The pre-trained models of the comparison (their metrics give the seconds, their weights the size)."""
    args = ("results", config["compare"]["seeds"], config["seed"])
    return [str(path) for path in comparison_pretrain_paths(*args)]


def seed_table_evals(wildcards):
    """The eval JSONs of Table 4 for every seed of config `seeds` (the config's seed: results/)."""
    check_seeds(config["seeds"])
    args = ("results", config["seeds"], config["seed"], config["pretrain"]["settings"])
    return [str(path) for path in seed_eval_paths(*args)]


# ---- Your own tasks (tasks.custom, custom.smk): one registered task custom_<name> per entry ----

CUSTOM_SPECS = {
    name: CustomSpec.from_config(name, entry)
    for name, entry in (config.get("tasks") or {}).get("custom", {}).items()
}


def custom_settings(name):
    """The pre-training settings a custom task is fine-tuned from (its `settings`, else all)."""
    spec = CUSTOM_SPECS[name]
    settings = list(spec.settings or FINETUNE_SETTINGS)
    unknown = [s for s in settings if s not in FINETUNE_SETTINGS]
    if unknown or spec.schedule not in config["finetune"]["schedules"]:
        raise ValueError(
            f"config tasks.custom.{name}: settings {unknown} are not fine-tuned "
            f"(known: {FINETUNE_SETTINGS}) or schedule {spec.schedule!r} is not one of "
            f"{list(config['finetune']['schedules'])}"
        )
    return settings
