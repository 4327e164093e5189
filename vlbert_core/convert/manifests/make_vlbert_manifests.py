"""Writes the manifests of the authors' published VL-BERT files (vl-bert-*.json, vqa-base.json,
refcoco-base.json, vcr-base.json, resnet101-pt-vgbua.json) next to this script.

Every key and shape is read off the authors' module definitions (jackroos/VL-BERT):
- common/backbone/resnet/resnet.py: ResNet(expose_stages=[4]) keeps conv1, bn1, layer1-3 ([3, 4, 23]
  bottlenecks for ResNet-101), torchvision names, BatchNorm with num_batches_tracked (PyTorch >= 0.4.1);
- common/fast_rcnn.py: `roi_head_feature_extractor` (stage 5, 3 bottlenecks of 512 planes) is registered a
  second time as `head.0` (head = Sequential(stage 5, AvgPool2d, Flattener)), so its tensors appear under
  both names; `obj_downsample` = Sequential(Dropout, Linear(2 x 2048, IMAGE_FINAL_DIM), ReLU); with
  IMAGE_FEAT_PRECOMPUTED (the "prec" models, VQA) only obj_downsample exists;
- common/visual_linguistic_bert.py: word/end/position/token-type embeddings, embedding_LayerNorm,
  visual_ln_text/object (visual_ln true), BertEncoder, no pooler (with_pooler false); pre-training adds
  mlm_head.predictions (transform.dense, transform.LayerNorm, bias, decoder.weight tied to the word
  embeddings) and mvrc_head (transform.dense, region_cls_pred to 1601 classes);
- pretrain/modules/resnet_vlbert_for_pretraining_multitask.py: object_linguistic_embeddings (1, H),
  object_mask_word_embedding (1, H), aux_text_visual_embedding (1, H), and with precomputed features
  object_mask_visual_embedding (1, 2048);
- vqa/modules, refcoco/modules, vcr/modules with cfgs/{vqa,refcoco,vcr}/base_*.yaml: the task heads;
- the checkpoint callback (common/callbacks/epoch_end_callbacks/checkpoint.py) saves {'state_dict': the
  DataParallel/DDP state dict ('module.' prefix), 'optimizer', 'validation_monitor': {'best_epoch', 'best_val'}};
- dtypes: the configs with TRAIN.FP16 true (pretrain base_e2e, large_e2e, large_prec) train under apex amp O2
  with keep_batchnorm_fp32=False (pretrain/function/train.py), which casts the whole model to float16, BatchNorm
  statistics included, so every floating tensor of those checkpoints is float16 (num_batches_tracked stays
  int64); the fp32 configs (pretrain base_prec, vqa, refcoco, vcr) save float32.
Run: uv run python vlbert_core/convert/manifests/make_vlbert_manifests.py (a maintainer's tool; the JSON files are
package data, read by the rehearsal's rule stand_in and the converter tests)
"""

from __future__ import annotations

import json
from pathlib import Path

HERE = Path(__file__).parent
RESNET101_BLOCKS = (3, 4, 23, 3)
PLANES = (64, 128, 256, 512)
VISUAL_REGION_CLASSES = 1601     # pretrain/function/config.py: visual_region_classes
VQA_ANSWERS = 3129               # DATASET.ANSWER_VOCAB_SIZE
VCR_CNN_CLASSES = 81             # vcr/modules: cnn_loss_reg Linear(hidden, 81)
BERT = {"base": dict(hidden=768, layers=12, intermediate=3072),
        "large": dict(hidden=1024, layers=24, intermediate=4096)}
VOCAB, POSITIONS, TOKEN_TYPES = 30522, 512, 3


def bn(prefix: str, n: int, tracked: bool = True) -> dict:
    out = {f"{prefix}.{k}": [n] for k in ("weight", "bias", "running_mean", "running_var")}
    if tracked:
        out[f"{prefix}.num_batches_tracked"] = []
    return out


def bottleneck(prefix: str, inplanes: int, planes: int, downsample: bool, tracked: bool) -> dict:
    out = {f"{prefix}.conv1.weight": [planes, inplanes, 1, 1], **bn(f"{prefix}.bn1", planes, tracked),
           f"{prefix}.conv2.weight": [planes, planes, 3, 3], **bn(f"{prefix}.bn2", planes, tracked),
           f"{prefix}.conv3.weight": [planes * 4, planes, 1, 1], **bn(f"{prefix}.bn3", planes * 4, tracked)}
    if downsample:
        out[f"{prefix}.downsample.0.weight"] = [planes * 4, inplanes, 1, 1]
        out.update(bn(f"{prefix}.downsample.1", planes * 4, tracked))
    return out


