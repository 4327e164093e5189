"""The Fast R-CNN visual network: ResNet-C4 body on the whole image, RoIAlign 14x14, stage-5 head per RoI."""

from __future__ import annotations

import contextlib

import torch
from torch import nn
from torchvision.ops import roi_align

from vlbert_core.detector.resnet_c4 import FEATURE_STRIDE, ROI_ALIGNED, build_resnet_c4, visual_state_dict


# Detectron-style stage numbering of the C4 body: stage 1 = stem, stages 2-4 = layer1-3, stage 5 = head.
_STAGE_MODULES = {1: ("body.conv1", "body.bn1"), 2: ("body.layer1",), 3: ("body.layer2",), 4: ("body.layer3",),
                  5: ("head.layer4",)}


def mask_roi_pixels(images: torch.Tensor, boxes: torch.Tensor, roi_masked: torch.Tensor) -> torch.Tensor:
    """Zero every pixel of every masked box, so no later feature can see inside it.

    Zero is taken in the normalised image (the mean colour), as the released code does. Box corners are pixel
    indices (common/inputs.py boxes_with_whole_image), and a box covers the columns int(x1)..int(x2) and the rows
    int(y1)..int(y2), both ends included, as the authors' conceptual_captions.py masks it.
    images [B, 3, H, W], boxes [B, R, 4] pixel x1,y1,x2,y2, roi_masked Bool [B, R]. Returns a new tensor.
    """
    _, _, height, width = images.shape
    corners = boxes.floor()
    x1, y1, x2, y2 = (corners[..., i, None] for i in range(4))
    xs = torch.arange(width, device=images.device, dtype=boxes.dtype)
    ys = torch.arange(height, device=images.device, dtype=boxes.dtype)
    inside_x = ((xs >= x1) & (xs <= x2)).to(images.dtype)                                 # [B, R, W]
    inside_y = ((ys >= y1) & (ys <= y2) & roi_masked[..., None]).to(images.dtype)         # [B, R, H]
    covered = torch.bmm(inside_y.transpose(1, 2), inside_x) > 0                            # [B, H, W]
    return images.masked_fill(covered[:, None], 0.0)


