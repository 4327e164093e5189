"""Checking a converted VL-BERT against the authors' own code: one fixed small batch per released layout,
stand-in checkpoints with trained-like values, and this project's per-stage outputs on that batch.

`python -m vlbert_core.convert.verify` (verify.py) runs the authors' model on the same batch in their own
environment (authors_runner.py) and prints the largest difference stage by stage; tests/data/golden/ keeps a
few of the authors' numbers per stage, which tests/convert/test_golden_released.py compares with ours.

The batch of every layout is drawn from a seed and kept as plain arrays (`reference_inputs`), in the authors'
conventions (their datasets' output): boxes are pixel indices with box 0 = [0, 0, W - 1, H - 1]; token ids
of bert-base-uncased's vocabulary; a masked RoI zeroes its pixels (e2e) or has its feature replaced (prec).
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import torch

from ..manifest import Manifest, stand_in_tensors, write_stand_in
from ..released_heads import CANDIDATE_INPUTS, LAYOUTS, PRETRAINING_INPUTS, SENTENCE_INPUTS, ReleasedLayout
from ..stand_in import alias_overrides

# bert-base-uncased ids of the special tokens (its vocab.txt)
PAD_ID, CLS_ID, SEP_ID, MASK_ID = 0, 101, 102, 103
FIRST_WORD_ID = 1996            # "the": ordinary word pieces are drawn from here on
NUM_REGION_CLASSES = 1601       # released visual_region_classes
APPEARANCE_DIM = 2048
IMAGE_SIZES = ((112, 80), (96, 64))   # (W, H) of the two images: different, so padding and im_info matter
BOXES_PER_IMAGE = (5, 4)               # incl. box 0
NUM_CANDIDATES = 4                     # candidate answers per image (CANDIDATE_INPUTS)


# ---- stand-in checkpoints with trained-like values ----------------------------------------------------------

_LAYER_NORM_WEIGHT = re.compile(r"(LayerNorm|visual_ln_text|visual_ln_object)\.weight$")
_BN = re.compile(r"\.(bn(\d)|downsample\.1)\.(weight|bias|running_mean|running_var)$")


def trained_like_arrays(manifest: Manifest, seed: int) -> dict[str, np.ndarray]:
    """Random values (manifest.stand_in_tensors) rescaled so that every stage of the model carries signal, as
    in a trained model, instead of shrinking it away: LayerNorm scales (the visual ones included, so the visual
    term counts) near 1; convolutions He-scaled; BatchNorm near identity, with the last BatchNorm of each
    residual branch at 0.1 and of each shortcut at 0.5, so that 33 bottlenecks keep the RoI features in the
    range of a trained detector's (tens) instead of blowing them up. Deterministic in `seed`."""
    arrays = stand_in_tensors(manifest, seed)
    out = {}
    for key, value in arrays.items():
        if value.dtype.kind != "f":
            out[key] = value
            continue
        v = value.astype(np.float32)
        bn = _BN.search(key)
        if _LAYER_NORM_WEIGHT.search(key):
            v = 1.0 + v
        elif bn is not None:
            which, kind = bn.group(1), bn.group(3)
            if kind == "weight":
                v = {"bn3": 0.1, "downsample.1": 0.5}.get(which, 1.0) + v
            elif kind == "running_var":
                v = 1.0 + np.abs(v)
        elif v.ndim == 4:
            fan_in = v.shape[1] * v.shape[2] * v.shape[3]
            v = v / 0.05 * np.sqrt(2.0 / fan_in)
        out[key] = v.astype(value.dtype)
    out.update(alias_overrides(out))
    return out


def write_reference_checkpoint(manifest: Manifest, path: str | Path, seed: int) -> dict[str, np.ndarray]:
    """The stand-in of `manifest` with `trained_like_arrays` values, saved as the authors' trainer saves a
    checkpoint ({'state_dict' with 'module.' keys, 'optimizer', 'validation_monitor'}, the manifest's dtypes:
    float16 throughout for the fp16 configs)."""
    return write_stand_in(manifest, path, seed=seed, overrides=trained_like_arrays(manifest, seed))


# ---- the reference batch --------------------------------------------------------------------------------------

