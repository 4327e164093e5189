"""The R-C4 Faster R-CNN: ResNet stages 1-4 as backbone, RoIAlign 14x14 at stride 16, stage 5 as head."""

from __future__ import annotations

from typing import Any, Mapping

from torchvision.models.detection import FasterRCNN
from torchvision.models.detection.anchor_utils import AnchorGenerator
from torchvision.models.detection.faster_rcnn import FastRCNNPredictor
from torchvision.models.detection.transform import GeneralizedRCNNTransform
from torchvision.ops import MultiScaleRoIAlign

from .pixels import get_pixel_format, normalise_pixels
from .resnet_c4 import ResNetC4Config, build_resnet_c4

# Anchor sizes that cover objects from ~1/8 to the whole of a 128-px image; real configs with
# 600-px images set `detector.anchor_sizes` (e.g. [32, 64, 128, 256, 512]).
DEFAULT_ANCHOR_SIZES = (16, 32, 64, 128)
DEFAULT_ASPECT_RATIOS = (0.5, 1.0, 2.0)


class PixelFormatTransform(GeneralizedRCNNTransform):
    """torchvision's resize-and-batch transform, normalising as the backbone's `pixel_format` says
    (torchvision's own normalisation knows neither BGR nor the 0-255 scale of Caffe weights)."""

    def __init__(self, min_size: int, max_size: int, pixel_format: str):
        fmt = get_pixel_format(pixel_format)
        super().__init__(min_size, max_size, image_mean=list(fmt.mean), image_std=list(fmt.std))
        self.pixel_format = pixel_format

    def normalize(self, image):
        return normalise_pixels(image, self.pixel_format)


def build_detector(cfg: Mapping[str, Any], num_classes: int) -> FasterRCNN:
    """Faster R-CNN with the C4 body as its single-map ('0') backbone and stage 5 as box head.

    `cfg` is the config's `detector:` section. `num_classes` counts foreground classes; the
    predictor has num_classes + 1 outputs, 0 being background.
    Keys read: backbone, min_size, max_size, rpn_post_nms_train, rpn_post_nms_test,
    box_batch_size_per_image, and optionally anchor_sizes, aspect_ratios, rpn_pre_nms_train,
    rpn_pre_nms_test, box_score_thresh, box_nms_thresh, box_detections_per_img.
    """
    if num_classes < 1:
        raise ValueError(f"build_detector: num_classes must be >= 1, got {num_classes}")
    for key in ("backbone", "min_size", "max_size", "rpn_post_nms_train", "rpn_post_nms_test",
                "box_batch_size_per_image"):
        if key not in cfg:
            raise KeyError(f"detector config lacks key '{key}'")
    backbone_cfg = ResNetC4Config.from_dict(cfg["backbone"])
    body, head, body_out, head_out = build_resnet_c4(backbone_cfg)
    body.out_channels = body_out  # FasterRCNN reads backbone.out_channels

    sizes = tuple(cfg.get("anchor_sizes", DEFAULT_ANCHOR_SIZES))
    ratios = tuple(float(r) for r in cfg.get("aspect_ratios", DEFAULT_ASPECT_RATIOS))
    anchor_generator = AnchorGenerator(sizes=(sizes,), aspect_ratios=(ratios,))
    roi_pool = MultiScaleRoIAlign(featmap_names=["0"], output_size=14, sampling_ratio=2)
    predictor = FastRCNNPredictor(head_out, num_classes + 1)

    post_train = int(cfg["rpn_post_nms_train"])
    post_test = int(cfg["rpn_post_nms_test"])
    model = FasterRCNN(
        body,
        num_classes=None,
        min_size=int(cfg["min_size"]),
        max_size=int(cfg["max_size"]),
        rpn_anchor_generator=anchor_generator,
        rpn_pre_nms_top_n_train=int(cfg.get("rpn_pre_nms_train", max(2000, post_train))),
        rpn_pre_nms_top_n_test=int(cfg.get("rpn_pre_nms_test", max(1000, post_test))),
        rpn_post_nms_top_n_train=post_train,
        rpn_post_nms_top_n_test=post_test,
        box_roi_pool=roi_pool,
        box_head=head,
        box_predictor=predictor,
        box_batch_size_per_image=int(cfg["box_batch_size_per_image"]),
        box_score_thresh=float(cfg.get("box_score_thresh", 0.05)),
        box_nms_thresh=float(cfg.get("box_nms_thresh", 0.5)),
        box_detections_per_img=int(cfg.get("box_detections_per_img", 100)),
    )
    model.transform = PixelFormatTransform(int(cfg["min_size"]), int(cfg["max_size"]), backbone_cfg.pixel_format)
    return model
