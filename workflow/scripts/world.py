"""Rule `world`: generate the synthetic world (images + raw datasets in official formats)."""

from pathlib import Path

from vlbert_core.run_context import RunContext
from vlbert_core.utils import setup_compute, setup_logging
from vlbert_core.world import generate_world


def main(smk) -> None:
    setup_logging(smk.log[0])
    setup_compute(smk.threads)
    run = RunContext.from_params(smk.params, require=("seed",))
    generate_world(
        cfg=dict(smk.params.world),
        sources=dict(smk.params.sources),
        out_root=Path.cwd(),
        seed=run.seed,
        summary_path=Path(smk.output.summary),
    )


if __name__ == "__main__":  # under Snakemake's script: directive `snakemake` is a global
    from vlbert_core.cli import run_script

    run_script(main, snakemake)  # noqa: F821
