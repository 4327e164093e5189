"""Run the authors' VL-BERT (jackroos/VL-BERT) on a reference batch and save its per-stage outputs.

A standalone script for the authors' environment: it imports torch, torchvision, numpy and the authors' code
(from --repo, a checkout the user downloaded), never this package; of this project it reads only the released
layouts' table (LAYOUTS of ../released_heads.py, plain Python: which model of theirs, which forward arguments,
which output), from its file. `python -m vlbert_core.convert.verify` runs it with --authors-python and compares
its outputs with ours (reference.py names the stages).

    PY vlbert_core/convert/vlbert/authors_runner.py --repo VL-BERT --layout pretrain-e2e --config cfgs/pretrain/...yaml \
        --checkpoint vl-bert-base-e2e.model --vocab bert-base-uncased/vocab.txt --inputs in.npz --out out.npz

Stand-ins it needs to run their code on a CPU under today's torch (nothing of their code is edited):
- their RoIAlign is a compiled CUDA/C++ extension (common/lib/roi_pooling): a module `C_ROIPooling` backed by
  torchvision.ops.roi_align(aligned=False) and its backward takes its place. Their own CPU kernel, built from their sources, gave
  the same numbers to the last bit (max |diff| 0.0 over 52 boxes, sampling ratios 0, 1 and 2; docs/released-
  architecture.md);
- PyYAML >= 6 needs a Loader where their config.py calls yaml.load(f): FullLoader, PyYAML 5's default;
- their constructors read files for initial weights (BERT under NETWORK.BERT_MODEL_NAME, the ResNet-101 under
  IMAGE_PRETRAINED); the checkpoint overwrites every one of those tensors afterwards, so the runner gives them
  a vocabulary and a random ResNet-101 in a temporary directory, and a zero "BERT MLM transform" to the VQA
  head's initialiser (`torch.load` of no file).

A layout with a fixed canvas (VCR) takes its images through the authors' own test transform and collate
(canvas_images: their Normalize and FixPadding with their config's SCALES) instead of the given normalised ones,
and reports them as the stage canvas_images; a per-box layout (RefCOCO+) also reports their prediction, the
argmax over all box slots and its box (predicted_index, predicted_box).
"""

from __future__ import annotations

import argparse
import importlib
import os
import shutil
import sys
import tempfile
import types

import numpy as np
import torch


