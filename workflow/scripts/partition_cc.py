"""Snakemake entry point: cut one split's Conceptual Captions TSV into its download shards."""

from vlbert_core.data.partition import partition_cc_tsv
from vlbert_core.utils import setup_logging


def main(smk) -> None:
    setup_logging(smk.log[0])
    partition_cc_tsv(
        tsv=smk.input.tsv,
        split=smk.params.split,
        shard_rows=int(smk.params.shard_rows),
        out_rows=smk.output.rows,
        expected_rows=smk.params.expected_rows,
    )


if __name__ == "__main__":  # under Snakemake's script: directive `snakemake` is a global
    from vlbert_core.cli import run_script

    run_script(main, snakemake)  # noqa: F821
