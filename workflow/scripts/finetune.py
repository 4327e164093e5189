"""Snakemake entry point: fine-tune one pre-trained VL-BERT on one task (VCR, VQA or RefCOCO+),
then predict its held-out splits while the model is in memory (the `evaluate` jobs score them)."""

from pathlib import Path

from vlbert_core.models.common.config import ModelSettings
from vlbert_core.run_context import RunContext
from vlbert_core.tasks.evaluate import predict_splits, write_prediction_bundle
from vlbert_core.tasks.finetune import finetune
from vlbert_core.tasks.registry import register_config_tasks
from vlbert_core.tasks.settings import FinetuneSettings
from vlbert_core.utils import setup_compute, setup_logging


def main(smk) -> None:
    setup_logging(smk.log[0])
    setup_compute(smk.threads)
    register_config_tasks(smk.config)  # the tasks.custom entries, as the Snakefile registered them
    out_dir = Path(smk.output.model).parent
    for name in ("config", "metrics", "predictions"):
        if Path(getattr(smk.output, name)).parent != out_dir:
            raise ValueError(f"output {name} must sit next to output model in {out_dir}")
    run = RunContext.from_params(smk.params)  # seed, device, max_image_pixels
    model = ModelSettings.from_config(dict(smk.params.model))
    finetune(
        task=smk.params.task,
        pretrained_dir=Path(smk.input.pretrained).parent,
        out_dir=out_dir,
        setting=smk.params.setting,
        schedule=smk.params.schedule,
        schedule_factor=float(smk.params.schedule_factor),
        hparams=FinetuneSettings.for_task(smk.params.task, dict(smk.params.hparams)),
        tune_frcnn=bool(smk.params.tune_frcnn),
        sentence_readout=smk.params.sentence_readout,
        model_cfg=model,
        sources=dict(smk.params.sources),
        rois_paths=list(smk.input.rois),
        seed=run.seed,
        device=run.device,
        max_image_pixels=run.max_image_pixels,
    )
    bundle = predict_splits(
        out_dir,
        [tuple(target) for target in smk.params.eval_targets],
        sources=dict(smk.params.sources),
        model_cfg=model,
        rois_paths=list(smk.input.eval_rois),
        seed=run.seed,
        device=run.device,
        max_image_pixels=run.max_image_pixels,
    )
    write_prediction_bundle(bundle, smk.output.predictions, model_dir=out_dir)


if __name__ == "__main__":  # under Snakemake's script: directive `snakemake` is a global
    from vlbert_core.cli import run_script

    run_script(main, snakemake)  # noqa: F821
