"""python -m vlbert_core.convert.vilbert.pipeline_check --authors-repo DIR [--authors-python PY] [--golden-out DIR]

Does a converted ViLBERT, fed what this pipeline makes of an image, compute what the authors' released models
compute on the same features? Our side runs the pipeline's own input construction: the images written as files
and read by the task image loader (resized to the model's sizes), the detector's boxes scaled with them and box
0 (the whole image) put first (tasks/samples.py image_and_boxes), the RoI features of our visual network, and
ViLBertModel.encode with `global_region: mean_of_regions`, as a converted released model is set. The authors'
side (authors_reader_runner.py, in their environment) takes the same RoI features of the detections with the
boxes in the original image's pixels, builds the visual rows with their own feature reader (row 0 the mean of
the detections at (0, 0, 1, 1, 1), corners divided by the image size, area 5th) and runs their model. Printed:
the largest difference at every stage, from the visual stream's input (region_features, region_locations) to
the heads' logits.

--vcr-form also checks the authors' VCR merge of detected and ground-truth boxes (vcr_dataset.py) against
mean_global_region's VCR form on the same images, with ground-truth boxes after the detections.

The model is a random stand-in of PIPELINE_CONFIG (the small golden config with the released 2048-d features:
their readers take no other width), converted by `convert vilbert`'s code; --golden-out writes the images,
boxes and the authors' outputs (tests/data/golden/vilbert-pipeline.*, compared by
tests/convert/test_golden_vilbert_pipeline.py).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import torch

from ..stages import compare_stages, load_arrays, report_stages, save_arrays
from .reference import SMALL_CONFIG, TOLERANCE, convert_stand_in, load_converted, our_stages

RUNNER = Path(__file__).with_name("authors_reader_runner.py")
PIPELINE_CONFIG: dict[str, Any] = {**SMALL_CONFIG, "v_feature_size": 2048}
IMAGE_SIZES = ((90, 60), (70, 100))        # (W, H): a landscape and a portrait image
DETECTIONS = (4, 2)                        # detector boxes per image (box 0 comes on top)
GROUND_TRUTH = (2, 3)                      # --vcr-form: ground-truth boxes per image, after the detections
IMAGE_MIN_SIDE, IMAGE_MAX_SIDE = 96, 160   # the task image loader's sizes: both images are resized
CLS_ID, SEP_ID, PAD_ID = 1, 2, 0           # word ids of the stand-in's 64-word vocabulary
TEXT_LENGTHS = (5, 3)                      # words of each row's sentence, [CLS] and [SEP] not counted
FILES = {"inputs": "vilbert-pipeline.inputs.npz", "authors": "vilbert-pipeline.authors.npz",
         "authors_vcr": "vilbert-pipeline.authors-vcr.npz", "record": "vilbert-pipeline.json"}


# ---- the images, their boxes and the text ------------------------------------------------------------------

def _boxes(rng: np.random.Generator, count: int, w: int, h: int) -> np.ndarray:
    x1, y1 = rng.uniform(0, 0.5 * w, count), rng.uniform(0, 0.5 * h, count)
    x2, y2 = rng.uniform(x1 + 6, w - 1), rng.uniform(y1 + 6, h - 1)
    return np.stack([x1, y1, x2, y2], 1).astype(np.float32)


def reference_images(seed: int = 0) -> dict[str, np.ndarray]:
    """Two uint8 images of different sizes and orientations, each with detector boxes and ground-truth boxes in
    its own pixels (padded rows are zeros past the counts), and a sentence per image."""
    rng = np.random.default_rng([seed, 55])
    num = len(IMAGE_SIZES)
    max_w, max_h = max(w for w, _ in IMAGE_SIZES), max(h for _, h in IMAGE_SIZES)
    out = {"images": np.zeros((num, max_h, max_w, 3), dtype=np.uint8),
           "image_w": np.array([w for w, _ in IMAGE_SIZES]), "image_h": np.array([h for _, h in IMAGE_SIZES]),
           "det_count": np.array(DETECTIONS), "gt_count": np.array(GROUND_TRUTH),
           "det_boxes": np.zeros((num, max(DETECTIONS), 4), dtype=np.float32),
           "gt_boxes": np.zeros((num, max(GROUND_TRUTH), 4), dtype=np.float32),
           "words": np.zeros((num, max(TEXT_LENGTHS)), dtype=np.int64)}
    for i, (w, h) in enumerate(IMAGE_SIZES):
        yy, xx = np.mgrid[0:h, 0:w]
        base = np.stack([np.sin(xx / (6.0 + 2 * c) + yy / (4.0 + c) + rng.uniform(0, 6)) for c in range(3)], -1)
        out["images"][i, :h, :w] = np.clip(128 + 90 * base + rng.normal(0, 20, (h, w, 3)), 0, 255).astype(np.uint8)
        out["det_boxes"][i, : DETECTIONS[i]] = _boxes(rng, DETECTIONS[i], w, h)
        out["gt_boxes"][i, : GROUND_TRUTH[i]] = _boxes(rng, GROUND_TRUTH[i], w, h)
        out["words"][i, : TEXT_LENGTHS[i]] = rng.integers(3, PIPELINE_CONFIG["vocab_size"], TEXT_LENGTHS[i])
    return out


# ---- our side: the pipeline's inputs ------------------------------------------------------------------------------

def pipeline_batch(images: Mapping[str, np.ndarray], pixel_format: str, workdir: Path, with_ground_truth: bool):
    """The ModelBatch the task code makes of the images: each written as a PNG and read by the task image loader,
    its boxes (the detections, then with_ground_truth the ground-truth boxes) scaled with it and box 0 put
    first; [CLS] words [SEP] per image. Returns (batch, Bool [B, R] ground-truth box slots)."""
    from PIL import Image

    from vlbert_core.models.common.batch import collate_samples
    from vlbert_core.models.common.inputs import build_input_sequence
    from vlbert_core.tasks.samples import ImageLoader, image_and_boxes

    loader = ImageLoader(IMAGE_MAX_SIDE, pixel_format=pixel_format, min_side=IMAGE_MIN_SIDE)
    samples, kinds = [], []
    for i, (w, h) in enumerate(zip(images["image_w"], images["image_h"])):
        path = workdir / f"image_{i}.png"
        Image.fromarray(images["images"][i, :h, :w]).save(path)
        boxes = [images["det_boxes"][i, : images["det_count"][i]]]
        if with_ground_truth:
            boxes.append(images["gt_boxes"][i, : images["gt_count"][i]])
        boxes = np.concatenate(boxes)
        image, boxes_resized = image_and_boxes(loader, path, boxes, len(boxes) + 1, (int(w), int(h)), path.name)
        words = [int(v) for v in images["words"][i, : TEXT_LENGTHS[i]]]
        sequence = build_input_sequence(words, None, len(boxes_resized), cls_id=CLS_ID, sep_id=SEP_ID, pad_id=PAD_ID)
        samples.append({"sequence": sequence, "image": image, "boxes": boxes_resized})
        kinds.append([False] * (1 + int(images["det_count"][i])) + [True] * (len(boxes) - int(images["det_count"][i])))
    batch = collate_samples(samples)
    ground_truth = torch.zeros_like(batch.box_valid)
    for i, row in enumerate(kinds):
        ground_truth[i, : len(row)] = torch.tensor(row)
    return batch, ground_truth


def our_pipeline_stages(model, heads, batch, ground_truth: torch.Tensor | None = None) -> tuple[dict, dict]:
    """(stages, detections) of the converted model on the pipeline's batch. Without `ground_truth` the model's
    own encode makes the visual rows (its global_region); with it, mean_global_region's VCR form does. The stages
    are reference.our_stages' on the rows the model fed its streams, plus those rows (region_features,
    region_locations); detections are the RoI features the authors' side is given (boxes 1.. of each image)."""
    from vlbert_core.models.vilbert.embeddings import region_locations
    from vlbert_core.models.vilbert.model import mean_global_region, text_stream

    model.eval()
    heads.eval()
    fed: dict[str, torch.Tensor] = {}
    original = model.forward_streams

    def keep_inputs(input_ids, token_type_ids, text_mask, features, locations, region_mask, task_ids=None):
        # the pre-trained layout this check compares has no task tokens
        if task_ids is not None:
            raise ValueError("pipeline_check compares the pre-trained layout; this model has task tokens")
        fed.update(input_ids=input_ids, token_type_ids=token_type_ids, text_mask=text_mask, features=features,
                   locations=locations, region_mask=region_mask)
        return original(input_ids, token_type_ids, text_mask, features, locations, region_mask)

    with torch.no_grad():
        roi_features = model.visual_features(batch)
        if ground_truth is None:
            model.forward_streams = keep_inputs
            try:
                model.encode(batch, roi_features=roi_features)
            finally:
                del model.forward_streams
        else:
            input_ids, token_types, text_mask = text_stream(batch, model.config.type_vocab_size)
            features, locations = mean_global_region(roi_features, region_locations(batch.boxes, batch.image_size),
                                                     batch.box_valid, ground_truth)
            keep_inputs(input_ids, token_types, text_mask, features, locations, batch.box_valid)
    inputs = {name: value.numpy() for name, value in fed.items()}
    inputs["mlm_positions"] = mlm_positions(inputs["text_mask"])
    stages = our_stages(model, heads, inputs)
    real = inputs["region_mask"].astype(bool)
    stages.update(region_features=inputs["features"][real], region_locations=inputs["locations"][real])
    text = {k: inputs[k] for k in ("input_ids", "token_type_ids", "text_mask", "mlm_positions")}
    return stages, {"text": text, "roi_features": roi_features.numpy()}


