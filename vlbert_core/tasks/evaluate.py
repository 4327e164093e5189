"""Predictions of a fine-tuned model on the held-out splits of its task.

The fine-tune job runs this right after training, while the model is in memory, and writes one
bundle of predictions; the `evaluate` jobs then score each (eval task, split) with the official
metric (`vlbert_core.tasks.scoring`, torch-free), as an evaluation server scores a submission.
The eval tasks of each task, and the format of its prediction rows, are the task's own
(`vlbert_core.tasks.registry`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Mapping

import torch
from vlbert_core.progress import Progress

from vlbert_core.images import DEFAULT_MAX_PIXELS
from vlbert_core.models.common.bert_init import load_tokenizer
from vlbert_core.models.common.config import ModelSettings, visual_pixel_format
from vlbert_core.utils import atomic_path, get_logger, seed_everything

from .finetune import FinetuneModel, load_finetuned, read_task_rois
from .registry import task_of_eval
from .samples import ImageLoader, Tokens, iterate_batches

log = get_logger(__name__)


def predict_batches(model: FinetuneModel, data, batch_size: int, device: str, desc: str):
    """Yield (indices, scores dict on CPU, extras) batch by batch, without gradients."""
    model.eval()
    with torch.no_grad():
        batches = iterate_batches(data, batch_size, shuffle=False)
        for indices, batch, extras in Progress(batches, total=-(-len(data) // batch_size), desc=desc,
                                           mininterval=5.0):
            out = model.scores(batch.to(device), extras)
            yield indices, {k: v.float().cpu() for k, v in out.items()}, extras


def _write_json(path: Path, payload: Any) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(payload, indent=1) + "\n")


def predict_splits(model_dir: str | os.PathLike, targets: list[tuple[str, str]], *,
                   sources: Mapping[str, str], model_cfg: ModelSettings | Mapping[str, Any],
                   rois_paths: list[str] | tuple = (), seed: int = 0, device: str = "cpu",
                   max_image_pixels: int = DEFAULT_MAX_PIXELS) -> dict:
    """Predictions of the fine-tuned model on every (eval task, split) target; `max_image_pixels` (the config's
    top-level key) caps the images read, as in `finetune`.

    Returns {"<eval task>/<split>": rows}; the rows carry no labels, so the metrics
    (`vlbert_core.tasks.scoring`) read the ground truth from the official files themselves.
    """
    seed_everything(seed)
    model, meta = load_finetuned(model_dir)
    model.to(device)
    for eval_task, _ in targets:
        owner = task_of_eval(eval_task)
        if eval_task not in owner.eval_task_names():
            raise ValueError(f"eval task {eval_task} is not predicted by a fine-tune; its "
                             f"workflow script derives it from other eval tasks")
        if owner.name != meta["name"]:
            raise ValueError(f"eval task {eval_task} needs a {owner.name} "
                             f"model; {model_dir} was fine-tuned on {meta['name']}")
    tokens = Tokens(load_tokenizer(model.encoder.config.bert_path))
    sizes = ModelSettings.of(model_cfg)
    images = ImageLoader(sizes.image_max_side, pixel_format=visual_pixel_format(model.encoder.config),
                         min_side=sizes.image_min_side, max_pixels=max_image_pixels)
    rois, rois_source = read_task_rois(list(rois_paths))
    batch_size = int(meta["batch_size"])
    task = model.task
    bundle = {}
    for eval_task, split in targets:
        data = task.build_data(split, meta, sources=sources, tokens=tokens, images=images,
                               max_rois=sizes.max_rois, max_text_len=int(meta["max_text_len"]),
                               rois=rois, rois_source=rois_source, eval_task=eval_task)
        if len(data) == 0:
            raise ValueError(f"{eval_task} split {split}: no examples to predict")
        rows = []
        for indices, out, extras in predict_batches(model, data, batch_size, device, f"predict {eval_task}"):
            rows.extend(task.prediction_rows(model, data, indices, out, extras, meta, eval_task))
        bundle[f"{eval_task}/{split}"] = rows
        log.info("%s %s: %d predictions", eval_task, split, len(rows))
    return bundle


def write_prediction_bundle(bundle: dict, path: str | os.PathLike, *, model_dir: str | os.PathLike) -> None:
    _write_json(Path(path), {"model_dir": str(model_dir), "predictions": bundle})
