# Helpers: the seeded copies of rules and the tables over seeds (seeds.smk, compare.smk). Table 4 over
# training seeds (config `seeds`), the comparison over fine-tuning seeds (config `finetune_seeds`) and
# the model comparison (compare.seeds): each seeded rule's outputs and inputs, and the eval JSONs and
# models each seed table reads.

from snakemake.io import flag

from vlbert_core.tables.comparison import (
    check_comparison_seeds,
    comparison_eval_paths,
    comparison_pretrain_paths,
)
from vlbert_core.tables.finetune_seeds import (
    check_finetune_seeds,
    finetune_seed_eval_paths,
)
from vlbert_core.tables.retrieval import retrieval_eval_paths
from vlbert_core.tables.seeds import check_seeds, seed_eval_paths

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
