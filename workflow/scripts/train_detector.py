"""Snakemake entry point: train the detector on the world's COCO-style annotations."""

from vlbert_core.detector import train_detector
from vlbert_core.run_context import RunContext
from vlbert_core.utils import setup_compute, setup_logging


def main(smk) -> None:
    setup_logging(smk.log[0])
    setup_compute(smk.threads)
    run = RunContext.from_params(smk.params, require=("seed", "max_image_pixels"))
    train_detector(
        cfg=smk.params.detector,
        annotations_train=smk.input.train,
        annotations_val=smk.input.val,
        images_dir=smk.params.images,
        out_model=smk.output.model,
        out_metrics=smk.output.metrics,
        seed=run.seed,
        max_image_pixels=run.max_image_pixels,
    )


if __name__ == "__main__":  # under Snakemake's script: directive `snakemake` is a global
    from vlbert_core.cli import run_script

    run_script(main, snakemake)  # noqa: F821