class FastRCNNVisualNetwork(nn.Module):
    """Appearance features of the boxes of each image, [B, R, appearance_dim]. Every family's (its config has the
    visual fields: visual_backbone, appearance_dim, roi_align_size, roi_sampling_ratio, tune_frcnn, freeze_bn,
    frozen_stages), so all families see the same RoI features."""

    def __init__(self, config):
        super().__init__()
        body, head, _, head_out = build_resnet_c4(config.visual_backbone)
        if head_out != config.appearance_dim:
            raise ValueError(f"{type(config).__name__}.appearance_dim={config.appearance_dim} but the visual backbone "
                             f"{config.visual_backbone} gives {head_out}-d RoI features")
        self.body = body
        self.head = head
        self.roi_align_size = config.roi_align_size
        self.roi_sampling_ratio = config.roi_sampling_ratio
        self.tune = config.tune_frcnn
        self.freeze_bn = config.freeze_bn
        self.frozen_stages = config.frozen_stages
        self._freeze_parameters()

    def _freeze_parameters(self) -> None:
        if not self.tune:
            for p in self.parameters():
                p.requires_grad_(False)
            return
        for stage in range(1, self.frozen_stages + 1):
            for name in _STAGE_MODULES[stage]:
                for p in self.get_submodule(name).parameters():
                    p.requires_grad_(False)
        if self.freeze_bn:
            for m in self.modules():
                if isinstance(m, nn.modules.batchnorm._BatchNorm):
                    for p in m.parameters():
                        p.requires_grad_(False)

    def stage5_size(self) -> int:
        """The side of stage 5's output for one RoI (RoIAlign's roi_align_size, halved unless the head is
        dilated): the size of the instance masks it takes."""
        first_block = self.head.layer4[0]
        stride = max(m.stride[0] for m in first_block.modules() if isinstance(m, nn.Conv2d))
        return (self.roi_align_size - 1) // stride + 1

    def train(self, mode: bool = True) -> "FastRCNNVisualNetwork":
        # A frozen network (and frozen BatchNorm) keeps its detector statistics in every phase.
        super().train(mode)
        if not self.tune:
            super().train(False)
        elif self.freeze_bn:
            for m in self.modules():
                if isinstance(m, nn.modules.batchnorm._BatchNorm):
                    m.eval()
        return self

    def load_detector_weights(self, detector_state_dict: dict) -> None:
        parts = visual_state_dict(detector_state_dict)
        for name, module in (("body", self.body), ("head", self.head)):
            missing, unexpected = module.load_state_dict(parts[name], strict=False)
            if missing or unexpected:
                raise ValueError(f"detector state dict does not fit the visual network's {name}: missing "
                                 f"{sorted(missing)[:8]}, unexpected {sorted(unexpected)[:8]}")

    def forward(self, images: torch.Tensor, boxes: torch.Tensor, box_valid: torch.Tensor,
                roi_masked: torch.Tensor | None = None, instance_masks: torch.Tensor | None = None) -> torch.Tensor:
        """`instance_masks` Float [B, R, S, S] (VCR's object segmentations inside each box, 1 for box 0): the
        stage-5 output of each RoI is multiplied by its mask before the average pool, as the released VCR
        model does (common/fast_rcnn.py `segms`); S must be the stage-5 output size (14 with the dilated head)."""
        if roi_masked is not None and bool(roi_masked.any()):
            if bool(roi_masked[:, 0].any()):
                raise ValueError("FastRCNNVisualNetwork: box 0 (the whole image) must never be masked")
            images = mask_roi_pixels(images, boxes, roi_masked & box_valid)
        batch, num_boxes = box_valid.shape
        grad_context = contextlib.nullcontext() if self.tune else torch.no_grad()
        with grad_context:
            feature_map = self.body(images)
            sample_idx, box_idx = box_valid.nonzero(as_tuple=True)
            rois = torch.cat([sample_idx[:, None].to(boxes.dtype), boxes[sample_idx, box_idx]], dim=1)
            pooled = roi_align(feature_map, rois.to(feature_map.dtype), output_size=self.roi_align_size,
                               spatial_scale=1.0 / FEATURE_STRIDE, sampling_ratio=self.roi_sampling_ratio,
                               aligned=ROI_ALIGNED)
            if instance_masks is None:
                features = self.head(pooled)
            else:
                stage5 = self.head.layer4(pooled)
                masks = instance_masks[sample_idx, box_idx].to(stage5.dtype)
                if masks.shape[-2:] != stage5.shape[-2:]:
                    raise ValueError(f"FastRCNNVisualNetwork: instance masks of {tuple(masks.shape[-2:])} for a "
                                     f"stage-5 output of {tuple(stage5.shape[-2:])}")
                features = self.head.flatten(self.head.avgpool(stage5 * masks[:, None]))
        out = features.new_zeros(batch, num_boxes, features.shape[-1])
        out[sample_idx, box_idx] = features
        return out


def features_per_shared_image(network: FastRCNNVisualNetwork, batch, rows_per_image: int,
                              roi_masked: torch.Tensor | None = None) -> torch.Tensor:
    """[B, R, appearance_dim] of a batch whose runs of `rows_per_image` consecutive rows share one image and its
    boxes (the four VCR candidates): the network runs once per image and its features repeat over the run."""
    step = int(rows_per_image)
    if step < 1 or batch.batch_size % step:
        raise ValueError(f"batch of {batch.batch_size} rows is not made of groups of {rows_per_image}")
    masked = None if roi_masked is None else roi_masked[::step]
    shapes = None if batch.instance_masks is None else batch.instance_masks[::step]
    features = network(batch.images[::step], batch.boxes[::step], batch.box_valid[::step], masked, shapes)
    return features.repeat_interleave(step, dim=0) if step > 1 else features