def mlm_positions(text_mask: np.ndarray) -> np.ndarray:
    """The words whose MLM logits are compared: the first word after [CLS] of every row."""
    positions = np.zeros(text_mask.shape, dtype=bool)
    positions[:, 1] = True
    return positions


def detections_for_authors(images: Mapping[str, np.ndarray], roi_features: np.ndarray,
                           with_ground_truth: bool) -> dict[str, np.ndarray]:
    """The authors' side's input: per image its boxes in its own pixels and their RoI features, our visual
    network's at box slots 1.. of the pipeline's batch (the detections, then with_ground_truth the ground-truth
    boxes, as pipeline_batch lays them out)."""
    out = {"image_w": images["image_w"], "image_h": images["image_h"]}
    for kind in ["det"] + (["gt"] if with_ground_truth else []):
        count, boxes = images[f"{kind}_count"], images[f"{kind}_boxes"]
        features = np.zeros((len(roi_features), boxes.shape[1], roi_features.shape[2]), dtype=np.float32)
        for i, n in enumerate(count):
            first = 1 if kind == "det" else 1 + int(images["det_count"][i])
            features[i, :n] = roi_features[i, first: first + n]
        out.update({f"{kind}_boxes": boxes, f"{kind}_count": count, f"{kind}_features": features})
    return out