def _released_layouts():
    """vlbert_core/convert/released_heads.py, loaded from its file (it imports the standard library only)."""
    import importlib.util

    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "released_heads.py")
    spec = importlib.util.spec_from_file_location("_vlbert_released_layouts", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module   # the dataclasses look their module up
    spec.loader.exec_module(module)
    return module


_TABLE = _released_layouts()
LAYOUTS = _TABLE.LAYOUTS   # name -> ReleasedLayout


def install_stand_ins() -> None:
    """The RoIAlign extension and yaml.load, as the module docstring says."""
    from torchvision.ops import roi_align

    ext = types.ModuleType("common.lib.roi_pooling.C_ROIPooling")

    def roi_align_forward(inp, rois, spatial_scale, pooled_height, pooled_width, sampling_ratio):
        return roi_align(inp, rois, output_size=(int(pooled_height), int(pooled_width)),
                         spatial_scale=float(spatial_scale), sampling_ratio=int(sampling_ratio), aligned=False)

    def roi_align_backward(grad, rois, spatial_scale, pooled_height, pooled_width, batch_size, channels, height,
                           width, sampling_ratio):
        # their backward exists for CUDA only; torchvision's is the same algorithm's (benchmarks/vs_authors.py
        # trains their model on the CPU)
        return torch.ops.torchvision._roi_align_backward(
            grad, rois, float(spatial_scale), int(pooled_height), int(pooled_width), int(batch_size), int(channels),
            int(height), int(width), int(sampling_ratio), False)

    def not_needed(*args, **kwargs):
        raise NotImplementedError("authors_runner: only RoIAlign is stood in for (their Fast R-CNN uses no RoIPool)")

    ext.roi_align_forward = roi_align_forward
    ext.roi_align_backward = roi_align_backward
    ext.roi_pool_forward = ext.roi_pool_backward = not_needed
    sys.modules["common.lib.roi_pooling.C_ROIPooling"] = ext

    import yaml

    original = yaml.load

    def load(stream, Loader=None, **kwargs):
        return original(stream, Loader=Loader or yaml.FullLoader, **kwargs)

    yaml.load = load


def build_model(repo: str, layout, config_file: str, vocab: str, workdir: str):
    """The authors' model of `layout` (a ReleasedLayout: its authors_package and authors_class) from their config
    file, in eval mode, with throwaway initial weights."""
    package, class_name = layout.authors_package, layout.authors_class
    config_module = importlib.import_module(f"{package}.function.config")
    config_module.update_config(os.path.join(repo, config_file))
    config = config_module.config
    bert_dir = os.path.join(workdir, "bert")
    os.makedirs(bert_dir, exist_ok=True)
    shutil.copy(vocab, os.path.join(bert_dir, "vocab.txt"))
    config.NETWORK.BERT_MODEL_NAME = bert_dir
    config.NETWORK.BERT_PRETRAINED = ""
    if not config.NETWORK.IMAGE_FEAT_PRECOMPUTED:
        import torchvision

        prefix = os.path.join(workdir, "resnet101")
        torch.save(torchvision.models.resnet101(weights=None).state_dict(), f"{prefix}-0000.model")
        config.NETWORK.IMAGE_PRETRAINED, config.NETWORK.IMAGE_PRETRAINED_EPOCH = prefix, 0
    model_class = getattr(importlib.import_module(f"{package}.modules"), class_name)
    original_load = torch.load
    hidden = int(config.NETWORK.VLBERT.hidden_size)

    def load(path, *args, **kwargs):
        if path is None:   # VQA's 'mlm' classifier reads BERT's MLM transform from the BERT file
            return {"cls.predictions.transform.dense.weight": torch.zeros(hidden, hidden),
                    "cls.predictions.transform.dense.bias": torch.zeros(hidden),
                    "cls.predictions.transform.LayerNorm.weight": torch.ones(hidden),
                    "cls.predictions.transform.LayerNorm.bias": torch.zeros(hidden)}
        kwargs.setdefault("weights_only", False)  # the runner's own throwaway files
        return original_load(path, *args, **kwargs)

    torch.load = load
    try:
        model = model_class(config)
    finally:
        torch.load = original_load
    return model, config


def load_checkpoint(model, path: str) -> None:
    """The checkpoint's 'state_dict' (DataParallel 'module.' keys, any float dtype) into the fp32 model."""
    checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    state = checkpoint["state_dict"]
    state = {k[len("module."):] if k.startswith("module.") else k: v for k, v in state.items()}
    model.load_state_dict(state, strict=True)
    model.float().eval()


class Recorder:
    """Outputs of the embedding, every encoder layer, the visual feature projection and the Fast R-CNN."""

    def __init__(self, model):
        vlbert = model.vlbert._module if hasattr(model.vlbert, "_module") else model.vlbert
        self.outputs = {}
        self.handles = []
        original_embedding = vlbert.embedding

        def embedding(*args, **kwargs):
            result = original_embedding(*args, **kwargs)
            self.outputs["embeddings"], self.outputs["mask"] = result[0].detach(), result[1].bool()
            return result

        vlbert.embedding = embedding
        for i, layer in enumerate(vlbert.encoder.layer):
            self.handles.append(layer.register_forward_hook(self._keep(f"layer_{i:02d}")))
        extractor = model.image_feature_extractor
        self.handles.append(extractor.obj_downsample.register_forward_hook(self._keep("visual_embedding")))
        self.handles.append(extractor.register_forward_hook(self._keep_raw))

    def _keep(self, name):
        def hook(module, args, output):
            self.outputs[name] = (output[0] if isinstance(output, tuple) else output).detach()
        return hook

    def _keep_raw(self, module, args, output):
        self.outputs["obj_reps_raw"] = output["obj_reps_raw"].detach()


def t(array, dtype=None):
    value = torch.from_numpy(np.ascontiguousarray(array))
    return value if dtype is None else value.to(dtype)


def boxes_padded(inputs: dict, pad: float, features: bool = False) -> torch.Tensor:
    boxes = t(inputs["boxes"]).clone()
    valid = np.arange(boxes.shape[1])[None, :] < inputs["num_boxes"][:, None]
    boxes[~t(valid)] = pad
    if features:
        feats = t(inputs["features"]).clone()
        feats[~t(valid)] = pad
        boxes = torch.cat([boxes, feats], dim=-1)
    return boxes


def im_info(inputs: dict, with_index: bool) -> torch.Tensor:
    rows = [[float(w), float(h), 1.0, 1.0] + ([float(i)] if with_index else [])
            for i, (w, h) in enumerate(inputs["image_sizes"])]
    return torch.tensor(rows, dtype=torch.float32)


def masked_images(inputs: dict) -> torch.Tensor:
    """The images with each masked RoI's pixels zeroed, as conceptual_captions.py does before batching:
    image[:, int(y1):(int(y2)+1), int(x1):(int(x2)+1)] = 0."""
    images = t(inputs["normalised_images"]).clone()
    if "mvrc_ops" in inputs:
        for i, (ops, boxes) in enumerate(zip(inputs["mvrc_ops"], inputs["boxes"])):
            for op, (x1, y1, x2, y2) in zip(ops[: inputs["num_boxes"][i]], boxes):
                if op == 1:
                    images[i, :, int(y1):(int(y2) + 1), int(x1):(int(x2) + 1)] = 0
    return images


def canvas_images(layout, config, inputs: dict) -> torch.Tensor:
    """The batch's images through the authors' test transform of `layout`'s package and their collate: to a
    tensor, BGR x 255 normalised by their config's PIXEL_MEANS / PIXEL_STDS, zero-padded to the fixed canvas of
    their SCALES (FixPadding), then padded to the batch's largest (clip_pad_images). Their Resize and flip are
    left out: the reference images are given at their fitted size, and a test transform does not flip."""
    from PIL import Image

    transforms = importlib.import_module(f"{layout.authors_package}.data.transforms.transforms")
    from common.utils.clip_pad import clip_pad_images

    steps = transforms.Compose([
        transforms.ToTensor(),
        transforms.Normalize(mean=config.NETWORK.PIXEL_MEANS, std=config.NETWORK.PIXEL_STDS, to_bgr255=True),
        transforms.FixPadding(config.SCALES[0], config.SCALES[1], pad=0)])
    images = []
    for i, (w, h) in enumerate(inputs["image_sizes"]):
        image, _, _, _ = steps(Image.fromarray(inputs["images"][i, :h, :w]), None, None, None)
        images.append(image)
    shape = tuple(max(sizes) for sizes in zip(*(image.shape for image in images)))
    return torch.stack([clip_pad_images(image, shape, pad=0) for image in images])


def forward(model, layout, inputs: dict, images: torch.Tensor | None = None) -> dict:
    """Run the model on the reference batch of `layout` (a ReleasedLayout); returns its outputs (the model's dict).
    `images`: the batch's images as the authors' transform made them (canvas_images); default: the given
    normalised images."""
    precomputed = layout.precomputed
    if images is None and not precomputed:
        images = masked_images(inputs)
    if layout.inputs == _TABLE.PRETRAINING_INPUTS:
        args = (images, boxes_padded(inputs, -2.0, precomputed), im_info(inputs, True), t(inputs["text"]),
                torch.ones(inputs["text"].shape[0], dtype=torch.long), t(inputs["mlm_labels"]),
                t(inputs["mvrc_ops"]), t(inputs["mvrc_labels"]), t(inputs["aux_text"]), t(inputs["aux_mlm_labels"]))
        outputs, _ = model(*args)
        return outputs
    if layout.inputs == _TABLE.SENTENCE_INPUTS:
        # VQA (precomputed: no image, the features beside the boxes) and RefCOCO+
        return model(images, boxes_padded(inputs, -2.0, precomputed), im_info(inputs, False), t(inputs[layout.sentence]))
    # candidates (VCR): boxes [x1, y1, x2, y2, score, class] padded -1; words [id, tag, align] padded -2
    boxes = torch.full((*inputs["boxes"].shape[:2], 6), -1.0)
    masks = torch.full((*inputs["boxes"].shape[:2], 14, 14), -1.0)
    for i, n in enumerate(inputs["num_boxes"]):
        boxes[i, :n, :4] = t(inputs["boxes"][i, :n])
        boxes[i, :n, 4] = 1.0
        boxes[i, :n, 5] = t(inputs["box_classes"][i, :n], torch.float32)
        masks[i, :n] = t(inputs["instance_masks"][i, :n])
    question = torch.full((*inputs["question"].shape, 3), -2, dtype=torch.long)
    valid = t(inputs["question"]) > 0
    question[..., 0][valid] = t(inputs["question"])[valid]
    question[..., 1][valid] = t(inputs["question_tags"])[valid]
    question[..., 2][valid] = 0
    answers = torch.full((*inputs["answers"].shape, 3), -2, dtype=torch.long)
    valid = t(inputs["answers"]) > 0
    answers[..., 0][valid] = t(inputs["answers"])[valid]
    answers[..., 1][valid] = t(inputs["answer_tags"])[valid]
    answers[..., 2][valid] = 0
    align_q = torch.zeros(question.shape[0], 1, question.shape[1])
    align_a = torch.zeros(*answers.shape[:2], 1, answers.shape[2])
    return model(images, boxes, masks, question, align_q, answers, align_a, im_info(inputs, True))


def stages(layout, inputs: dict, outputs: dict, recorded: dict) -> dict[str, np.ndarray]:
    """The per-stage arrays of `layout` (a ReleasedLayout), laid out as reference.our_outputs lays out ours."""
    mask = recorded["mask"]
    out = {"embeddings": recorded["embeddings"][mask].numpy()}
    for name in sorted(k for k in recorded if k.startswith("layer_")):
        out[name] = recorded[name][mask].numpy()
    out["visual_embedding"] = recorded["visual_embedding"].numpy()
    valid = t(np.arange(inputs["boxes"].shape[1])[None, :] < inputs["num_boxes"][:, None])
    if not layout.precomputed:
        out["appearance"] = recorded["obj_reps_raw"][:, : valid.shape[1]][valid].numpy()
    if layout.pretrained:
        out["mlm_logits_caption"] = outputs["mlm_logits_wvc"][outputs["mlm_label_wvc"] != -1].numpy()
        out["mlm_logits_text"] = outputs["mlm_logits_aux"][outputs["mlm_label_aux"] != -1].numpy()
        selected = t(inputs["mvrc_labels"]).sum(-1) > 0
        out["roi_logits"] = outputs["mvrc_logits"][:, : selected.shape[1]][selected].numpy()
        out["losses"] = np.array([float(outputs["mlm_loss_wvc"]), float(outputs["mlm_loss_aux"]),
                                  float(outputs["mvrc_loss"])])
    else:
        logits = outputs["label_logits"]
        out[layout.output] = (logits[:, : valid.shape[1]][valid] if layout.per_box else logits).numpy()
        if layout.per_box:
            # their prediction (RefCOCO+ inference_forward): the argmax over every box slot, box 0 included,
            # and that box, scaled back to the original image by im_info's ratios
            out["predicted_index"] = logits.argmax(1).numpy()
            out["predicted_box"] = outputs["pred_boxes"].numpy()
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repo", required=True, help="a checkout of jackroos/VL-BERT")
    parser.add_argument("--layout", required=True, choices=sorted(LAYOUTS))
    parser.add_argument("--config", required=True, help="the authors' config file, relative to --repo")
    parser.add_argument("--checkpoint", required=True, help="the checkpoint, as the authors' trainer saves it")
    parser.add_argument("--vocab", required=True, help="bert-base-uncased's vocab.txt")
    parser.add_argument("--inputs", required=True, help="the reference batch (.npz, reference.py)")
    parser.add_argument("--out", required=True, help="where the per-stage outputs go (.npz)")
    args = parser.parse_args(argv)
    layout = LAYOUTS[args.layout]
    repo = os.path.abspath(args.repo)
    sys.path.insert(0, repo)
    install_stand_ins()
    torch.set_grad_enabled(False)
    with np.load(args.inputs, allow_pickle=False) as data:
        inputs = {k: data[k] for k in data.files}
    with tempfile.TemporaryDirectory() as workdir:
        model, config = build_model(repo, layout, args.config, args.vocab, workdir)
    load_checkpoint(model, args.checkpoint)
    recorder = Recorder(model)
    images = canvas_images(layout, config, inputs) if layout.fixed_canvas is not None else None
    outputs = forward(model, layout, inputs, images)
    result = stages(layout, inputs, outputs, recorder.outputs)
    if images is not None:
        result["canvas_images"] = images.numpy()
    tmp = args.out + ".tmp"
    with open(tmp, "wb") as f:
        np.savez_compressed(f, **result)
    os.replace(tmp, args.out)
    print(f"authors_runner: {args.layout}: {len(result)} stages -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
