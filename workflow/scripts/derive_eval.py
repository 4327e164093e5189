"""Snakemake entry point: a derived eval task's eval JSON (VCR Q->AR) from other eval tasks'
prediction files, scored by the task that derives it (no torch)."""

from pathlib import Path

from vlbert_core.tasks.registry import task_of_eval
from vlbert_core.utils import setup_logging


def main(smk) -> None:
    setup_logging(smk.log[0])
    derived = smk.params.task
    task = task_of_eval(derived)
    task.derive(
        derived,
        {name: getattr(smk.input, name) for name in task.derived_inputs(derived)},
        smk.output.json,
        # without a `split` param the eval JSON is named after its split (…/val.json)
        split=getattr(smk.params, "split", None) or Path(smk.output.json).stem,
        setting=smk.params.setting,
        schedule=smk.params.schedule,
        dataset=smk.params.dataset,
    )


if __name__ == "__main__":  # under Snakemake's script: directive `snakemake` is a global
    from vlbert_core.cli import run_script

    run_script(main, snakemake)  # noqa: F821