# ---- the comparison ---------------------------------------------------------------------------------------------

def run_authors(args, config_file: Path, checkpoint: Path, detections: dict, text: dict,
                out_path: Path) -> dict[str, np.ndarray]:
    save_arrays(detections, out_path.with_suffix(".detections.npz"))
    save_arrays(text, out_path.with_suffix(".text.npz"))
    command = [str(args.authors_python), str(RUNNER), "--authors-repo", str(args.authors_repo), "--config",
               str(config_file), "--checkpoint", str(checkpoint), "--detections",
               str(out_path.with_suffix(".detections.npz")), "--inputs", str(out_path.with_suffix(".text.npz")),
               "--out", str(out_path)]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"the authors' model failed ({' '.join(command)}):\n{result.stderr[-4000:]}")
    return load_arrays(out_path)


def ours_on(converted: Path, images: Mapping[str, np.ndarray], workdir: Path, vcr_form: bool):
    """Our stages and the authors' side's inputs, for the converted model directory."""
    from vlbert_core.models.common.config import visual_pixel_format

    model, heads = load_converted(converted)
    batch, ground_truth = pipeline_batch(images, visual_pixel_format(model.config), workdir, vcr_form)
    return our_pipeline_stages(model, heads, batch, ground_truth if vcr_form else None)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m vlbert_core.convert.vilbert.pipeline_check", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--authors-repo", required=True, type=Path,
                        help="a checkout of facebookresearch/vilbert-multi-task")
    parser.add_argument("--authors-python", default=sys.executable,
                        help="the Python of an environment with torch, numpy, lmdb and h5py that runs their code "
                             "(default: this one)")
    parser.add_argument("--vcr-form", action="store_true",
                        help="also check the VCR merge of detected and ground-truth boxes")
    parser.add_argument("--seed", type=int, default=0, help="of the stand-in's values and of the images")
    parser.add_argument("--workdir", type=Path, default=None, help="keep the intermediate files here")
    parser.add_argument("--golden-out", type=Path, default=None, help="write the golden files into this directory")
    parser.add_argument("--json", type=Path, default=None, help="write the comparison rows as JSON")
    return parser


