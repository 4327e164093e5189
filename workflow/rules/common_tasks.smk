# Helpers: the models, predictions and eval files of the pre-training, fine-tuning and evaluation jobs
# (rules pretrain, finetune, evaluate, derive_eval, custom): where a pre-training starts, which model a
# fine-tune starts from, the eval targets of a task and their paths, and the config's own tasks.

from vlbert_core.pretrain.settings import RELEASED_SETTING, get_setting
from vlbert_core.tasks.custom import CustomSpec
from vlbert_core.tasks.registry import get_task, task_of_eval


def pretrain_start(wildcards):
    """The model directory a pre-training continues (pretrain.continue_init_from), or None: from BERT."""
    return CONTINUE_FROM if get_setting(wildcards.setting).trains else None


def pretrain_start_input(wildcards):
    start = pretrain_start(wildcards)
    return [f"{start}/model.safetensors"] if start else []


def pretrained_model(wildcards):
    """The model a fine-tune starts from: our pre-training of the setting, or pretrain.init_from."""
    if wildcards.setting == RELEASED_SETTING:
        return f"{INIT_FROM}/model.safetensors"
    return f"results/pretrain/{wildcards.setting}/model.safetensors"


def finetune_dataset(task):
    return get_task(task).dataset


def eval_to_finetune_task(eval_task):
    return task_of_eval(eval_task).name


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
