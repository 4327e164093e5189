"""The R-C4 Faster R-CNN detector, its training, and the RoI selection and extraction."""

from .bottom_up import cc_image_id, coco_image_id, import_bottom_up_rois, import_rois_with_detector
from .extract import (
    RoIParquetWriter,
    RoIRecord,
    classify_boxes,
    detect_rois,
    extract_rois_to_parquet,
    extract_rois_with_detector,
    read_cc_shard,
    read_rois,
    read_rois_metadata,
    run_detector,
    selection_kwargs,
)
from .faster_rcnn import build_detector
from .metrics import average_precision, evaluate_ap50
from .resnet_c4 import (
    DETECTOR_BODY_PREFIX,
    DETECTOR_HEAD_PREFIX,
    ResNetC4Config,
    build_resnet_c4,
    visual_state_dict,
)
from .select import SelectedRoIs, select_rois
from .train import load_detector, train_detector

__all__ = [
    "extract_rois_with_detector",
    "DETECTOR_BODY_PREFIX",
    "DETECTOR_HEAD_PREFIX",
    "ResNetC4Config",
    "RoIParquetWriter",
    "RoIRecord",
    "SelectedRoIs",
    "average_precision",
    "build_detector",
    "build_resnet_c4",
    "cc_image_id",
    "classify_boxes",
    "coco_image_id",
    "detect_rois",
    "evaluate_ap50",
    "extract_rois_to_parquet",
    "import_bottom_up_rois",
    "import_rois_with_detector",
    "load_detector",
    "read_cc_shard",
    "read_rois",
    "read_rois_metadata",
    "run_detector",
    "select_rois",
    "selection_kwargs",
    "train_detector",
    "visual_state_dict",
]
