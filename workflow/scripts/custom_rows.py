"""Rule `custom_rows`: check every row of a `tasks.custom.<name>` entry's train and val files (image
readable, label known; URLs downloaded) and write the rows with their status, and the labels."""

from pathlib import Path

from vlbert_core.run_context import RunContext
from vlbert_core.tasks.custom import CustomSpec
from vlbert_core.tasks.custom_rows import check_rows
from vlbert_core.utils import setup_logging


def main(smk) -> None:
    setup_logging(smk.log[0])
    spec = CustomSpec.from_config(smk.params.name, dict(smk.params.entry))
    out_dir = Path(smk.output.labels).parent
    if Path(smk.output.train).parent != out_dir or Path(smk.output.val).parent != out_dir:
        raise ValueError(f"outputs train and val must sit next to output labels in {out_dir}")
    run = RunContext.from_params(smk.params, require=("max_image_pixels",))
    check_rows(spec, out_dir, max_image_pixels=run.max_image_pixels)


if __name__ == "__main__":  # under Snakemake's script: directive `snakemake` is a global
    from vlbert_core.cli import run_script

    run_script(main, snakemake)  # noqa: F821
