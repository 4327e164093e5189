"""Rule `zero_shot_retrieval`: a pre-trained model's image retrieval with its image-caption head alone (no
fine-tuning), scored like a fine-tuned model's (R@1/5/10)."""

from pathlib import Path

from vlbert_core.models.common.config import ModelSettings
from vlbert_core.run_context import RunContext
from vlbert_core.tasks.modeling.retrieval import zero_shot_scores
from vlbert_core.tasks.scoring import evaluate_predictions
from vlbert_core.utils import setup_compute, setup_logging


def main(smk) -> None:
    setup_logging(smk.log[0])
    setup_compute(smk.threads)
    run = RunContext.from_params(smk.params, require=("device", "max_image_pixels"))
    sources = dict(smk.params.sources)
    zero_shot_scores(Path(smk.input.model).parent, smk.output.predictions, sources=sources,
                     model_cfg=ModelSettings.from_config(dict(smk.params.model)), rois_paths=list(smk.input.rois), split=smk.params.split,
                     max_text_len=int(smk.params.max_text_len), device=run.device,
                     max_image_pixels=run.max_image_pixels)
    evaluate_predictions("retrieval", smk.params.split, smk.output.predictions, sources, smk.output.json,
                         smk.output.scored, setting=smk.params.setting, schedule="zero_shot",
                         dataset=smk.params.dataset)


if __name__ == "__main__":  # under Snakemake's script: directive `snakemake` is a global
    from vlbert_core.cli import run_script

    run_script(main, snakemake)  # noqa: F821
