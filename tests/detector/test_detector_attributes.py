"""The detector's attribute head (bottom-up attention's): the world's attribute annotations, the head, its
loss and its training in train_detector."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from conftest import TINY_DETECTOR_CFG
from test_detector import write_coco_world
from vlbert_core.detector import build_detector, load_detector, train_detector
from vlbert_core.detector.faster_rcnn import (
    IGNORE_ATTRIBUTE, MAX_ATTRIBUTES_PER_OBJECT, AttributePredictor, AttributeRoIHeads, attribute_loss,
)
from vlbert_core.detector.train import load_coco_split
from vlbert_core.world import formats
from vlbert_core.world.scene import SceneObject
from vlbert_core.world.vocabulary import ATTRIBUTE_NAMES, COLOUR_NAMES, SIZE_NAMES, coco_attributes

ATTRIBUTES = ["red", "green", "blue", "small", "large"]
TINY_ATTR_CFG = {**TINY_DETECTOR_CFG, "attribute_loss_weight": 0.5,
                 "train": {"steps": 3, "batch_size": 2, "lr": 0.01, "weight_decay": 0.0001}}


def with_attributes(path: str) -> str:
    """write_coco_world's file with a VG-style attribute vocabulary and per-object attribute names."""
    coco = json.loads(open(path).read())
    coco["attributes"] = [{"id": i + 1, "name": n} for i, n in enumerate(ATTRIBUTES)]
    for i, ann in enumerate(coco["annotations"]):
        ann["attributes"] = [ATTRIBUTES[ann["category_id"] - 1], ATTRIBUTES[3 + i % 2]] if i % 5 else []
    open(path, "w").write(json.dumps(coco))
    return path


# ---------------------------------------------------------------- annotations


def test_world_detector_annotations_carry_colour_and_size_and_read_back(tmp_path):
    objects = [SceneObject("circle", "blue", "small", (4, 5, 20, 21), (36, 84, 214)),
               SceneObject("star", "pink", "large", (30, 30, 70, 66), (238, 112, 186))]
    annotations = [formats.coco_annotation(i + 1, 1, o, with_attributes=True) for i, o in enumerate(objects)]
    assert [a["attributes"] for a in annotations] == [["blue", "small"], ["pink", "large"]]
    assert "attributes" not in formats.coco_annotation(1, 1, objects[0])          # RefCOCO+'s files: none
    coco = formats.coco_instances([{"id": 1, "file_name": "a.jpg", "width": 96, "height": 96, "license": 0}],
                                  annotations, "test", with_attributes=True)
    assert coco["attributes"] == coco_attributes() and [a["name"] for a in coco["attributes"]] == list(ATTRIBUTE_NAMES)
    assert set(ATTRIBUTE_NAMES) == set(COLOUR_NAMES) | set(SIZE_NAMES)
    from PIL import Image
    (tmp_path / "images").mkdir()
    Image.new("RGB", (96, 96)).save(tmp_path / "images" / "a.jpg")
    formats.write_json(tmp_path / "instances.json", coco)
    split = load_coco_split(tmp_path / "instances.json", tmp_path / "images")
    assert split.attributes == list(ATTRIBUTE_NAMES)
    ids = split.images[0].attributes
    assert ids.shape == (2, MAX_ATTRIBUTES_PER_OBJECT)
    names = [[split.attributes[i - 1] for i in row.tolist() if i != IGNORE_ATTRIBUTE] for row in ids]
    assert [sorted(n) for n in names] == [["blue", "small"], ["large", "pink"]]


def test_unknown_attribute_names_the_file_and_annotation(tmp_path):
    path = with_attributes(write_coco_world(tmp_path, "train", 2, seed=0))
    coco = json.loads(open(path).read())
    coco["annotations"][1]["attributes"] = ["red", "purpel"]
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(coco))
    with pytest.raises(ValueError, match=r"bad\.json: annotations\[1\] \(id 1\): unknown attribute\(s\) \['purpel'\]"):
        load_coco_split(bad, tmp_path / "images")
    coco["annotations"][1]["attributes"] = "red"
    bad.write_text(json.dumps(coco))
    with pytest.raises(ValueError, match=r"bad\.json: annotations\[1\].*list of attribute names"):
        load_coco_split(bad, tmp_path / "images")
    coco["attributes"][0]["id"] = 7
    bad.write_text(json.dumps(coco))
    with pytest.raises(ValueError, match=r"bad\.json: 'attributes' ids must be 1\.\.5"):
        load_coco_split(bad, tmp_path / "images")


def test_a_file_without_attribute_vocabulary_has_no_attributes(tmp_path):
    split = load_coco_split(write_coco_world(tmp_path, "train", 2, seed=0), tmp_path / "images")
    assert split.attributes is None and all(d.attributes is None for d in split.images)


# ---------------------------------------------------------------- head and loss