def _word_ids(rng: np.random.Generator, n: int) -> np.ndarray:
    return rng.integers(FIRST_WORD_ID, 29000, size=n)


def _images_and_boxes(rng: np.random.Generator, out: dict) -> None:
    """uint8 images and their boxes (box 0 = [0, 0, W - 1, H - 1]; some corners whole numbers, one box at the
    border), padded with -2 as the authors' collate pads boxes."""
    num = len(IMAGE_SIZES)
    max_w, max_h = max(w for w, _ in IMAGE_SIZES), max(h for _, h in IMAGE_SIZES)
    images = np.zeros((num, max_h, max_w, 3), dtype=np.uint8)
    boxes = np.full((num, max(BOXES_PER_IMAGE), 4), -2.0, dtype=np.float32)
    for i, ((w, h), n) in enumerate(zip(IMAGE_SIZES, BOXES_PER_IMAGE)):
        # smooth colour fields plus noise: neither constant nor white noise
        yy, xx = np.mgrid[0:h, 0:w]
        base = np.stack([np.sin(xx / (7.0 + 3 * c) + yy / (5.0 + c) + rng.uniform(0, 6)) for c in range(3)], -1)
        images[i, :h, :w] = np.clip(128 + 90 * base + rng.normal(0, 20, (h, w, 3)), 0, 255).astype(np.uint8)
        boxes[i, 0] = [0, 0, w - 1, h - 1]
        for b in range(1, n):
            x1, y1 = rng.uniform(0, w * 0.6), rng.uniform(0, h * 0.6)
            x2, y2 = rng.uniform(x1 + 8, w - 1), rng.uniform(y1 + 8, h - 1)
            boxes[i, b] = [x1, y1, x2, y2]
        boxes[i, 1, 2:] = np.floor(boxes[i, 1, 2:])       # whole-number corner: int(x2) is x2 itself
        boxes[i, n - 1, 2:] = [w - 1, h - 1]                 # a box touching the border
    out["images"] = images
    out["image_sizes"] = np.array(IMAGE_SIZES, dtype=np.int64)
    out["boxes"] = boxes
    out["num_boxes"] = np.array(BOXES_PER_IMAGE, dtype=np.int64)


def _padded(rows: list[np.ndarray], pad: int) -> np.ndarray:
    out = np.full((len(rows), max(len(r) for r in rows)), pad, dtype=np.int64)
    for i, r in enumerate(rows):
        out[i, : len(r)] = r
    return out


