"""Snakemake entry point: the official metric of one (eval task, split) from the fine-tune job's
predictions and the dataset's own annotation files. Torch-free."""

from vlbert_core.tasks.scoring import evaluate_predictions
from vlbert_core.tasks.registry import register_config_tasks
from vlbert_core.utils import setup_logging


def main(smk) -> None:
    setup_logging(smk.log[0])
    register_config_tasks(smk.config)  # the tasks.custom entries, as the Snakefile registered them
    evaluate_predictions(
        smk.params.task,
        smk.params.split,
        smk.input.predictions,
        dict(smk.params.sources),
        smk.output.json,
        smk.output.predictions,
        setting=smk.params.setting,
        schedule=smk.params.schedule,
        dataset=smk.params.dataset,
        rois=list(smk.input.rois),
        max_rois=smk.params.max_rois,
    )


if __name__ == "__main__":  # under Snakemake's script: directive `snakemake` is a global
    from vlbert_core.cli import run_script

    run_script(main, snakemake)  # noqa: F821