def test_attribute_predictor_shapes_and_class_embedding():
    torch.manual_seed(0)
    head = AttributePredictor(in_channels=64, num_classes_with_background=4, num_attributes=5)
    assert head.cls_embedding.weight.shape == (4, 8) and head.fc_attr.weight.shape == (16, 72)
    pooled = torch.randn(6, 64)
    out = head(pooled, torch.tensor([0, 1, 2, 3, 1, 1]))
    assert out.shape == (6, 6)
    # the class enters through its embedding only: same feature, other class, other logits
    assert not torch.allclose(head(pooled[:1], torch.tensor([1])), head(pooled[:1], torch.tensor([2])))


def test_attribute_loss_on_a_tiny_example_by_hand():
    logits = torch.tensor([[0.0, 2.0, 0.0, 1.0], [1.0, 0.0, 0.0, 0.0], [0.5, 0.5, 3.0, 0.0]])
    pad = [IGNORE_ATTRIBUTE] * 2
    labels = torch.tensor([[1, 3] + pad, [IGNORE_ATTRIBUTE] * 4, [2] + pad + [IGNORE_ATTRIBUTE]])
    log_p = F.log_softmax(logits, dim=1)
    # RoI 0: two attributes at 1/2 each; RoI 1: none (no loss, not counted); RoI 2: one attribute
    expected = (-(log_p[0, 1] + log_p[0, 3]) / 2 - log_p[2, 2]) / 2
    torch.testing.assert_close(attribute_loss(logits, labels), expected)
    none = attribute_loss(logits.requires_grad_(), torch.full((3, 4), IGNORE_ATTRIBUTE))
    assert float(none.detach()) == 0.0 and none.requires_grad
    with pytest.raises(ValueError, match="3 RoIs of logits, 2 of labels"):
        attribute_loss(logits, labels[:2])


def test_training_step_adds_the_attribute_loss_and_its_gradients_reach_the_backbone(tmp_path):
    split = load_coco_split(with_attributes(write_coco_world(tmp_path, "train", 2, seed=0)), tmp_path / "images")
    torch.manual_seed(0)
    model = build_detector({**TINY_ATTR_CFG, "num_attributes": len(ATTRIBUTES)}, num_classes=3).train()
    assert isinstance(model.roi_heads, AttributeRoIHeads)
    images = [d.image.float().div(255.0) for d in split.images]
    targets = [{"boxes": d.boxes, "labels": d.labels, "attributes": d.attributes} for d in split.images]
    losses = model(images, targets)
    assert set(losses) == {"loss_objectness", "loss_rpn_box_reg", "loss_classifier", "loss_box_reg", "loss_attribute"}
    assert float(losses["loss_attribute"].detach()) > 0
    losses["loss_attribute"].backward()
    for name in ("roi_heads.attribute_predictor.attr_score.weight", "roi_heads.attribute_predictor.cls_embedding.weight",
                 "backbone.conv1.weight"):
        grad = dict(model.named_parameters())[name].grad
        assert grad is not None and grad.abs().sum() > 0, name
    with pytest.raises(ValueError, match="needs targets with 'attributes'"):
        model(images, [{"boxes": d.boxes, "labels": d.labels} for d in split.images])
    # eval: torchvision's detections, unchanged by the head
    model.eval()
    with torch.no_grad():
        assert set(model(images)[0]) == {"boxes", "labels", "scores"}


def test_train_detector_with_attributes_saves_the_head_and_vocabulary(tmp_path):
    train_json = with_attributes(write_coco_world(tmp_path, "train", 4, seed=0))
    val_json = with_attributes(write_coco_world(tmp_path, "val", 2, seed=1))
    metrics = train_detector(TINY_ATTR_CFG, train_json, val_json, tmp_path / "images", tmp_path / "det" / "model.pt",
                             tmp_path / "det" / "metrics.json", seed=0)
    assert "loss_attribute" in metrics["final_losses"] and 0.0 <= metrics["attribute_recall"] <= 1.0
    model, meta = load_detector(tmp_path / "det" / "model.pt")
    assert meta["attributes"] == ATTRIBUTES and meta["config"]["num_attributes"] == len(ATTRIBUTES)
    assert model.roi_heads.attribute_predictor.attr_score.out_features == len(ATTRIBUTES) + 1
    # attributes asked for, none in the data: a clear error naming the file
    (tmp_path / "plain").mkdir()
    plain = write_coco_world(tmp_path / "plain", "train", 2, seed=0)
    with pytest.raises(ValueError, match=r"instances_train\.json: detector\.attribute_loss_weight is 0\.5, but the "
                                         r"file has no 'attributes' vocabulary"):
        train_detector(TINY_ATTR_CFG, plain, plain, tmp_path / "plain" / "images", tmp_path / "x.pt",
                       tmp_path / "x.json", seed=0)