def stage(prefix: str, index: int, tracked: bool) -> dict:
    planes = PLANES[index]
    inplanes = 64 if index == 0 else PLANES[index - 1] * 4
    out = {}
    for b in range(RESNET101_BLOCKS[index]):
        out.update(bottleneck(f"{prefix}.{b}", inplanes if b == 0 else planes * 4, planes, b == 0, tracked))
    return out


def resnet101(prefix: str, stages: range, tracked: bool) -> dict:
    out = {f"{prefix}conv1.weight": [64, 3, 7, 7], **bn(f"{prefix}bn1", 64, tracked)}
    for i in stages:
        out.update(stage(f"{prefix}layer{i + 1}", i, tracked))
    return out


def visual(e2e: bool, final_dim: int) -> dict:
    p = "module.image_feature_extractor."
    out = {}
    if e2e:
        out.update(resnet101(p + "backbone.", range(3), tracked=True))
        out.update(stage(p + "roi_head_feature_extractor", 3, tracked=True))
        out.update(stage(p + "head.0", 3, tracked=True))
    out[p + "obj_downsample.1.weight"] = [final_dim, 2 * 2048]
    out[p + "obj_downsample.1.bias"] = [final_dim]
    return out


def vlbert(size: str) -> dict:
    h, i = BERT[size]["hidden"], BERT[size]["intermediate"]
    p = "module.vlbert."
    out = {p + "word_embeddings.weight": [VOCAB, h], p + "end_embedding.weight": [1, h],
           p + "position_embeddings.weight": [POSITIONS, h], p + "token_type_embeddings.weight": [TOKEN_TYPES, h]}
    for name in ("embedding_LayerNorm", "visual_ln_text", "visual_ln_object"):
        out[f"{p}{name}.weight"] = [h]
        out[f"{p}{name}.bias"] = [h]
    for layer in range(BERT[size]["layers"]):
        lp = f"{p}encoder.layer.{layer}."
        for name in ("attention.self.query", "attention.self.key", "attention.self.value", "attention.output.dense"):
            out[f"{lp}{name}.weight"] = [h, h]
            out[f"{lp}{name}.bias"] = [h]
        out[f"{lp}intermediate.dense.weight"] = [i, h]
        out[f"{lp}intermediate.dense.bias"] = [i]
        out[f"{lp}output.dense.weight"] = [h, i]
        out[f"{lp}output.dense.bias"] = [h]
        for name in ("attention.output.LayerNorm", "output.LayerNorm"):
            out[f"{lp}{name}.weight"] = [h]
            out[f"{lp}{name}.bias"] = [h]
    return out


def pretraining_heads(size: str) -> dict:
    h = BERT[size]["hidden"]
    p = "module.vlbert."
    return {p + "mlm_head.predictions.bias": [VOCAB],
            p + "mlm_head.predictions.transform.dense.weight": [h, h],
            p + "mlm_head.predictions.transform.dense.bias": [h],
            p + "mlm_head.predictions.transform.LayerNorm.weight": [h],
            p + "mlm_head.predictions.transform.LayerNorm.bias": [h],
            p + "mlm_head.predictions.decoder.weight": [VOCAB, h],
            p + "mvrc_head.transform.dense.weight": [h, h], p + "mvrc_head.transform.dense.bias": [h],
            p + "mvrc_head.region_cls_pred.weight": [VISUAL_REGION_CLASSES, h],
            p + "mvrc_head.region_cls_pred.bias": [VISUAL_REGION_CLASSES]}


def pretrained(size: str, e2e: bool) -> dict:
    h = BERT[size]["hidden"]
    out = visual(e2e, h)
    out["module.object_linguistic_embeddings.weight"] = [1, h]
    if not e2e:
        out["module.object_mask_visual_embedding.weight"] = [1, 2048]
    out["module.object_mask_word_embedding.weight"] = [1, h]
    out["module.aux_text_visual_embedding.weight"] = [1, h]
    out.update(vlbert(size))
    out.update(pretraining_heads(size))
    return out


def vqa_base() -> dict:
    # cfgs/vqa/base_4x16G_fp32.yaml: IMAGE_FEAT_PRECOMPUTED true, CLASSIFIER_TYPE mlm
    out = {**visual(False, 768), "module.object_linguistic_embeddings.weight": [1, 768], **vlbert("base")}
    out.update({"module.final_mlp.0.dense.weight": [768, 768], "module.final_mlp.0.dense.bias": [768],
                "module.final_mlp.0.LayerNorm.weight": [768], "module.final_mlp.0.LayerNorm.bias": [768],
                "module.final_mlp.2.weight": [VQA_ANSWERS, 768], "module.final_mlp.2.bias": [VQA_ANSWERS]})
    return out


