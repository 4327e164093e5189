"""Feed the authors' ViLBERT (facebookresearch/vilbert-multi-task) region inputs made by their own feature reader,
and save its per-stage outputs: the other half of `python -m vlbert_core.convert.vilbert.pipeline_check`.

A standalone script for the authors' environment (torch, numpy, and lmdb and h5py, which their reader imports;
never this package). It takes given
detections of each image (boxes in the image's own pixels and one 2048-d feature each, the features this
project's visual network computed for them), writes them into an LMDB laid out as the authors' feature files
are (a pickled "keys" list, and per image a pickled dict of image_id, image_h, image_w, features, boxes), and
reads them back with their ImageFeaturesH5Reader (vilbert/datasets/_image_features_reader.py, loaded from its
file): that is where row 0, the mean of the detections at location (0, 0, 1, 1, 1), and the locations (corners
divided by the image size, area as the 5th coordinate) are made. The rows are then padded as their datasets
pad them (region mask 1 on the real rows) and run through their BertForMultiModalPreTraining by
authors_runner.py (its stand-ins, its per-stage outputs).

With ground-truth boxes too (--detections holding gt_*), the rows are merged as their VCR dataset merges the
detected and the ground-truth feature files (vilbert/datasets/vcr_dataset.py __getitem__): row 0 is the two
files' row 0 weighted by each file's row count (the reader's count, which includes row 0), the ground-truth
file's row 0 is dropped, and its boxes follow the detections.

    PY vlbert_core/convert/vilbert/authors_reader_runner.py --authors-repo vilbert-multi-task --config c.json \
        --checkpoint pretrained_model.bin --detections det.npz --inputs text.npz --out out.npz

--detections (.npz): image_w, image_h [N]; det_boxes [N, D, 4], det_features [N, D, 2048], det_count [N]
(optionally gt_boxes, gt_features, gt_count alike). --inputs (.npz): the text of each row (input_ids,
token_type_ids, text_mask, mlm_positions, as authors_runner.py reads them). Outputs: authors_runner.py's stages,
and region_features / region_locations, the visual stream's input at the real rows.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import pickle
import sys
import tempfile

import numpy as np
import torch

FEATURE_WIDTH = 2048          # the authors' readers reshape every feature file to rows of 2048
MAX_REGION_NUM = 101          # their configs' max_region_num; the reference images have far fewer rows


def _load_file(name: str, path: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


RUNNER = _load_file("_vilbert_authors_runner", os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                           "authors_runner.py"))


def write_feature_lmdb(path: str, image_ids: list[str], widths, heights, boxes, features, counts) -> None:
    """One LMDB in the authors' feature-file layout, image i under image_ids[i] with its first counts[i] rows."""
    import lmdb

    env = lmdb.open(path, map_size=1 << 28)
    with env.begin(write=True) as txn:
        for i, image_id in enumerate(image_ids):
            n = int(counts[i])
            item = {"image_id": image_id, "image_h": int(heights[i]), "image_w": int(widths[i]),
                    "features": np.ascontiguousarray(features[i, :n], dtype=np.float32),
                    "boxes": np.ascontiguousarray(boxes[i, :n], dtype=np.float32)}
            txn.put(image_id.encode(), pickle.dumps(item))
        txn.put(b"keys", pickle.dumps([image_id.encode() for image_id in image_ids]))
    env.close()


def merged_vcr_rows(det, gt):
    """Their VCR dataset's merge of one image's detected and ground-truth reader outputs (features, count,
    locations, each count incl. row 0), before padding: row 0 weighted by the counts, the ground truth's row 0
    dropped, detections first."""
    features, num_boxes, boxes = det[0].copy(), int(det[1]), det[2]
    gt_features, gt_num_boxes, gt_boxes = gt[0], int(gt[1]), gt[2]
    features[0] = (features[0] * num_boxes + gt_features[0] * gt_num_boxes) / (num_boxes + gt_num_boxes)
    gt_keep = min(MAX_REGION_NUM - 1, gt_num_boxes - 1)
    det_keep = min(MAX_REGION_NUM - gt_keep, num_boxes)
    return (np.concatenate([features[:det_keep], gt_features[1:1 + gt_keep]]),
            np.concatenate([boxes[:det_keep], gt_boxes[1:1 + gt_keep]]))


