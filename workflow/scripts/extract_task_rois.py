"""Snakemake entry point: the RoIs of a task dataset's images (the registered tasks' `roi_dataset`), detected (rule
extract_task_rois) or imported from a bottom-up-attention TSV (rule import_task_rois, which gives
`input.tsv`; its image_ids are COCO image ids)."""

from vlbert_core.detector import coco_image_id, extract_rois_with_detector, import_rois_with_detector
from vlbert_core.run_context import RunContext
from vlbert_core.tasks.registry import register_config_tasks, task_of_roi_dataset
from vlbert_core.utils import get_logger, setup_compute, setup_logging


def main(smk) -> None:
    setup_logging(smk.log[0])
    setup_compute(smk.threads)
    register_config_tasks(smk.config)  # the tasks.custom entries, as the Snakefile registered them
    paths = task_of_roi_dataset(smk.params.dataset).roi_image_paths(smk.params.split, smk.params.sources)
    get_logger(__name__).info("%s/%s: %d images", smk.params.dataset, smk.params.split, len(paths))
    samples = sorted((key, str(path)) for key, path in paths.items())
    run = RunContext.from_params(smk.params, require=("device", "max_image_pixels"))
    tsv = getattr(smk.input, "tsv", None)
    if tsv:
        import_rois_with_detector(tsv, smk.input.model, samples, smk.output.parquet, smk.params.rois,
                                  image_id_of=coco_image_id, device=run.device, max_image_pixels=run.max_image_pixels)
    else:
        extract_rois_with_detector(smk.input.model, samples, smk.output.parquet, smk.params.rois, run.device,
                                   max_image_pixels=run.max_image_pixels)


if __name__ == "__main__":  # under Snakemake's script: directive `snakemake` is a global
    from vlbert_core.cli import run_script

    run_script(main, snakemake)  # noqa: F821
