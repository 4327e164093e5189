"""The synthetic world: seeded scenes of simple objects, and raw datasets in official formats about them."""

from .generate import cc_image_dir, generate_world
from .scene import Scene, SceneObject, render, sample_scene
from .vocabulary import CATEGORIES, CATEGORY_NAMES, COLOUR_NAMES, SIZES, coco_categories

__all__ = [
    "CATEGORIES",
    "CATEGORY_NAMES",
    "COLOUR_NAMES",
    "SIZES",
    "Scene",
    "SceneObject",
    "cc_image_dir",
    "coco_categories",
    "generate_world",
    "render",
    "sample_scene",
]