def verify(args) -> dict[str, list[dict]]:
    """{"plain": rows[, "vcr": rows]}: the per-stage comparison of each form."""
    forms = ["plain"] + (["vcr"] if args.vcr_form else [])
    results, authors = {}, {}
    images = reference_images(args.seed)
    with tempfile.TemporaryDirectory() as scratch:
        workdir = args.workdir or Path(scratch)
        workdir.mkdir(parents=True, exist_ok=True)
        checkpoint, config_file, converted = convert_stand_in(PIPELINE_CONFIG, args.seed, workdir / "model")
        for form in forms:
            vcr_form = form == "vcr"
            ours, given = ours_on(converted, images, workdir, vcr_form)
            detections = detections_for_authors(images, given["roi_features"], vcr_form)
            theirs = run_authors(args, config_file, checkpoint, detections, given["text"],
                                 workdir / f"authors-{form}.npz")
            missing = sorted(set(theirs) ^ set(ours))
            if missing:
                raise SystemExit(f"stages only one side has: {missing}")
            results[form], authors[form] = compare_stages(ours, theirs), theirs
        if args.golden_out is not None:
            args.golden_out.mkdir(parents=True, exist_ok=True)
            save_arrays(images, args.golden_out / FILES["inputs"])
            save_arrays(authors["plain"], args.golden_out / FILES["authors"])
            if "vcr" in authors:
                save_arrays(authors["vcr"], args.golden_out / FILES["authors_vcr"])
            record = {"config": PIPELINE_CONFIG, "seed": args.seed, "tolerance": TOLERANCE,
                      "largest_differences": {form: {r["stage"]: r["max_abs_diff"] for r in rows}
                                              for form, rows in results.items()}}
            (args.golden_out / FILES["record"]).write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    return results


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    results = verify(args)
    status = 0
    for form, rows in results.items():
        what = "VCR merge of detections and ground truth" if form == "vcr" else "detections"
        title = (f"ViLBERT on the pipeline's inputs ({what}), ours vs the authors' reader and model, fp32 on "
                 f"{os.cpu_count()} CPU cores")
        json_path = None if args.json is None else args.json.with_suffix(f".{form}.json")
        status |= report_stages(rows, title, TOLERANCE, json_path)
    return status


if __name__ == "__main__":
    from vlbert_core.cli import run_command

    sys.exit(run_command(main, "python -m vlbert_core.convert.vilbert.pipeline_check"))