def reader_rows(repo: str, detections: dict, workdir: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(features [N, R, 2048], locations [N, R, 5], region mask [N, R]) of the images as their reader and
    their datasets' padding give them, R the most rows of any image."""
    reader_module = _load_file("_vilbert_image_features_reader",
                               os.path.join(repo, "vilbert", "datasets", "_image_features_reader.py"))
    image_ids = [f"image_{i}" for i in range(len(detections["image_w"]))]
    sources = ["det"] + (["gt"] if "gt_boxes" in detections else [])
    readers = {}
    for source in sources:
        path = os.path.join(workdir, f"{source}.lmdb")
        write_feature_lmdb(path, image_ids, detections["image_w"], detections["image_h"], detections[f"{source}_boxes"],
                           detections[f"{source}_features"], detections[f"{source}_count"])
        readers[source] = reader_module.ImageFeaturesH5Reader(path, in_memory=False)
    rows = []
    for image_id in image_ids:
        features, num_boxes, locations, _ = readers["det"][image_id]
        if "gt" in readers:
            features, locations = merged_vcr_rows((features, num_boxes, locations), readers["gt"][image_id])
        else:   # their pre-training and VQA datasets: the first min(num_boxes, max_region_num) rows
            keep = min(int(num_boxes), MAX_REGION_NUM)
            features, locations = features[:keep], locations[:keep]
        rows.append((np.asarray(features, dtype=np.float32), np.asarray(locations, dtype=np.float32)))
    width = max(len(f) for f, _ in rows)
    features = np.zeros((len(rows), width, FEATURE_WIDTH), dtype=np.float32)
    locations = np.zeros((len(rows), width, 5), dtype=np.float32)
    mask = np.zeros((len(rows), width), dtype=np.int64)
    for i, (f, loc) in enumerate(rows):
        features[i, : len(f)], locations[i, : len(f)], mask[i, : len(f)] = f, loc, 1
    return features, locations, mask


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--authors-repo", required=True, help="a checkout of facebookresearch/vilbert-multi-task")
    parser.add_argument("--config", required=True, help="a config file of theirs (v_feature_size 2048)")
    parser.add_argument("--checkpoint", required=True, help="the state dict (pretrained_model.bin or a stand-in)")
    parser.add_argument("--detections", required=True, help="the images' detections and features (.npz)")
    parser.add_argument("--inputs", required=True, help="the rows' text (.npz)")
    parser.add_argument("--out", required=True, help="where the per-stage outputs go (.npz)")
    args = parser.parse_args(argv)
    repo = os.path.abspath(args.authors_repo)
    RUNNER.install_stand_ins(repo)
    torch.set_grad_enabled(False)
    model = RUNNER.build_model(args.config)
    model.load_state_dict(torch.load(args.checkpoint, map_location="cpu", weights_only=True), strict=True)
    model.float().eval()
    with np.load(args.detections, allow_pickle=False) as data:
        detections = {k: data[k] for k in data.files}
    with np.load(args.inputs, allow_pickle=False) as data:
        inputs = {k: data[k] for k in data.files}
    if detections["det_features"].shape[-1] != FEATURE_WIDTH:
        raise SystemExit(f"their feature readers take {FEATURE_WIDTH}-d features, got "
                         f"{detections['det_features'].shape[-1]}")
    with tempfile.TemporaryDirectory() as workdir:
        features, locations, mask = reader_rows(repo, detections, workdir)
    inputs.update(features=features, locations=locations, region_mask=mask)
    result = RUNNER.run(model, inputs)
    real = mask.astype(bool)
    result.update(region_features=features[real], region_locations=locations[real])
    tmp = args.out + ".tmp"
    with open(tmp, "wb") as f:
        np.savez_compressed(f, **result)
    os.replace(tmp, args.out)
    print(f"vilbert authors_reader_runner: {len(result)} stages -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
