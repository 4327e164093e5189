"""The R-C4 Faster R-CNN detector, its training, and the RoI selection and extraction.

The names below are loaded from their submodule on first use, so that importing one light
submodule (pixels, resnet_c4, as vlbert_core.model does) does not load the extraction's pyarrow
and DataLoader code or the training code. The RoI file format itself is vlbert_core.rois.
"""

from __future__ import annotations

import importlib

_SUBMODULE_OF = {
    "cc_image_id": "bottom_up",
    "coco_image_id": "bottom_up",
    "import_bottom_up_rois": "bottom_up",
    "import_rois_with_detector": "bottom_up",
    "classify_boxes": "extract",
    "detect_rois": "extract",
    "extract_rois_to_parquet": "extract",
    "extract_rois_with_detector": "extract",
    "read_cc_shard": "extract",
    "run_detector": "extract",
    "selection_kwargs": "extract",
    "build_detector": "faster_rcnn",
    "decode_image": "images",
    "to_unit_float": "images",
    "average_precision": "metrics",
    "evaluate_ap50": "metrics",
    "DETECTOR_BODY_PREFIX": "resnet_c4",
    "DETECTOR_HEAD_PREFIX": "resnet_c4",
    "ResNetC4Config": "resnet_c4",
    "build_resnet_c4": "resnet_c4",
    "visual_state_dict": "resnet_c4",
    "SelectedRoIs": "select",
    "select_rois": "select",
    "load_detector": "train",
    "train_detector": "train",
}

__all__ = sorted(_SUBMODULE_OF)


def __getattr__(name: str):
    if name not in _SUBMODULE_OF:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_SUBMODULE_OF[name]}", __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
