"""Snakemake entry point: detect and select the RoIs of one CC shard."""

from vlbert_core.detector import extract_rois_with_detector, read_cc_shard
from vlbert_core.utils import set_threads, setup_logging


def main(smk) -> None:
    setup_logging(smk.log[0])
    set_threads(smk.threads)
    extract_rois_with_detector(
        smk.input.model, read_cc_shard(smk.input.tar), smk.output.parquet, smk.params.rois, smk.params.device
    )


if __name__ == "__main__":  # under Snakemake's script: directive `snakemake` is a global
    main(snakemake)  # noqa: F821
