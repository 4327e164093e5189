"""Detector stage: RoI selection rule, AP metric, C4 backbone, extraction to parquet, training."""

from __future__ import annotations

import io
import json
import tarfile
from types import SimpleNamespace

import numpy as np
import pyarrow.parquet as pq
import pytest
from conftest import TINY_DETECTOR_CFG, load_script
import torch
from PIL import Image, ImageDraw
from torchvision.ops import box_iou, roi_align

from vlbert_core.images import DEFAULT_MAX_PIXELS as MAX_PIXELS
from vlbert_core.detector import (
    average_precision,
    build_detector,
    build_resnet_c4,
    classify_boxes,
    detect_rois,
    evaluate_ap50,
    extract_rois_to_parquet,
    load_detector,
    read_cc_shard,
    select_rois,
    train_detector,
    visual_state_dict,
)
from vlbert_core.detector.extract import run_detector
from vlbert_core.detector.images import decode_image
from vlbert_core.detector.metrics import ImageDetections, ImageGroundTruth
from vlbert_core.detector.train import load_coco_split
from vlbert_core.rois import RoIParquetWriter, read_rois, read_rois_metadata

torch.set_num_threads(1)

TINY_CFG = {**TINY_DETECTOR_CFG, "train": {"steps": 3, "batch_size": 2, "lr": 0.01, "weight_decay": 0.0001}}
SHAPE_COLOURS = {1: (220, 30, 30), 2: (30, 200, 40), 3: (40, 60, 230)}


# ---------------------------------------------------------------- helpers