def _mask_words(rng: np.random.Generator, ids: np.ndarray, positions: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """[MASK] at `positions` (one of them a random word instead, as BERT's 10%), labels -1 elsewhere."""
    ids, labels = ids.copy(), np.full(len(ids), -1, dtype=np.int64)
    for k, p in enumerate(positions):
        labels[p] = ids[p]
        ids[p] = MASK_ID if k else _word_ids(rng, 1)[0]
    return ids, labels


def _precomputed_features(rng: np.random.Generator, out: dict, masked: np.ndarray | None) -> None:
    """Bottom-up-attention-like features (non-negative) of boxes 1.., and box 0's as the authors' datasets
    make it: the mean of the real boxes' features, leaving out the masked ones (conceptual_captions.py)."""
    num, rmax = out["boxes"].shape[:2]
    features = np.zeros((num, rmax, APPEARANCE_DIM), dtype=np.float32)
    for i, n in enumerate(out["num_boxes"]):
        real = (np.abs(rng.normal(0, 1, (n - 1, APPEARANCE_DIM))) * rng.uniform(0.5, 2, (n - 1, 1))).astype(np.float32)
        features[i, 1:n] = real
        keep = np.ones(n - 1, dtype=bool) if masked is None else ~masked[i, 1:n]
        features[i, 0] = (real * keep[:, None]).sum(0) / (keep.sum() + 1e-5)
    out["features"] = features


def _pretraining_batch(rng: np.random.Generator, out: dict, layout: ReleasedLayout) -> np.ndarray:
    """PRETRAINING_INPUTS: two <caption, image> rows ([CLS] words [SEP], as the authors' dataset gives them) and two
    text-only rows (word pieces alone, general_corpus.py), masked words and masked RoIs; returns the masked boxes."""
    captions, caption_labels = zip(*[
        _mask_words(rng, np.concatenate([[CLS_ID], _word_ids(rng, n), [SEP_ID]]), positions)
        for n, positions in ((9, [2, 5, 6]), (6, [1, 4]))])
    texts, text_labels = zip(*[_mask_words(rng, _word_ids(rng, n), positions)
                               for n, positions in ((14, [0, 3, 9]), (10, [2, 7]))])
    out["text"], out["mlm_labels"] = _padded(list(captions), PAD_ID), _padded(list(caption_labels), -1)
    out["aux_text"], out["aux_mlm_labels"] = _padded(list(texts), PAD_ID), _padded(list(text_labels), -1)
    # masked RoI classification: box 2 of image 0 and box 1 of image 1 masked; box 3 of image 0 chosen but
    # kept (the authors' 10%); the chosen boxes carry the detector's class distribution as their target
    ops = np.zeros(out["boxes"].shape[:2], dtype=np.int64)
    ops[0, 2], ops[1, 1] = 1, 1
    labels = np.zeros((*ops.shape, NUM_REGION_CLASSES), dtype=np.float32)
    for i, b in ((0, 2), (1, 1), (0, 3)):
        labels[i, b] = rng.dirichlet(np.full(NUM_REGION_CLASSES, 0.05)).astype(np.float32)
    labels /= np.maximum(labels.sum(-1, keepdims=True), 1e-12)
    out["mvrc_ops"], out["mvrc_labels"] = ops, labels
    return ops.astype(bool)


def _sentence_batch(rng: np.random.Generator, out: dict, layout: ReleasedLayout) -> None:
    """SENTENCE_INPUTS: one sentence per image, under the layout's `sentence`."""
    out[layout.sentence] = _padded([_word_ids(rng, n) for n in layout.sentence_lengths], PAD_ID)


def _candidates_batch(rng: np.random.Generator, out: dict, layout: ReleasedLayout) -> None:
    """CANDIDATE_INPUTS: one question per image and its NUM_CANDIDATES answers; a word's tag is the box it refers
    to: 0 (the whole image) for a plain word, i + 1 for object i, as the authors' vcr.py tags them with the image
    added as box 0; an object class per box (box 0: the image, class 0) and its 14 x 14 segmentation mask."""
    questions, question_tags, answers, answer_tags = [], [], [], []
    for i, n in enumerate(out["num_boxes"]):
        q = _word_ids(rng, 7 - i)
        questions.append(q)
        question_tags.append(np.where(np.arange(len(q)) == 2, 1, 0))
        cands = [_word_ids(rng, k) for k in (3, 5, 4, 2)]
        answers.append(_padded(cands, PAD_ID))
        answer_tags.append(_padded([np.where(np.arange(len(c)) == 1, n - 1, 0) for c in cands], 0))
    out["question"], out["question_tags"] = _padded(questions, PAD_ID), _padded(question_tags, 0)
    width = max(a.shape[1] for a in answers)
    out["answers"] = np.stack([np.pad(a, ((0, 0), (0, width - a.shape[1]))) for a in answers])
    out["answer_tags"] = np.stack([np.pad(t, ((0, 0), (0, width - t.shape[1]))) for t in answer_tags])
    out["box_classes"] = rng.integers(1, 81, size=out["boxes"].shape[:2]).astype(np.int64)
    out["box_classes"][:, 0] = 0
    masks = (rng.uniform(size=(*out["boxes"].shape[:2], 14, 14)) < 0.7).astype(np.float32)
    masks[:, 0] = 1.0
    out["instance_masks"] = masks


# ReleasedLayout.inputs -> what the batch holds besides the images and boxes (returns the masked boxes, if any)
_BATCHES = {PRETRAINING_INPUTS: _pretraining_batch, SENTENCE_INPUTS: _sentence_batch,
            CANDIDATE_INPUTS: _candidates_batch}


def reference_inputs(layout: ReleasedLayout, seed: int = 0) -> dict[str, np.ndarray]:
    """The fixed batch of `layout` as plain arrays (see the module docstring for the conventions)."""
    rng = np.random.default_rng([seed, list(LAYOUTS).index(layout.name)])
    out: dict[str, np.ndarray] = {}
    _images_and_boxes(rng, out)
    masked = _BATCHES[layout.inputs](rng, out, layout)
    if layout.precomputed:
        _precomputed_features(rng, out, masked)
    return out


def to_torch(array: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(array))


# ---- this project's outputs on the reference batch -------------------------------------------------------------

def normalised_images(inputs: dict[str, np.ndarray], pixel_format: str) -> np.ndarray:
    """Float [N, 3, H, W] images as the visual network takes them (zero-padded): what both models are given."""
    from PIL import Image

    from vlbert_core.models.common.batch import image_to_tensor

    images, sizes = inputs["images"], inputs["image_sizes"]
    out = np.zeros((images.shape[0], 3, images.shape[1], images.shape[2]), dtype=np.float32)
    for i, (w, h) in enumerate(sizes):
        out[i, :, :h, :w] = image_to_tensor(Image.fromarray(images[i, :h, :w]), pixel_format).numpy()
    return out


class _StageRecorder:
    """Forward hooks that keep the output of the embeddings, of each encoder layer, of the visual network and
    of the visual feature embedding (the last call of each)."""

    def __init__(self, vlbert):
        self.outputs: dict[str, torch.Tensor] = {}
        modules = {"embeddings": vlbert.embeddings.layer_norm, "visual_embedding": vlbert.embeddings.visual_feature,
                   "appearance": vlbert.visual_network}
        modules.update({f"layer_{i:02d}": layer for i, layer in enumerate(vlbert.encoder.layers)})
        self.handles = [module.register_forward_hook(self._keep(name)) for name, module in modules.items()]

    def _keep(self, name: str):
        def hook(module, args, output):
            self.outputs[name] = output.detach()
        return hook

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()


def _real_positions(stage: torch.Tensor, attention_mask: torch.Tensor) -> np.ndarray:
    """[B, L, H] -> [real elements of all rows, row by row, H]; an encoder layer's output is that already
    (models/common/encoder.py PackedLayout)."""
    return (stage if stage.dim() == 2 else stage[attention_mask]).numpy()


def _boxes_of(stage: torch.Tensor, box_valid: torch.Tensor) -> np.ndarray:
    return stage[box_valid].numpy()


def _image_samples(inputs: dict[str, np.ndarray], images: np.ndarray) -> list[dict]:
    samples = []
    for i, ((w, h), n) in enumerate(zip(inputs["image_sizes"], inputs["num_boxes"])):
        samples.append({"image": torch.from_numpy(images[i, :, :h, :w].copy()),
                        "boxes": to_torch(inputs["boxes"][i, :n])})
    return samples


def _sequence(ids_a, ids_b, num_rois, **kwargs):
    from vlbert_core.models.common.inputs import build_input_sequence

    return build_input_sequence([int(i) for i in ids_a], None if ids_b is None else [int(i) for i in ids_b], num_rois,
                                cls_id=CLS_ID, sep_id=SEP_ID, pad_id=PAD_ID, **kwargs)


def _nonzero(row: np.ndarray) -> np.ndarray:
    return row[row > 0]


def pretrain_samples(inputs: dict[str, np.ndarray], image_samples: list[dict], text_only_layout: str) -> list[dict]:
    """The pre-training samples (pretrain.data's, for collate_pretrain) of a batch in the authors' arrays: one
    <caption, image> sample per image (`image_samples`: its normalised image and boxes), then one <text, ∅>
    sample per text-only row, with the arrays' masked words, masked RoIs and their labels."""
    from vlbert_core.models.common.inputs import IGNORE_INDEX

    samples = []
    for i, sample in enumerate(image_samples):
        text = _nonzero(inputs["text"][i])
        n = int(inputs["num_boxes"][i])
        labels = inputs["mlm_labels"][i, : len(text)]
        samples.append({**sample, "sequence": _sequence(text[1:-1], None, n),
                        "roi_masked": to_torch(inputs["mvrc_ops"][i, :n] == 1),
                        "roi_selected": to_torch(inputs["mvrc_labels"][i, :n].sum(-1) > 0),
                        "roi_labels": to_torch(inputs["mvrc_labels"][i, :n]),
                        "mlm_labels": [int(v) if v >= 0 else IGNORE_INDEX for v in labels] + [IGNORE_INDEX] * (n + 1),
                        "relationship": IGNORE_INDEX})
    for j in range(inputs["aux_text"].shape[0]):
        text = _nonzero(inputs["aux_text"][j])
        seq = _sequence(text, None, None, text_only_layout=text_only_layout)
        labels = [int(v) if v >= 0 else IGNORE_INDEX for v in inputs["aux_mlm_labels"][j, : len(text)]]
        samples.append({"sequence": seq, "mlm_labels": seq.word_labels(labels), "relationship": IGNORE_INDEX})
    return samples


def pretrain_batch(inputs: dict[str, np.ndarray], config):
    """The collated pre-training batch (pretrain.data.PretrainBatch) of a batch in the authors' arrays, for a model
    of VLBertConfig `config`: what this project's pre-training step takes where the authors' takes the arrays."""
    from vlbert_core.models.common.config import visual_pixel_format
    from vlbert_core.pretrain.data import collate_pretrain

    images = normalised_images(inputs, visual_pixel_format(config))
    return collate_pretrain(pretrain_samples(inputs, _image_samples(inputs, images), config.text_only_layout))


def _sentence_samples(layout: ReleasedLayout, inputs: dict[str, np.ndarray], image_samples: list[dict]) -> list[dict]:
    """SENTENCE_INPUTS: <sentence, image> ([CLS] sentence [SEP]), with VQA's [MASK] as sentence B."""
    answer = [MASK_ID] if layout.answer_slot else None
    return [{**s, "sequence": _sequence(_nonzero(inputs[layout.sentence][i]), answer, int(inputs["num_boxes"][i]))}
            for i, s in enumerate(image_samples)]


def _candidate_samples(inputs: dict[str, np.ndarray], image_samples: list[dict]) -> list[dict]:
    """CANDIDATE_INPUTS: [CLS] question [SEP] answer [SEP] for each candidate of each image, a tagged word taking
    its box's visual feature, with the image's instance masks."""
    samples = []
    for i, s in enumerate(image_samples):
        n = int(inputs["num_boxes"][i])
        question = _nonzero(inputs["question"][i])
        q_tags = inputs["question_tags"][i, : len(question)]
        for k in range(NUM_CANDIDATES):
            answer = _nonzero(inputs["answers"][i, k])
            a_tags = inputs["answer_tags"][i, k, : len(answer)]
            seq = _sequence(question, answer, n)
            tags = [0, *q_tags, 0, *a_tags, 0]
            seq.roi_index[: len(tags)] = [int(t) for t in tags]
            samples.append({**s, "sequence": seq, "instance_masks": to_torch(inputs["instance_masks"][i, :n])})
    return samples


def _box_prediction(layout: ReleasedLayout, scores: torch.Tensor, batch) -> dict[str, np.ndarray]:
    """The RefCOCO+ prediction as the task's evaluation makes it: the argmax over the candidate boxes
    (tasks/modeling/refcoco.py candidate_boxes: box 0 with the layout's whole_image_candidate), and that box.
    The reference images are at their own size, so the box in the batch's pixels is the box in the image's."""
    from vlbert_core.tasks.modeling.refcoco import RefCOCOHead, candidate_boxes

    candidate = torch.zeros_like(batch.box_valid)
    for row, valid in enumerate(batch.box_valid):
        n = int(valid.sum())
        candidate[row, :n] = candidate_boxes(n, layout.whole_image_candidate)
    chosen = RefCOCOHead.predict(scores, candidate)
    return {"predicted_index": chosen.numpy(),
            "predicted_box": batch.boxes[torch.arange(len(chosen)), chosen].numpy()}


@torch.no_grad()
def our_outputs(layout: ReleasedLayout, model_dir: str | Path, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """This project's per-stage outputs on the reference batch, from the converted model directory `model_dir`:
    embeddings and every encoder layer at the real elements, the RoI features and their visual embedding, and
    the logits of the layout's heads (and the pre-training losses)."""
    from vlbert_core.models.common.batch import collate_samples
    from vlbert_core.models.common.config import visual_pixel_format
    from vlbert_core.models.common.inputs import IGNORE_INDEX, IMG
    from vlbert_core.models.vlbert.model import VLBertModel

    if layout.pretrained:
        vlbert = VLBertModel.from_pretrained(model_dir).eval()
        finetuned = None
    else:
        from vlbert_core.tasks.finetune import load_finetuned

        finetuned, _ = load_finetuned(model_dir)
        vlbert = finetuned.encoder
    images = normalised_images(inputs, visual_pixel_format(vlbert.config))
    image_samples = _image_samples(inputs, images)
    features = None if not layout.precomputed else to_torch(inputs["features"])
    outputs: dict[str, np.ndarray] = {}

    if layout.pretrained:
        from vlbert_core.models.vlbert.pretraining import VLBertForPretraining
        from vlbert_core.pretrain.settings import get_setting

        batch = pretrain_batch(inputs, vlbert.config)
        roi_features = None
        if features is not None:
            roi_features = torch.zeros(batch.inputs.batch_size, batch.inputs.boxes.shape[1], APPEARANCE_DIM)
            roi_features[: features.shape[0], : features.shape[1]] = features
        recorder = _StageRecorder(vlbert)
        hidden = vlbert.encode(batch.inputs, roi_features=roi_features).sequence_output
        recorder.close()
        module = VLBertForPretraining(vlbert, get_setting("d")).eval()
        module.load_heads(model_dir)
        inputs_b = batch.inputs
        is_caption = inputs_b.has_image[:, None].expand_as(batch.mlm_labels)
        labelled = batch.mlm_labels != IGNORE_INDEX
        outputs["mlm_logits_caption"] = module.heads.mlm(hidden[labelled & is_caption]).numpy()
        outputs["mlm_logits_text"] = module.heads.mlm(hidden[labelled & ~is_caption]).numpy()
        selected = torch.gather(batch.roi_selected, 1, inputs_b.roi_index) & (inputs_b.element_kind == IMG)
        selected &= inputs_b.attention_mask
        outputs["roi_logits"] = module.heads.roi_cls(hidden[selected]).numpy()
        losses = module(batch, roi_features=roi_features)
        outputs["losses"] = np.array([float(losses[k]) for k in ("mlm_loss", "mlm_text_loss", "roi_loss")])
        stages, attention, box_valid = recorder.outputs, inputs_b.attention_mask, inputs_b.box_valid
    else:
        batch = collate_samples(_candidate_samples(inputs, image_samples) if layout.inputs == CANDIDATE_INPUTS
                                else _sentence_samples(layout, inputs, image_samples), canvas=layout.fixed_canvas)
        recorder = _StageRecorder(vlbert)
        output = vlbert.encode(batch, roi_features=features, rows_per_image=layout.rows_per_image)
        # VCR's head scores each image's run of candidate rows
        scores = finetuned.head(output, batch, *((layout.rows_per_image,) if layout.rows_per_image > 1 else ()))
        outputs[layout.output] = _boxes_of(scores, batch.box_valid) if layout.per_box else scores.numpy()
        recorder.close()
        if layout.fixed_canvas is not None:
            # the images as the visual network takes them, each on its canvas
            image_rows = torch.arange(len(inputs["num_boxes"])) * layout.rows_per_image
            outputs["canvas_images"] = batch.images[image_rows].numpy()
        if layout.per_box:
            outputs.update(_box_prediction(layout, scores, batch))
        stages, attention, box_valid = recorder.outputs, batch.attention_mask, batch.box_valid

    outputs["embeddings"] = _real_positions(stages["embeddings"], attention)
    for name in sorted(k for k in stages if k.startswith("layer_")):
        outputs[name] = _real_positions(stages[name], attention)
    # the rows of the images: VCR's visual network ran once per image (every 4th row), pre-training's on the
    # caption rows (the first ones)
    image_rows = torch.arange(len(inputs["num_boxes"])) * layout.rows_per_image
    outputs["visual_embedding"] = _boxes_of(stages["visual_embedding"][image_rows], box_valid[image_rows])
    if not layout.precomputed:
        outputs["appearance"] = _boxes_of(stages["appearance"], box_valid[image_rows])
    return outputs