def refcoco_base() -> dict:
    # cfgs/refcoco/base_detected_regions_4x16G.yaml: end to end, final_mlp = (MVRC transform, Dropout, Linear)
    out = {**visual(True, 768), "module.object_linguistic_embeddings.weight": [1, 768], **vlbert("base")}
    out.update({"module.final_mlp.0.dense.weight": [768, 768], "module.final_mlp.0.dense.bias": [768],
                "module.final_mlp.2.weight": [1, 768], "module.final_mlp.2.bias": [1]})
    return out


def vcr_base() -> dict:
    # cfgs/vcr/base_q2a_4x16G_fp32.yaml: end to end, with_pooler (vcr config default), CLASSIFIER_TYPE 1fc,
    # CNN_LOSS_TOP: cnn_loss_reg = (MVRC transform, Dropout, Linear(hidden, 81)); the VL-BERT sits inside
    # TimeDistributed (`vlbert._module.`)
    out = {**visual(True, 768), "module.object_linguistic_embeddings.weight": [1, 768]}
    out.update({k.replace("module.vlbert.", "module.vlbert._module."): v for k, v in vlbert("base").items()})
    out.update({"module.vlbert._module.pooler.dense.weight": [768, 768], "module.vlbert._module.pooler.dense.bias": [768],
                "module.cnn_loss_reg.0.dense.weight": [768, 768], "module.cnn_loss_reg.0.dense.bias": [768],
                "module.cnn_loss_reg.2.weight": [VCR_CNN_CLASSES, 768], "module.cnn_loss_reg.2.bias": [VCR_CNN_CLASSES],
                "module.final_mlp.1.weight": [1, 768], "module.final_mlp.1.bias": [1]})
    return out


def manifest(file: str, shapes: dict, wrap: list, extra: dict | None = None, float_dtype: str = "float32") -> dict:
    tensors = {k: {"shape": v, "dtype": "int64" if k.endswith("num_batches_tracked") else float_dtype}
               for k, v in shapes.items()}
    out = {"file": file, "format": "torch", "wrap": wrap, "tensors": tensors}
    if extra:
        out["extra"] = extra
    return out


def to_json(data: dict) -> str:
    """One tensor a line, so that a diff of a manifest reads key by key."""
    head = {k: v for k, v in data.items() if k != "tensors"}
    lines = [json.dumps(head)[:-1] + ', "tensors": {']
    items = list(data["tensors"].items())
    for n, (key, spec) in enumerate(items):
        lines.append(f"  {json.dumps(key)}: {json.dumps(spec)}" + ("," if n + 1 < len(items) else ""))
    lines.append("}}")
    return "\n".join(lines) + "\n"


CHECKPOINT_EXTRA = {"optimizer": {"state": {}, "param_groups": []},
                    "validation_monitor": {"best_epoch": 9, "best_val": 0.5}}
# the released pre-training configs trained in fp16 (TRAIN.FP16: cfgs/pretrain/*.yaml)
FP16_PRETRAINED = {("base", "e2e"), ("large", "e2e"), ("large", "prec")}


def main() -> None:
    files = {}
    for size in ("base", "large"):
        for kind in ("e2e", "prec"):
            files[f"vl-bert-{size}-{kind}"] = manifest(
                f"vl-bert-{size}-{kind}.model", pretrained(size, kind == "e2e"), ["state_dict"], CHECKPOINT_EXTRA,
                float_dtype="float16" if (size, kind) in FP16_PRETRAINED else "float32")
    files["vqa-base"] = manifest("vl-bert_base_res101_vqa-0019.model", vqa_base(), ["state_dict"], CHECKPOINT_EXTRA)
    files["refcoco-base"] = manifest("vl-bert_base_res101_refcoco-0019.model", refcoco_base(), ["state_dict"],
                                     CHECKPOINT_EXTRA)
    files["vcr-base"] = manifest("vl-bert_base_res101_vcr_q2a-0019.model", vcr_base(), ["state_dict"],
                                 CHECKPOINT_EXTRA)
    # resnet101-pt-vgbua-0000.model: a plain state dict of the whole ResNet-101 (torchvision names, layer4
    # included: common/fast_rcnn.py init_weight reads `layer4.*` from it), converted from Caffe, no fc
    files["resnet101-pt-vgbua"] = manifest("resnet101-pt-vgbua-0000.model", resnet101("", range(4), tracked=False), [])
    for name, data in files.items():
        (HERE / f"{name}.json").write_text(to_json(data))
        print(name, len(data["tensors"]), "tensors")


if __name__ == "__main__":
    main()
