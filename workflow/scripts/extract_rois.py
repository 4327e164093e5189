"""Snakemake entry point: the RoIs of one CC shard, detected (rule extract_rois) or imported from a
bottom-up-attention TSV (rule import_rois, which gives `input.tsv`)."""

from vlbert_core.detector import cc_image_id, extract_rois_with_detector, import_rois_with_detector, read_cc_shard
from vlbert_core.run_context import RunContext
from vlbert_core.utils import setup_compute, setup_logging


def main(smk) -> None:
    setup_logging(smk.log[0])
    setup_compute(smk.threads)
    samples = read_cc_shard(smk.input.tar)
    run = RunContext.from_params(smk.params, require=("device", "max_image_pixels"))
    tsv = getattr(smk.input, "tsv", None)
    if tsv:
        import_rois_with_detector(tsv, smk.input.model, samples, smk.output.parquet, smk.params.rois,
                                  image_id_of=cc_image_id, device=run.device, max_image_pixels=run.max_image_pixels)
    else:
        extract_rois_with_detector(smk.input.model, samples, smk.output.parquet, smk.params.rois, run.device,
                                   max_image_pixels=run.max_image_pixels)


if __name__ == "__main__":  # under Snakemake's script: directive `snakemake` is a global
    from vlbert_core.cli import run_script

    run_script(main, snakemake)  # noqa: F821
