"""Snakemake entry point: download, resize and write one Conceptual Captions shard."""

from vlbert_core.data import download_cc_shard
from vlbert_core.run_context import RunContext
from vlbert_core.utils import setup_compute, setup_logging


def main(smk) -> None:
    setup_logging(smk.log[0])
    setup_compute(smk.threads)
    run = RunContext.from_params(smk.params, require=("max_image_pixels",))
    download_cc_shard(
        rows_parquet=smk.input.rows,
        split=smk.params.split,
        shard=int(smk.params.shard),
        resize=dict(smk.params.resize),
        download=dict(smk.params.download),
        out_tar=smk.output.tar,
        out_parquet=smk.output.parquet,
        out_stats=smk.output.stats,
        max_image_pixels=run.max_image_pixels,
    )


if __name__ == "__main__":  # under Snakemake's script: directive `snakemake` is a global
    from vlbert_core.cli import run_script

    run_script(main, snakemake)  # noqa: F821
