"""Rule `custom_example`: the world's example dataset for config/own_data_example.yaml."""

from pathlib import Path

from vlbert_core.run_context import RunContext
from vlbert_core.utils import setup_logging
from vlbert_core.world.custom_example import write_custom_example


def main(smk) -> None:
    setup_logging(smk.log[0])
    run = RunContext.from_params(smk.params, require=("seed",))
    written = write_custom_example(Path(smk.output.train).parent, image_size=int(smk.params.image_size),
                                   seed=run.seed)
    for split in ("train", "val"):
        if written[split].resolve() != Path(getattr(smk.output, split)).resolve():
            raise ValueError(f"the example's {split} file is {written[split]}, not the rule's output")


if __name__ == "__main__":  # under Snakemake's script: directive `snakemake` is a global
    from vlbert_core.cli import run_script

    run_script(main, snakemake)  # noqa: F821