def grid_boxes(n: int, size: float = 10.0, step: float = 20.0) -> torch.Tensor:
    """n disjoint boxes on a grid, so NMS between them never fires."""
    cols = int(np.ceil(np.sqrt(n)))
    out = [[(i % cols) * step, (i // cols) * step, (i % cols) * step + size, (i // cols) * step + size] for i in range(n)]
    return torch.tensor(out, dtype=torch.float32)


def scores_from_fg(fg: torch.Tensor) -> torch.Tensor:
    """[P, K] foreground scores -> [P, K+1] rows with background taking the remainder."""
    return torch.cat([1.0 - fg.sum(1, keepdim=True), fg], dim=1)


def reference_select(boxes_per_class, class_scores, score_threshold, min_boxes, max_boxes, nms_iou):
    """Direct, slow statement of the rule: greedy per-class NMS over every candidate."""
    num_p, num_k = boxes_per_class.shape[:2]
    cands = [(float(class_scores[p, k + 1]), p, k) for p in range(num_p) for k in range(num_k)]
    ranked = sorted(range(len(cands)), key=lambda i: (-cands[i][0], i))
    survivors = []
    for i in ranked:
        _, p, k = cands[i]
        box = boxes_per_class[p, k][None]
        if all(not (cands[j][2] == k and box_iou(box, boxes_per_class[cands[j][1], k][None]).item() > nms_iou)
               for j in survivors):
            survivors.append(i)
    passing = [i for i in survivors if cands[i][0] > score_threshold]
    if len(passing) >= min_boxes:
        chosen = passing[:max_boxes]
    else:
        chosen = survivors[:min_boxes]
        if len(chosen) < min_boxes:
            chosen += [i for i in ranked if i not in survivors][: min_boxes - len(chosen)]
        chosen = sorted(chosen, key=ranked.index)
    return [(cands[i][1], cands[i][2] + 1) for i in chosen]


def draw_scene(rng: np.random.Generator, size: int = 64, max_objects: int = 3):
    """A noisy background with 1..max_objects filled shapes; returns (PIL image, [(x1,y1,x2,y2,label)])."""
    background = rng.integers(90, 160, size=(size, size, 3), dtype=np.uint8)
    image = Image.fromarray(background)
    draw = ImageDraw.Draw(image)
    objects = []
    for _ in range(int(rng.integers(1, max_objects + 1))):
        label = int(rng.integers(1, 4))
        w, h = (int(v) for v in rng.integers(size // 5, size // 2, size=2))
        x1, y1 = int(rng.integers(0, size - w)), int(rng.integers(0, size - h))
        box = (x1, y1, x1 + w, y1 + h)
        if label == 2:
            draw.ellipse(box, fill=SHAPE_COLOURS[label])
        else:
            draw.rectangle((x1, y1, x1 + w - 1, y1 + h - 1), fill=SHAPE_COLOURS[label])
        objects.append((*box, label))
    return image, objects


def write_coco_world(root, split: str, num_images: int, seed: int) -> str:
    rng = np.random.default_rng(seed)
    images_dir = root / "images"
    images_dir.mkdir(exist_ok=True)
    coco = {"images": [], "annotations": [],
            "categories": [{"id": 1, "name": "box"}, {"id": 2, "name": "ball"}, {"id": 3, "name": "tile"}]}
    for i in range(num_images):
        image, objects = draw_scene(rng)
        file_name = f"{split}_{i:04d}.jpg"
        image.save(images_dir / file_name, quality=92)
        coco["images"].append({"id": i, "file_name": file_name, "width": 64, "height": 64})
        for x1, y1, x2, y2, label in objects:
            coco["annotations"].append({"id": len(coco["annotations"]), "image_id": i, "category_id": label,
                                        "bbox": [x1, y1, x2 - x1, y2 - y1], "area": (x2 - x1) * (y2 - y1),
                                        "iscrowd": 0})
    path = root / f"instances_{split}.json"
    path.write_text(json.dumps(coco))
    return str(path)


def jpeg_bytes(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="JPEG")
    return buffer.getvalue()


@pytest.fixture(scope="module")
def tiny_detector():
    torch.manual_seed(0)
    return build_detector(TINY_CFG, num_classes=3).eval()


# ---------------------------------------------------------------- selection rule


def test_all_low_scores_give_exactly_min_boxes():
    fg = torch.full((30, 3), 0.1) + torch.linspace(0, 0.1, 90).reshape(30, 3)
    boxes = grid_boxes(30)[:, None, :].expand(30, 3, 4).clone()
    boxes[:, 1] += 200  # classes 1..3 at distinct places; only same-class overlap could suppress
    boxes[:, 2] += 400
    out = select_rois(boxes, scores_from_fg(fg), score_threshold=0.5, min_boxes=10, max_boxes=100, nms_iou=0.3)
    assert len(out) == 10
    assert torch.all(out.scores < 0.5)
    assert torch.all(out.scores[:-1] >= out.scores[1:])
    assert torch.allclose(out.scores, torch.sort(fg.reshape(-1), descending=True).values[:10])


def test_more_than_max_passing_gives_exactly_max_boxes():
    num = 150
    fg = torch.zeros(num, 2)
    fg[:, 0] = torch.linspace(0.6, 0.95, num)
    out = select_rois(grid_boxes(num)[:, None, :].repeat(1, 2, 1), scores_from_fg(fg),
                      score_threshold=0.5, min_boxes=10, max_boxes=100, nms_iou=0.3)
    assert len(out) == 100
    assert torch.allclose(out.scores, torch.sort(fg[:, 0], descending=True).values[:100])
    assert torch.all(out.class_ids == 1)


def test_passing_boxes_between_min_and_max_are_all_kept_and_only_they():
    fg = torch.zeros(40, 1)
    fg[:25, 0] = 0.8
    fg[25:, 0] = 0.3
    out = select_rois(grid_boxes(40)[:, None, :], scores_from_fg(fg), score_threshold=0.5, min_boxes=10,
                      max_boxes=100, nms_iou=0.3)
    assert len(out) == 25 and torch.all(out.scores > 0.5)


def test_nms_suppresses_same_class_overlaps_but_not_cross_class():
    box = torch.tensor([10.0, 10.0, 40.0, 40.0])
    boxes = box.expand(3, 2, 4).clone()
    # proposals 0 and 1 both say class 1 on the same box; proposal 2 says class 2 on it
    scores = torch.tensor([[0.1, 0.8, 0.1], [0.2, 0.7, 0.1], [0.1, 0.2, 0.7]])
    out = select_rois(boxes, scores, score_threshold=0.5, min_boxes=1, max_boxes=100, nms_iou=0.3)
    assert out.class_ids.tolist() == [1, 2]
    assert torch.allclose(out.scores, torch.tensor([0.8, 0.7]))
    # the two class-1 candidates at IoU 0.5 < nms_iou=0.6 both survive
    shifted = boxes.clone()
    shifted[1] = torch.tensor([10.0, 20.0, 40.0, 50.0])  # IoU with box = 20*30 / (2*900 - 600) = 0.5
    out = select_rois(shifted, scores, score_threshold=0.5, min_boxes=1, max_boxes=100, nms_iou=0.6)
    assert out.class_ids.tolist() == [1, 1, 2]  # the 0.7 tie goes to the lower proposal index


def test_too_few_survivors_are_topped_up_with_suppressed_candidates_by_score():
    boxes = torch.tensor([5.0, 5.0, 30.0, 30.0]).expand(6, 1, 4).clone()
    fg = torch.tensor([[0.3], [0.9], [0.2], [0.6], [0.4], [0.1]])
    out = select_rois(boxes, scores_from_fg(fg), score_threshold=0.5, min_boxes=4, max_boxes=100, nms_iou=0.3)
    assert torch.allclose(out.scores, torch.tensor([0.9, 0.6, 0.4, 0.3]))
    # fewer candidates than min_boxes: all of them
    out = select_rois(boxes[:3], scores_from_fg(fg[:3]), score_threshold=0.5, min_boxes=10, max_boxes=100, nms_iou=0.3)
    assert len(out) == 3


def test_ties_are_broken_by_proposal_then_class():
    boxes = grid_boxes(4)[:, None, :].repeat(1, 3, 1)
    boxes[:, 1] += 100
    boxes[:, 2] += 200
    fg = torch.full((4, 3), 0.25)
    out = select_rois(boxes, scores_from_fg(fg), score_threshold=0.5, min_boxes=5, max_boxes=100, nms_iou=0.3)
    expected = [(0, 1), (0, 2), (0, 3), (1, 1), (1, 2)]
    assert out.class_ids.tolist() == [k for _, k in expected]
    assert torch.equal(out.boxes, torch.stack([boxes[p, k - 1] for p, k in expected]))
    again = select_rois(boxes, scores_from_fg(fg), score_threshold=0.5, min_boxes=5, max_boxes=100, nms_iou=0.3)
    assert torch.equal(out.boxes, again.boxes)


def test_class_scores_of_the_proposal_are_carried_through():
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(20, 5, generator=gen) * 3
    scores = logits.softmax(-1)
    boxes = grid_boxes(20)[:, None, :].repeat(1, 4, 1) + torch.arange(4).view(1, 4, 1) * 500.0
    out = select_rois(boxes, scores, score_threshold=0.5, min_boxes=10, max_boxes=100, nms_iou=0.3)
    for box, cls, score, row in zip(out.boxes, out.class_ids, out.scores, out.class_scores):
        proposal = int(((boxes[:, cls - 1] == box).all(1)).nonzero()[0])
        assert torch.equal(row, scores[proposal])
        assert row[cls] == score


@pytest.mark.parametrize("seed", range(6))
def test_selection_matches_reference_rule_on_random_overlapping_detections(seed):
    gen = torch.Generator().manual_seed(seed)
    num_p, num_k = 40, 4
    xy = torch.rand(num_p, num_k, 2, generator=gen) * 60
    wh = torch.rand(num_p, num_k, 2, generator=gen) * 40 + 5
    boxes = torch.cat([xy, xy + wh], dim=-1)
    scores = (torch.randn(num_p, num_k + 1, generator=gen) * (2.5 if seed % 2 else 0.7)).softmax(-1)
    # quantised scores create ties, which the reference breaks by (proposal, class) order
    scores = torch.round(scores * 20) / 20
    kwargs = {"score_threshold": 0.5, "min_boxes": 10, "max_boxes": 12, "nms_iou": 0.3}
    out = select_rois(boxes, scores, **kwargs)
    expected = reference_select(boxes, scores, **kwargs)
    got = [(int(((boxes[:, k - 1] == b).all(1)).nonzero()[0]), int(k)) for b, k in zip(out.boxes, out.class_ids)]
    assert got == expected
    assert 10 <= len(out) <= 12


def test_select_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match="class_scores must be"):
        select_rois(torch.zeros(3, 2, 4), torch.zeros(3, 2), nms_iou=0.3)


# ---------------------------------------------------------------- AP metric


def test_average_precision_known_values():
    assert average_precision([True, True], 2) == pytest.approx(1.0)
    assert average_precision([True], 2) == pytest.approx(0.5)  # one of two objects missed
    assert average_precision([False, True], 1) == pytest.approx(0.5)  # false positive ranked first
    assert average_precision([True, False, True], 3) == pytest.approx(1 / 3 + (1 / 3) * (2 / 3))
    assert average_precision([], 4) == 0.0


def test_evaluate_ap50_perfect_and_one_miss():
    gt = [ImageGroundTruth(np.array([[0, 0, 10, 10], [20, 20, 40, 40]], float), np.array([1, 2])),
          ImageGroundTruth(np.array([[5, 5, 25, 25]], float), np.array([1]))]
    perfect = [ImageDetections(np.array([[0, 0, 10, 10], [20, 20, 40, 40]], float), np.array([0.9, 0.8]), np.array([1, 2])),
               ImageDetections(np.array([[6, 5, 25, 26]], float), np.array([0.7]), np.array([1]))]
    result = evaluate_ap50(perfect, gt, num_classes=3)
    assert result["ap50"] == pytest.approx(1.0)
    assert result["per_class"] == {1: pytest.approx(1.0), 2: pytest.approx(1.0), 3: None}
    # miss the class-1 object of image 2, and hit class 2 only with a shifted box at IoU < 0.5
    missed = [ImageDetections(np.array([[0, 0, 10, 10], [30, 30, 50, 50]], float), np.array([0.9, 0.8]), np.array([1, 2])),
              ImageDetections(np.zeros((0, 4)), np.zeros(0), np.zeros(0, int))]
    result = evaluate_ap50(missed, gt, num_classes=3)
    assert result["per_class"][1] == pytest.approx(0.5)
    assert result["per_class"][2] == pytest.approx(0.0)
    assert result["ap50"] == pytest.approx(0.25)
    # a duplicate detection of a matched object is a false positive
    duplicate = [ImageDetections(np.array([[0, 0, 10, 10], [0, 0, 10, 10]], float), np.array([0.9, 0.95]), np.array([1, 1])),
                 ImageDetections(np.array([[5, 5, 25, 25]], float), np.array([0.5]), np.array([1]))]
    assert evaluate_ap50(duplicate, gt, num_classes=1)["per_class"][1] == pytest.approx(1 / 2 + (1 / 2) * (2 / 3))


# ---------------------------------------------------------------- backbone


def test_resnet_c4_strides_and_visual_state_dict(tiny_detector):
    body, head, body_out, head_out = build_resnet_c4(TINY_CFG["backbone"])
    feature = body(torch.rand(2, 3, 64, 96))
    assert feature.shape == (2, body_out, 4, 6)  # stride 16
    assert head(torch.rand(5, body_out, 14, 14)).shape == (5, head_out)
    parts = visual_state_dict(tiny_detector.state_dict())
    body.load_state_dict(parts["body"])
    head.load_state_dict(parts["head"])
    body.eval()
    head.eval()
    x = torch.rand(1, 3, 64, 64)
    with torch.no_grad():
        assert torch.allclose(body(x), tiny_detector.backbone(x))
        rois = torch.rand(3, body_out, 14, 14)
        assert torch.allclose(head(rois), tiny_detector.roi_heads.box_head(rois))


def test_resnet_c4_torchvision_depth_has_standard_widths():
    body, head, body_out, head_out = build_resnet_c4({"depth": 18})
    assert (body_out, head_out) == (256, 512)
    assert list(dict(body.named_children())) == ["conv1", "bn1", "relu", "maxpool", "layer1", "layer2", "layer3"]
    with pytest.raises(ValueError, match="depth"):
        build_resnet_c4({"depth": 17})


def _bottleneck_by_hand(block, x):
    """One torchvision Bottleneck computed with F.conv2d / F.batch_norm from its own tensors (eval BN)."""
    import torch.nn.functional as F

    def conv(m, t):
        return F.conv2d(t, m.weight, None, m.stride, m.padding, m.dilation)

    def bn(m, t):
        return F.batch_norm(t, m.running_mean, m.running_var, m.weight, m.bias, False, 0.0, m.eps)

    out = F.relu(bn(block.bn1, conv(block.conv1, x)))
    out = F.relu(bn(block.bn2, conv(block.conv2, out)))
    out = bn(block.bn3, conv(block.conv3, out))
    shortcut = x if block.downsample is None else bn(block.downsample[1], conv(block.downsample[0], x))
    return F.relu(out + shortcut)


def test_stride_in_1x1_moves_the_stride_of_each_first_bottleneck():
    cfg = {"stage_widths": [4, 4, 8, 8], "blocks_per_stage": [1, 2, 1, 1], "block": "bottleneck"}
    body, head, *_ = build_resnet_c4({**cfg, "stride_in_1x1": True})
    for stage in (body.layer2, body.layer3, head.layer4):
        assert stage[0].conv1.stride == (2, 2) and stage[0].conv2.stride == (1, 1)
    assert body.layer2[1].conv1.stride == (1, 1)  # later blocks do not stride
    plain_body, *_ = build_resnet_c4(cfg)
    assert plain_body.layer2[0].conv1.stride == (1, 1) and plain_body.layer2[0].conv2.stride == (2, 2)
    # Same weights, same output size (stride 16) either way.
    plain_body.load_state_dict(body.state_dict())
    x = torch.rand(1, 3, 64, 48)
    body.eval(), plain_body.eval()
    with torch.no_grad():
        assert body(x).shape == plain_body(x).shape == (1, 32, 4, 3)
        # One bottleneck with its stride in the 1x1 against the same arithmetic done by hand: a 1x1 conv
        # with stride 2 samples every other pixel before the 3x3, which the torchvision order does after.
        block = body.layer2[0]
        block_in = torch.randn(2, block.conv1.in_channels, 9, 7)
        for m in block.modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                m.running_mean.uniform_(-0.5, 0.5), m.running_var.uniform_(0.5, 2.0)
                m.weight.data.uniform_(0.5, 1.5), m.bias.data.uniform_(-0.2, 0.2)
        expected = _bottleneck_by_hand(block, block_in)
        assert expected.shape == (2, 16, 5, 4)
        assert torch.allclose(block(block_in), expected, atol=1e-5)
    with pytest.raises(ValueError, match="bottleneck"):
        build_resnet_c4({"stage_widths": [4, 4, 8, 8], "blocks_per_stage": [1, 1, 1, 1], "block": "basic",
                         "stride_in_1x1": True})


def test_dilated_head_keeps_a_14x14_roi_at_14x14_with_the_same_weights():
    cfg = {"stage_widths": [4, 4, 8, 8], "blocks_per_stage": [1, 1, 1, 2], "block": "bottleneck",
           "stride_in_1x1": True}
    _, head, body_out, head_out = build_resnet_c4({**cfg, "head_dilation": 2})
    _, strided_head, *_ = build_resnet_c4(cfg)
    strided_head.load_state_dict(head.state_dict())  # no shape changes: one checkpoint serves both
    rois = torch.rand(3, body_out, 14, 14)
    head.eval(), strided_head.eval()
    with torch.no_grad():
        assert head.layer4(rois).shape[-2:] == (14, 14)
        assert strided_head.layer4(rois).shape[-2:] == (7, 7)
        assert head(rois).shape == (3, head_out)
        for block in head.layer4:
            assert block.conv2.dilation == (2, 2) and block.conv2.padding == (2, 2)
            assert block.conv1.stride == block.conv2.stride == (1, 1)
            assert _bottleneck_by_hand(block, rois if block is head.layer4[0] else head.layer4[0](rois)).shape[-1] == 14
    with pytest.raises(ValueError, match="head_dilation"):
        build_resnet_c4({**cfg, "head_dilation": 3})


FOLD_CFGS = {
    "bottleneck": {"stage_widths": [4, 4, 8, 8], "blocks_per_stage": [1, 2, 2, 2], "block": "bottleneck",
                   "stride_in_1x1": True, "head_dilation": 2},
    "basic": {"stage_widths": [4, 4, 8, 8], "blocks_per_stage": [1, 2, 2, 2], "block": "basic"},
}


def _roi_features(feature_map):
    from vlbert_core.detector.resnet_c4 import FEATURE_STRIDE, ROI_ALIGNED, ROI_OUTPUT_SIZE, ROI_SAMPLING_RATIO

    rois = torch.tensor([[0, 0, 0, 40, 30], [1, 8, 4, 60, 44], [1, 0, 0, 63, 47]], dtype=feature_map.dtype)
    return roi_align(feature_map, rois, ROI_OUTPUT_SIZE, 1 / FEATURE_STRIDE, ROI_SAMPLING_RATIO, ROI_ALIGNED)


def _folded(body, head, images):
    return head(_roi_features(body(images)))


def _unfolded(body, head, images):
    """The same modules run as torchvision runs them, each BatchNorm after its convolution (before conv_bn)."""
    from torchvision.models import resnet as tv_resnet

    def blocks(stage, x):
        for block in stage:
            x = (tv_resnet.Bottleneck if hasattr(block, "bn3") else tv_resnet.BasicBlock).forward(block, x)
        return x

    x = body.maxpool(body.relu(body.bn1(body.conv1(images))))
    x = blocks(body.layer3, blocks(body.layer2, blocks(body.layer1, x)))
    return head.flatten(head.avgpool(blocks(head.layer4, _roi_features(x))))


def _give_trained_like_statistics(bn: torch.nn.BatchNorm2d) -> None:
    """Running statistics and affine weights away from their initial 0 / 1, as a trained network's are."""
    bn.running_mean.normal_(0, 0.2)
    bn.running_var.uniform_(0.5, 2.0)
    bn.weight.data.uniform_(0.5, 1.5)
    bn.bias.data.normal_(0, 0.1)


def _frozen_bn_network(cfg):
    """A ResNet-C4 as VL-BERT trains it: every BatchNorm in eval mode with trained-like statistics and frozen,
    stages 1-2 frozen, stages 3-5 trained."""
    torch.manual_seed(0)
    body, head, *_ = build_resnet_c4(cfg)
    for module in [*body.modules(), *head.modules()]:
        if isinstance(module, torch.nn.BatchNorm2d):
            _give_trained_like_statistics(module)
            module.eval().requires_grad_(False)
    for name in ("conv1", "layer1"):
        body.get_submodule(name).requires_grad_(False)
    return body, head


@pytest.mark.parametrize("block", sorted(FOLD_CFGS))
def test_frozen_batchnorm_folded_into_the_convolutions_trains_to_the_same_weights(block):
    """conv_bn: with its BatchNorms in eval mode, the network computes what convolution-then-BatchNorm computes,
    and 4 SGD steps through it end at the same weights. In float64: in float32 a pre-activation within rounding
    of zero can take the other side of a ReLU on one path (it does for the bottleneck network at step 2), and
    the two trajectories then part by far more than rounding."""
    import copy

    body, head = (network.double() for network in _frozen_bn_network(FOLD_CFGS[block]))
    plain_body, plain_head = copy.deepcopy(body), copy.deepcopy(head)
    images = torch.randn(2, 3, 48, 64, dtype=torch.float64)
    convs_run = []
    for module in [*body.modules(), *head.modules()]:
        if isinstance(module, torch.nn.Conv2d):
            module.register_forward_pre_hook(lambda module, args: convs_run.append(module))
    torch.testing.assert_close(_folded(body, head, images), _unfolded(plain_body, plain_head, images),
                               rtol=1e-12, atol=1e-12)
    assert convs_run == []   # folded: every convolution ran with its BatchNorm inside, none on its own
    trained = [[p for p in [*b.parameters(), *h.parameters()] if p.requires_grad]
               for b, h in ((body, head), (plain_body, plain_head))]
    assert len(trained[0]) == len(trained[1]) > 0
    initial = [p.detach().clone() for p in trained[0]]
    optimizers = [torch.optim.SGD(params, lr=0.1) for params in trained]
    for _ in range(4):
        for forward, network, optimizer in zip((_folded, _unfolded), ((body, head), (plain_body, plain_head)),
                                               optimizers):
            optimizer.zero_grad()
            forward(*network, images).pow(2).mean().backward()
            optimizer.step()
    for (name, p), q in zip([*body.named_parameters(), *head.named_parameters()],
                            [*plain_body.parameters(), *plain_head.parameters()]):
        torch.testing.assert_close(p, q, rtol=1e-10, atol=1e-12, msg=name)
    assert all(not torch.equal(p, p0) for p, p0 in zip(trained[0], initial))   # every trained weight moved


@pytest.mark.parametrize("image_side, scaled", [(2, "output"), (32, "weights")])
def test_conv_bn_scales_the_smaller_side(image_side, scaled):
    """The fold scales the output where it has fewer positions than the weights have values per output channel
    (a 2 x 2 map against 8 x 3 x 3), else the weights; either way the output and every gradient are those of
    convolution-then-BatchNorm."""
    from vlbert_core.detector.resnet_c4 import conv_bn, output_positions

    torch.manual_seed(0)
    conv = torch.nn.Conv2d(8, 16, 3, padding=1, bias=False).double()
    bn = torch.nn.BatchNorm2d(16).double().eval()
    _give_trained_like_statistics(bn)
    x = torch.randn(1, 8, image_side, image_side, dtype=torch.float64, requires_grad=True)
    assert (output_positions(conv, x) < conv.weight[0].numel()) == (scaled == "output")
    grad_out = torch.randn(1, 16, image_side, image_side, dtype=torch.float64)
    results = []
    for forward in (lambda: conv_bn(conv, bn, x), lambda: bn(conv(x))):
        out = forward()
        results.append((out, *torch.autograd.grad(out, (x, conv.weight, bn.weight, bn.bias), grad_out)))
    for ours, reference in zip(*results):
        torch.testing.assert_close(ours, reference, rtol=1e-12, atol=1e-12)


def test_a_batchnorm_in_training_mode_is_not_folded():
    """The detector trains its BatchNorms: they normalise by batch statistics and update their running averages,
    exactly as in torchvision's blocks."""
    import copy

    torch.manual_seed(0)
    body, head, *_ = build_resnet_c4(FOLD_CFGS["bottleneck"])
    plain_body, plain_head = copy.deepcopy(body), copy.deepcopy(head)
    images = torch.randn(2, 3, 48, 64)
    assert torch.equal(_folded(body, head, images), _unfolded(plain_body, plain_head, images))
    for (name, ours), theirs in zip([*body.named_buffers(), *head.named_buffers()],
                                    [*plain_body.buffers(), *plain_head.buffers()]):
        assert torch.equal(ours, theirs), name


def test_pixel_formats_on_a_known_pixel():
    from vlbert_core.detector.pixels import normalise_pixels

    pixel = torch.tensor([1.0, 0.5, 0.0]).view(3, 1, 1)  # RGB in [0, 1]
    caffe = normalise_pixels(pixel, "bgr255_caffe").flatten().tolist()
    # BGR order, 0-255, minus the Caffe means (B 102.9801, G 115.9465, R 122.7717), std 1
    assert caffe == pytest.approx([0.0 - 102.9801, 127.5 - 115.9465, 255.0 - 122.7717], abs=1e-4)
    imagenet = normalise_pixels(pixel, "rgb_imagenet").flatten().tolist()
    assert imagenet == pytest.approx([(1.0 - 0.485) / 0.229, (0.5 - 0.456) / 0.224, (0.0 - 0.406) / 0.225], abs=1e-5)
    with pytest.raises(ValueError, match="pixel_format"):
        normalise_pixels(pixel, "yuv")


def test_detector_transform_normalises_with_the_backbone_pixel_format():
    from vlbert_core.detector.pixels import normalise_pixels

    cfg = {**TINY_CFG, "backbone": {**TINY_CFG["backbone"], "pixel_format": "bgr255_caffe"}}
    model = build_detector(cfg, num_classes=2)
    image = torch.rand(3, 20, 30)
    assert torch.equal(model.transform.normalize(image), normalise_pixels(image, "bgr255_caffe"))
    default = build_detector(TINY_CFG, num_classes=2)
    mean = torch.tensor([0.485, 0.456, 0.406]).view(3, 1, 1)
    std = torch.tensor([0.229, 0.224, 0.225]).view(3, 1, 1)
    assert torch.equal(default.transform.normalize(image), (image - mean) / std)


# ---------------------------------------------------------------- extraction


def test_detect_rois_gives_bounded_boxes_inside_the_image(tiny_detector):
    rng = np.random.default_rng(0)
    square, _ = draw_scene(rng)
    wide = square.resize((80, 48))
    images = [torch.from_numpy(np.array(im)).permute(2, 0, 1).float() / 255 for im in (square, wide)]
    kwargs = {"score_threshold": 0.5, "min_boxes": 10, "max_boxes": 100, "nms_iou": 0.3}
    results = detect_rois(tiny_detector, images, kwargs)
    assert len(results) == 2
    for sel, img in zip(results, images):
        height, width = img.shape[-2:]
        assert 10 <= len(sel) <= 100
        assert torch.all(sel.boxes[:, 0] >= 0) and torch.all(sel.boxes[:, 2] <= width + 1e-3)
        assert torch.all(sel.boxes[:, 1] >= 0) and torch.all(sel.boxes[:, 3] <= height + 1e-3)
        assert torch.all(sel.boxes[:, 2] >= sel.boxes[:, 0]) and torch.all(sel.boxes[:, 3] >= sel.boxes[:, 1])
        assert sel.class_scores.shape == (len(sel), 4)
        assert torch.allclose(sel.class_scores.sum(1), torch.ones(len(sel)), atol=1e-5)
        assert torch.all(sel.scores[:-1] >= sel.scores[1:])
        assert torch.allclose(sel.class_scores.gather(1, sel.class_ids[:, None])[:, 0], sel.scores)
    assert tiny_detector.training is False


def test_rois_rule_bottom_up_keeps_the_proposal_boxes_the_released_rule_selects(tiny_detector):
    """rois.rule bottom_up: detect_rois keeps what select_rois_bottom_up picks from the RPN's proposals (in the
    input image's pixels) and each proposal's class scores; an unknown rule is refused naming the key."""
    from vlbert_core.detector.extract import RoISelection, run_detector
    from vlbert_core.detector.select import select_rois_bottom_up

    rng = np.random.default_rng(1)
    scene, _ = draw_scene(rng)
    image = torch.from_numpy(np.array(scene.resize((80, 48)))).permute(2, 0, 1).float() / 255
    section = {"rule": "bottom_up", "score_threshold": 0.2, "min_boxes": 4, "max_boxes": 100, "nms_iou": 0.3}
    kwargs = RoISelection.from_config(section).kwargs()
    assert kwargs == section
    got = detect_rois(tiny_detector, [image], kwargs)[0]
    _, scores, proposals = run_detector(tiny_detector, [image], with_proposals=True)[0]
    assert float(proposals[:, 2].max()) <= 80 + 1e-3 and float(proposals[:, 3].max()) <= 48 + 1e-3
    expected = select_rois_bottom_up(proposals, scores, score_threshold=0.2, min_boxes=4, max_boxes=100,
                                     nms_iou=0.3, legacy_iou=False)
    assert 4 <= len(got) <= len(proposals)
    torch.testing.assert_close(got.boxes, expected.boxes.cpu())
    torch.testing.assert_close(got.class_scores, expected.class_scores.cpu())
    assert torch.equal(got.class_ids, expected.class_ids.cpu())
    # the kept boxes are proposals, not regressed boxes
    assert all(bool((proposals - box).abs().max(dim=1).values.min() < 1e-4) for box in got.boxes)
    per_class = detect_rois(tiny_detector, [image], {**section, "rule": "per_class"})[0]
    assert not torch.equal(per_class.boxes, got.boxes)
    with pytest.raises(ValueError, match=r"rois\.rule must be one of per_class, bottom_up, not 'released'"):
        RoISelection.from_config({**section, "rule": "released"})


def _canonical_nms(boxes, scores, idxs, iou, k):
    """Greedy NMS by hand: boxes in order of score, equal scores by index; the first k survivors."""
    order = sorted(range(len(scores)), key=lambda i: (-float(scores[i]), i))
    overlaps = (box_iou(boxes, boxes) > iou) & (idxs[:, None] == idxs[None, :])
    suppressed = torch.zeros(len(scores), dtype=torch.bool)
    kept: list[int] = []
    for i in order:
        if not suppressed[i]:
            kept.append(i)
            suppressed |= overlaps[i]
    return torch.tensor(kept[:k], dtype=torch.long)


@pytest.mark.parametrize("seed", range(6))
def test_nms_stopped_at_the_first_k_survivors_keeps_what_full_nms_keeps_first(seed):
    from torchvision.ops import batched_nms

    from vlbert_core.detector.faster_rcnn import first_nms_survivors

    g = torch.Generator().manual_seed(seed)
    n = [300, 1200, 2000, 40, 900, 1500][seed]
    if seed % 2:   # spread out: most boxes survive
        corners = torch.rand(n, 2, generator=g) * 200
        boxes = torch.cat([corners, corners + 8 + torch.rand(n, 2, generator=g) * 60], 1)
    else:          # jittered copies of 25 objects, as proposals are: one survives per object and class, so
        # the top 2k boxes rarely hold k survivors and the search widens
        objects = torch.cat([torch.rand(25, 2, generator=g) * 200, 20 + torch.rand(25, 2, generator=g) * 40], 1)
        boxes = objects[torch.randint(0, 25, (n,), generator=g)] + torch.rand(n, 4, generator=g) * 2
        boxes[:, 2:] += boxes[:, :2]
    idxs = torch.randint(0, 1 + seed % 3, (n,), generator=g)
    for k in (1, 20, 37, 300, n):          # few, many, and more than survive
        scores = torch.rand(n, generator=g)   # distinct: full NMS's order is defined, so equal to the index
        assert torch.equal(first_nms_survivors(boxes, scores, idxs, 0.5, k), batched_nms(boxes, scores, idxs, 0.5)[:k])
        # Equal scores (an RPN's sigmoid saturates at 1.0): ties in score order, then by index.
        tied = (scores * 4).floor() / 4
        assert torch.equal(first_nms_survivors(boxes, tied, idxs, 0.5, k), _canonical_nms(boxes, tied, idxs, 0.5, k))


def test_the_rpn_proposes_what_torchvision_s_proposes(tiny_detector):
    from torchvision.models.detection.rpn import RegionProposalNetwork

    from vlbert_core.detector.faster_rcnn import TopProposalsRPN

    assert isinstance(tiny_detector.rpn, TopProposalsRPN)
    rpn = tiny_detector.rpn
    g = torch.Generator().manual_seed(0)
    anchors = 1500
    corners = torch.rand(2, anchors, 2, generator=g) * 60
    proposals = torch.cat([corners, corners + 2 + torch.rand(2, anchors, 2, generator=g) * 30], -1)
    objectness = torch.randn(2 * anchors, 1, generator=g) * 3
    args = (proposals, objectness, [(64, 64), (48, 80)], [anchors])
    for training in (True, False):   # post-NMS top-n of training and of test time
        rpn.train(training)
        ours, theirs = rpn.filter_proposals(*args), RegionProposalNetwork.filter_proposals(rpn, *args)
        for got, want in zip(ours, theirs):
            assert len(got) == len(want) == 2
            for a, b in zip(got, want):
                assert torch.equal(a, b)
    rpn.eval()


def test_parquet_round_trip_with_a_corrupt_image(tiny_detector, tmp_path):
    rng = np.random.default_rng(1)
    good, _ = draw_scene(rng)
    other, _ = draw_scene(rng)
    other_path = tmp_path / "other.png"
    other.save(other_path)
    truncated = jpeg_bytes(good)[:200]
    samples = [("a", jpeg_bytes(good)), ("broken", b"this is not an image"), ("c", str(other_path)),
               ("cut", truncated), ("gone", str(tmp_path / "missing.jpg"))]
    kwargs = {"score_threshold": 0.5, "min_boxes": 10, "max_boxes": 100, "nms_iou": 0.3}
    out = tmp_path / "rois" / "shard.parquet"
    counts = extract_rois_to_parquet(tiny_detector, samples, out, batch_size=2, select_kwargs=kwargs, num_workers=0)
    assert counts == {"rows": 5, "ok": 2, "failed": 3}
    records = read_rois(out)
    assert list(records) == ["a", "broken", "c", "cut", "gone"]
    assert records["broken"].status == "decode_error"
    assert records["broken"].error.startswith("NotAnImage: image 'broken' cannot be decoded: not in an image format")
    assert records["cut"].status == "decode_error"
    assert records["gone"].status == "missing_file"
    assert records["broken"].boxes.shape == (0, 4) and records["broken"].image_w is None
    expected = detect_rois(tiny_detector, [decode_image(samples[0][1]).float() / 255], kwargs)[0]
    rec = records["a"]
    assert rec.ok and (rec.image_w, rec.image_h) == (64, 64) and rec.num_classes == 4
    assert rec.boxes.shape == (len(expected), 4) and rec.class_scores.shape == (len(expected), 4)
    np.testing.assert_allclose(rec.boxes, expected.boxes.numpy(), atol=1e-4)
    np.testing.assert_allclose(rec.scores, expected.scores.numpy(), atol=1e-5)
    np.testing.assert_array_equal(rec.class_ids, expected.class_ids.numpy())
    np.testing.assert_allclose(rec.class_scores, expected.class_scores.numpy(), atol=1e-3)  # float16
    assert not list(out.parent.glob(".tmp-*"))


def test_extraction_with_a_decoding_worker_matches_in_process_decoding(tiny_detector, tmp_path):
    rng = np.random.default_rng(2)
    samples = [(f"k{i}", jpeg_bytes(draw_scene(rng)[0])) for i in range(3)] + [("bad", b"")]
    kwargs = {"score_threshold": 0.5, "min_boxes": 10, "max_boxes": 100, "nms_iou": 0.3}
    extract_rois_to_parquet(tiny_detector, samples, tmp_path / "w0.parquet", 2, kwargs, num_workers=0)
    extract_rois_to_parquet(tiny_detector, samples, tmp_path / "w1.parquet", 2, kwargs, num_workers=1)
    in_process, in_worker = read_rois(tmp_path / "w0.parquet"), read_rois(tmp_path / "w1.parquet")
    assert list(in_process) == list(in_worker) == ["k0", "k1", "k2", "bad"]
    for key in in_process:
        assert in_process[key].status == in_worker[key].status
        np.testing.assert_array_equal(in_process[key].boxes, in_worker[key].boxes)


def test_an_image_without_proposals_becomes_a_too_few_boxes_row_and_the_others_go_on(tmp_path):
    """An RPN that keeps no proposal on one image (a random detector can) must not fail the whole shard."""
    torch.manual_seed(4)
    model = build_detector(TINY_CFG, num_classes=3).eval()
    rng = np.random.default_rng(5)
    samples = [(f"k{i}", jpeg_bytes(draw_scene(rng)[0])) for i in range(3)]
    real_rpn = model.rpn

    class NoProposalsOnTheSecondImage(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.calls = 0

        def forward(self, image_list, features):
            proposals, losses = real_rpn(image_list, features)
            self.calls += 1
            return ([p if self.calls != 2 else p[:0] for p in proposals], losses)

    model.rpn = NoProposalsOnTheSecondImage()
    boxes, scores = run_detector(model, [torch.rand(3, 64, 80)])[0]
    assert boxes.shape[1:] == (3, 4) and scores.shape[1] == 4
    empty_boxes, empty_scores = run_detector(model, [torch.rand(3, 64, 80)])[0]
    assert empty_boxes.shape == (0, 3, 4) and empty_scores.shape == (0, 4)

    model.rpn.calls = 0
    kwargs = {"score_threshold": 0.5, "min_boxes": 10, "max_boxes": 100, "nms_iou": 0.3}
    counts = extract_rois_to_parquet(model, samples, tmp_path / "r.parquet", 1, kwargs)
    rows = read_rois(tmp_path / "r.parquet")
    assert counts == {"rows": 3, "ok": 2, "failed": 1}
    assert [rows[k].status for k in ("k0", "k1", "k2")] == ["ok", "too_few_boxes", "ok"]
    assert "0 candidate boxes" in rows["k1"].error and "min_boxes is 10" in rows["k1"].error
    assert len(rows["k0"].boxes) >= 10 and len(rows["k2"].boxes) >= 10


def test_classify_boxes_scores_given_boxes_as_the_detector_scores_its_proposals():
    """classify_boxes (the class scores of imported RoIs) must see a box where run_detector sees the
    same box as a proposal, on an image that the transform rescales (48x80 -> 38x64)."""
    torch.manual_seed(3)
    model = build_detector(TINY_CFG, num_classes=3).eval()
    image = torch.rand(3, 48, 80)
    boxes = torch.tensor([[2.0, 3.0, 30.0, 40.0], [40.0, 5.0, 79.0, 47.0], [10.0, 10.0, 12.0, 14.0]])

    class FixedProposals(torch.nn.Module):
        """Stands in for the RPN: `boxes` (original pixels) as the proposals, in resized pixels."""

        def forward(self, image_list, features):
            height, width = image_list.image_sizes[0]
            return [boxes * torch.tensor([width / 80, height / 48] * 2)], {}

    given = classify_boxes(model, [image], [boxes])[0]
    model.rpn = FixedProposals()
    _, as_proposals = run_detector(model, [image])[0]
    assert given.shape == (3, 4)
    torch.testing.assert_close(given, as_proposals, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(given.sum(1), torch.ones(3))


def test_roi_parquet_writer_spans_row_groups_and_writes_nothing_on_error(tmp_path):
    rng = np.random.default_rng(0)
    expected = {}
    out = tmp_path / "rois.parquet"
    with RoIParquetWriter(out, num_classes=3, metadata={"source": "test"}) as writer:
        for i in range(RoIParquetWriter.ROWS_PER_GROUP * 2 + 7):
            key = f"k{i:05d}"
            if i % 97 == 5:
                writer.add_failure(key, "decode_error", f"bad {i}")
                expected[key] = None
                continue
            n = int(rng.integers(10, 15))
            class_scores = rng.dirichlet(np.ones(3), size=n).astype(np.float32)
            boxes = rng.uniform(0, 50, (n, 4)).astype(np.float32)
            writer.add(key, image_w=64, image_h=48, boxes=boxes, scores=class_scores[:, 1:].max(1),
                       class_ids=class_scores[:, 1:].argmax(1).astype(np.int32) + 1, class_scores=class_scores)
            expected[key] = (boxes, class_scores)
        assert not out.exists()  # only the temporary file exists until the block ends
    records = read_rois(out)
    assert list(records) == list(expected)
    for key, value in expected.items():
        if value is None:
            assert records[key].status == "decode_error" and records[key].boxes.shape == (0, 4)
        else:
            np.testing.assert_array_equal(records[key].boxes, value[0])
            np.testing.assert_allclose(records[key].class_scores, value[1], atol=1e-3)
    assert read_rois_metadata(out)["status_counts"] == {"decode_error": 11, "ok": 1020}
    assert pq.ParquetFile(out).metadata.num_row_groups == 3

    with pytest.raises(ValueError, match="duplicate key 'a'"):
        with RoIParquetWriter(tmp_path / "dup.parquet", num_classes=3, metadata={}) as writer:
            writer.add_failure("a", "decode_error", "x")
            writer.add_failure("a", "decode_error", "x")
    assert not list(tmp_path.glob("*dup.parquet"))


def test_read_cc_shard_yields_images_in_order_and_rejects_imageless_samples(tmp_path):
    def add(tar, name, data):
        info = tarfile.TarInfo(name)
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))

    image = jpeg_bytes(Image.new("RGB", (16, 8), (10, 20, 30)))
    good = tmp_path / "train-00000.tar"
    with tarfile.open(good, "w") as tar:
        for key in ("000000001", "000000002"):
            add(tar, f"{key}.jpg", image)
            add(tar, f"{key}.txt", b"a caption")
            add(tar, f"{key}.json", b"{}")
    assert [(k, len(v)) for k, v in read_cc_shard(good)] == [("000000001", len(image)), ("000000002", len(image))]
    bad = tmp_path / "bad.tar"
    with tarfile.open(bad, "w") as tar:
        add(tar, "000000003.txt", b"caption without image")
    with pytest.raises(ValueError, match="000000003.*no image"):
        list(read_cc_shard(bad))
    # webdataset would drop a member without an extension, and keep one of two images of a key
    no_extension = tmp_path / "no_extension.tar"
    with tarfile.open(no_extension, "w") as tar:
        add(tar, "000000004.jpg", image)
        add(tar, "000000005", image)
    with pytest.raises(ValueError, match="'000000005' has no extension"):
        list(read_cc_shard(no_extension))
    twice = tmp_path / "twice.tar"
    with tarfile.open(twice, "w") as tar:
        add(tar, "000000006.jpg", image)
        add(tar, "000000006.jpg", image)
    with pytest.raises(ValueError, match="duplicate file name"):
        list(read_cc_shard(twice))


# ---------------------------------------------------------------- training


def test_train_detector_writes_loadable_model_and_metrics(tmp_path):
    train_json = write_coco_world(tmp_path, "train", 6, seed=0)
    val_json = write_coco_world(tmp_path, "val", 4, seed=1)
    metrics = train_detector(TINY_CFG, train_json, val_json, tmp_path / "images", tmp_path / "det" / "model.pt",
                             tmp_path / "det" / "metrics.json", seed=0)
    saved = json.loads((tmp_path / "det" / "metrics.json").read_text())
    assert saved["steps"] == 3 and saved["num_images"] == 4
    assert set(saved["per_class"]) <= {"box", "ball", "tile"}
    assert saved["ap50"] is None or 0.0 <= saved["ap50"] <= 1.0
    assert metrics["ap50"] == saved["ap50"]
    model, meta = load_detector(tmp_path / "det" / "model.pt")
    assert meta["num_classes"] == 3 and [c["name"] for c in meta["categories"]] == ["box", "ball", "tile"]
    assert not model.training
    # same seed, same weights
    train_detector(TINY_CFG, train_json, val_json, tmp_path / "images", tmp_path / "det2" / "model.pt",
                   tmp_path / "det2" / "metrics.json", seed=0)
    again, _ = load_detector(tmp_path / "det2" / "model.pt")
    for (name, a), b in zip(model.state_dict().items(), again.state_dict().values()):
        assert torch.equal(a, b), name


def test_coco_loader_names_file_and_annotation_on_bad_input(tmp_path):
    path = write_coco_world(tmp_path, "train", 2, seed=0)
    coco = json.loads(open(path).read())
    coco["annotations"][0]["category_id"] = 99
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(coco))
    with pytest.raises(ValueError, match=r"bad\.json: annotations\[0\].*unknown category_id 99"):
        load_coco_split(bad, tmp_path / "images")
    coco["annotations"][0]["category_id"] = 1
    coco["annotations"][0]["bbox"] = [10, 10, 0, 5]
    bad.write_text(json.dumps(coco))
    with pytest.raises(ValueError, match=r"annotations\[0\].*empty or outside"):
        load_coco_split(bad, tmp_path / "images")


# ---------------------------------------------------------------- Snakemake scripts


def test_scripts_train_then_extract_a_shard(tmp_path):
    train_json = write_coco_world(tmp_path, "train", 4, seed=0)
    val_json = write_coco_world(tmp_path, "val", 2, seed=1)
    model_path = tmp_path / "detector" / "model.pt"
    load_script("train_detector").main(SimpleNamespace(
        input=SimpleNamespace(train=train_json, val=val_json),
        output=SimpleNamespace(model=str(model_path), metrics=str(tmp_path / "detector" / "metrics.json")),
        params=SimpleNamespace(detector=TINY_CFG, seed=0, images=str(tmp_path / "images"), max_image_pixels=MAX_PIXELS),
        threads=1, log=[str(tmp_path / "logs" / "train.log")],
    ))
    assert model_path.exists() and "val AP@0.5" in (tmp_path / "logs" / "train.log").read_text()

    rng = np.random.default_rng(5)
    tar_path = tmp_path / "train-00000.tar"
    with tarfile.open(tar_path, "w") as tar:
        for key in ("000000000", "000000001", "000000002"):
            data = jpeg_bytes(draw_scene(rng)[0]) if key != "000000001" else b"\xff\xd8 broken jpeg"
            info = tarfile.TarInfo(f"{key}.jpg")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    out = tmp_path / "rois" / "train-00000.parquet"
    rois_cfg = {"score_threshold": 0.5, "min_boxes": 10, "max_boxes": 100, "nms_iou": 0.3, "batch_size": 2}
    load_script("extract_rois").main(SimpleNamespace(
        input=SimpleNamespace(tar=str(tar_path), model=str(model_path)),
        output=SimpleNamespace(parquet=str(out)),
        params=SimpleNamespace(rois=rois_cfg, device="cpu", max_image_pixels=MAX_PIXELS), threads=1, log=[str(tmp_path / "logs" / "rois.log")],
    ))
    records = read_rois(out)
    assert [r.status for r in records.values()] == ["ok", "decode_error", "ok"]
    assert all(10 <= len(r.scores) <= 100 for r in records.values() if r.ok)


def save_detector(model, path) -> str:
    """A checkpoint in train_detector's format (what detector.weights points at)."""
    torch.save({"config": TINY_CFG, "categories": [{"id": i, "name": f"c{i}"} for i in (1, 2, 3)],
                "num_classes": 3, "state_dict": model.state_dict()}, path)
    return str(path)


def test_task_images_that_cannot_be_read_are_accounted_and_the_rest_goes_on(tiny_detector, tmp_path):
    """extract_task_rois on VQA val images: a corrupt and a missing image get rows with their keys."""
    rng = np.random.default_rng(6)
    (tmp_path / "val2014").mkdir()
    for image_id in (1, 2, 3):
        path = tmp_path / "val2014" / f"COCO_val2014_{image_id:012d}.jpg"
        if image_id == 1:
            draw_scene(rng)[0].save(path)
        elif image_id == 2:
            path.write_bytes(jpeg_bytes(draw_scene(rng)[0])[:150])  # truncated download
    questions = {"data_subtype": "val2014", "questions": [
        {"image_id": i, "question": "what?", "question_id": i} for i in (1, 2, 3)]}
    (tmp_path / "questions_val.json").write_text(json.dumps(questions))
    out = tmp_path / "rois" / "vqa" / "val.parquet"
    load_script("extract_task_rois").main(SimpleNamespace(
        input=SimpleNamespace(model=save_detector(tiny_detector, tmp_path / "model.pt")),
        output=SimpleNamespace(parquet=str(out)),
        params=SimpleNamespace(dataset="vqa", split="val", device="cpu", max_image_pixels=MAX_PIXELS,
                               rois={"score_threshold": 0.5, "min_boxes": 10, "max_boxes": 100, "nms_iou": 0.3,
                                     "batch_size": 2},
                               sources={"questions": str(tmp_path / "questions_{split}.json"),
                                        "images": str(tmp_path / "{split}2014")}),
        threads=1, log=[str(tmp_path / "rois.log")], config={},
    ))
    records = read_rois(out)
    assert {k: r.status for k, r in records.items()} == {
        "COCO_val2014_000000000001": "ok", "COCO_val2014_000000000002": "decode_error",
        "COCO_val2014_000000000003": "missing_file"}
    assert "COCO_val2014_000000000003.jpg" in records["COCO_val2014_000000000003"].error
    assert 10 <= len(records["COCO_val2014_000000000001"].scores) <= 100
    log_text = (tmp_path / "rois.log").read_text()
    assert "COCO_val2014_000000000002: decode_error" in log_text


def test_detector_weights_that_do_not_load_fail_naming_file_and_problem(tiny_detector, tmp_path):
    good = save_detector(tiny_detector, tmp_path / "good.pt")
    model, meta = load_detector(good)
    assert meta["num_classes"] == 3 and not model.training

    with pytest.raises(FileNotFoundError, match="nowhere.pt"):
        load_detector(tmp_path / "nowhere.pt")
    (tmp_path / "text.pt").write_text("these are not weights")
    with pytest.raises(ValueError, match=r"text\.pt: not a detector checkpoint"):
        load_detector(tmp_path / "text.pt")
    torch.save(tiny_detector.state_dict(), tmp_path / "bare_state_dict.pt")
    with pytest.raises(ValueError, match=r"bare_state_dict\.pt: detector checkpoint lacks \['config', 'categories', "
                                         r"'num_classes', 'state_dict'\]"):
        load_detector(tmp_path / "bare_state_dict.pt")

    checkpoint = torch.load(good, weights_only=True)
    state = dict(checkpoint["state_dict"])
    del state["roi_heads.box_predictor.cls_score.bias"]
    state["extra.weight"] = torch.zeros(1)
    torch.save({**checkpoint, "state_dict": state}, tmp_path / "keys.pt")
    with pytest.raises(ValueError, match=r"keys\.pt: state_dict does not fit.*1 missing keys "
                                         r"\(roi_heads\.box_predictor\.cls_score\.bias\); 1 unexpected keys \(extra\.weight\)"):
        load_detector(tmp_path / "keys.pt")
    torch.save({**checkpoint, "num_classes": 5, "categories": checkpoint["categories"] + [{"id": 4}, {"id": 5}]},
               tmp_path / "classes.pt")
    with pytest.raises(ValueError, match=r"classes\.pt: state_dict does not fit.*wrong shapes "
                                         r"\(roi_heads\.box_predictor\.cls_score\.weight: file \[4, 16\], model \[6, 16\]"):
        load_detector(tmp_path / "classes.pt")
