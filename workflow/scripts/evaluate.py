"""Snakemake entry point: evaluate one fine-tuned model with the official metric of its task.

Two rule shapes are accepted: one job per split (output `json` + `predictions`, params `split`,
`task` an eval task such as `refcoco_det`), or one job over several splits (outputs `jsons` +
`predictions` lists, params `splits`; for task `refcoco` the order is gt val, testA, testB then
det val, testA, testB).
"""

from pathlib import Path

from vlbert_core.tasks.evaluate import EvalTarget, evaluate
from vlbert_core.utils import set_threads, setup_logging


def _as_list(value) -> list:
    return [value] if isinstance(value, (str, Path)) else list(value)


def eval_targets(task: str, splits: list[str], jsons: list[str], predictions: list[str]) -> list[EvalTarget]:
    eval_tasks = ["refcoco_gt", "refcoco_det"] if task == "refcoco" else [task]
    pairs = [(t, s) for t in eval_tasks for s in splits]
    if not len(pairs) == len(jsons) == len(predictions):
        raise ValueError(f"evaluate {task}: {len(pairs)} (task, split) pairs {pairs} but "
                         f"{len(jsons)} eval JSONs and {len(predictions)} predictions files")
    return [EvalTarget(t, s, Path(j), Path(p)) for (t, s), j, p in zip(pairs, jsons, predictions)]


def main(smk) -> None:
    setup_logging(smk.log[0])
    set_threads(smk.threads)
    if hasattr(smk.output, "jsons"):
        jsons, splits = _as_list(smk.output.jsons), _as_list(smk.params.splits)
    else:
        jsons, splits = [smk.output.json], [smk.params.split]
    targets = eval_targets(smk.params.task, splits, jsons, _as_list(smk.output.predictions))
    model_path = next((Path(p) for p in _as_list(smk.input.model) if Path(p).name == "model.safetensors"), None)
    if model_path is None:
        raise ValueError(f"input model {smk.input.model} names no model.safetensors")
    evaluate(
        model_path.parent,
        targets,
        setting=smk.params.setting,
        schedule=smk.params.schedule,
        sources=dict(smk.params.sources),
        model_cfg=dict(smk.params.model),
        dataset=smk.params.dataset,
        rois_paths=list(smk.input.rois),
        seed=int(smk.params.seed),
        device=smk.params.device,
    )


if __name__ == "__main__":  # under Snakemake's script: directive `snakemake` is a global
    main(snakemake)  # noqa: F821
