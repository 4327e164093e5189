"""The heads of the authors' released fine-tuned checkpoints (jackroos/VL-BERT), task by task: how their keys map
onto our task heads in the released layout (`model.task_heads: released`), and what the task meta needs that the
checkpoint does not hold. The converter (vlbert.py) takes a fine-tuned checkpoint for the task whose rules, each
matching a key, cover every key outside VL-BERT's body.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

# This module imports no torch: `python -m vlbert_core.convert --help` and `python -m vlbert_core.convert.verify
# --help` build their parsers from it alone.

@dataclass(frozen=True)
class ReleasedLayout:
    """One kind of released checkpoint and the forward of the authors' code that computes it."""
    name: str
    manifest: str            # tests/data/manifests/<manifest>.json: the checkpoint's keys, shapes and dtypes
    task: str | None         # our task of a fine-tuned head; None: a pre-trained model (MLM and masked-RoI heads)
    precomputed: bool        # RoI features are inputs (the authors' IMAGE_FEAT_PRECOMPUTED), not computed
    authors_config: str      # the authors' config the runner builds their model from


LAYOUTS = {layout.name: layout for layout in (
    ReleasedLayout("pretrain-e2e", "vl-bert-base-e2e", None, False, "cfgs/pretrain/base_e2e_16x16G_fp16.yaml"),
    ReleasedLayout("pretrain-prec", "vl-bert-base-prec", None, True, "cfgs/pretrain/base_prec_4x16G_fp32.yaml"),
    ReleasedLayout("vqa", "vqa-base", "vqa", True, "cfgs/vqa/base_4x16G_fp32.yaml"),
    ReleasedLayout("refcoco", "refcoco-base", "refcoco", False, "cfgs/refcoco/base_detected_regions_4x16G.yaml"),
    ReleasedLayout("vcr", "vcr-base", "vcr_q2a", False, "cfgs/vcr/base_q2a_4x16G_fp32.yaml"),
)}


def get_layout(name: str) -> ReleasedLayout:
    if name not in LAYOUTS:
        raise ValueError(f"unknown released layout {name!r}; expected one of {list(LAYOUTS)}")
    return LAYOUTS[name]


PUBLISHED_PRETRAINED = ("vl-bert-base-e2e.model", "vl-bert-large-e2e.model", "vl-bert-base-prec.model",
                        "vl-bert-large-prec.model")


@dataclass(frozen=True)
class ReleasedHead:
    """`rules(vlbert)`: (full-match regex of a checkpoint key, `re` template of our `head.*` / `roi_classifier.*`
    key) pairs; checkpoint keys have 'module.' taken off and `vlbert` is the regex of the checkpoint's VL-BERT
    prefix ('vlbert.', or VCR's 'vlbert._module.'). `vocabularies`: (meta key, what its file lists, one a line)
    of the lists the head needs, read from `--<meta key with - for _>`. `meta`: more task meta entries."""
    rules: Callable[[str], tuple[tuple[str, str], ...]]
    vocabularies: tuple[tuple[str, str], ...] = ()
    meta: Mapping[str, Any] = field(default_factory=dict)

    def task_meta(self, vocabularies: Mapping[str, list[str]]) -> dict[str, Any]:
        """The task meta entries of a converted checkpoint beyond the shared ones (every list given)."""
        return {**{key: list(vocabularies[key]) for key, _ in self.vocabularies}, **self.meta}


def _vqa_rules(vlbert: str) -> tuple[tuple[str, str], ...]:
    # vqa/modules/resnet_vlbert_for_vqa.py final_mlp ('mlm'): dense, GELU, LayerNorm (final_mlp.0), dropout,
    # answer classifier (final_mlp.2)
    return ((r"final_mlp\.0\.dense\.(weight|bias)", r"head.classifier.transform.dense.\1"),
            (r"final_mlp\.0\.LayerNorm\.(weight|bias)", r"head.classifier.transform.layer_norm.\1"),
            (r"final_mlp\.2\.(weight|bias)", r"head.classifier.linear.\1"))


def _refcoco_rules(vlbert: str) -> tuple[tuple[str, str], ...]:
    # refcoco/modules/resnet_vlbert_for_refcoco.py final_mlp: dense, GELU (final_mlp.0), dropout, one score per
    # box (final_mlp.2)
    return ((r"final_mlp\.0\.dense\.(weight|bias)", r"head.mlp.transform.dense.\1"),
            (r"final_mlp\.2\.(weight|bias)", r"head.mlp.linear.\1"))


def _vcr_rules(vlbert: str) -> tuple[tuple[str, str], ...]:
    # vcr/modules/resnet_vlbert_for_vcr.py: one head serves Q->A and QA->R: VL-BERT's pooler (inside
    # TimeDistributed, `vlbert._module.`) feeds the 1-unit scorer final_mlp.1; cnn_loss_reg is the auxiliary RoI
    # classifier
    return ((vlbert + r"pooler\.dense\.(weight|bias)", r"head.pooler.\1"),
            (r"final_mlp\.1\.(weight|bias)", r"head.score.\1"),
            (r"cnn_loss_reg\.0\.dense\.(weight|bias)", r"roi_classifier.transform.dense.\1"),
            (r"cnn_loss_reg\.2\.(weight|bias)", r"roi_classifier.classifier.\1"))


_VCR = ReleasedHead(_vcr_rules, (("object_names", "the classes of the auxiliary RoI classifier, in the order of "
                                                  "its rows (81 in the authors' checkpoint)"),),
                    meta={"aux_roi_loss_weight": 1.0})   # the authors' VCR configs weigh the RoI loss 1.0

# task name -> its released head; the tasks the authors released no checkpoint of are absent
RELEASED_HEADS: dict[str, ReleasedHead] = {
    "vqa": ReleasedHead(_vqa_rules, (("answers", "the answer list, in the order of the classifier's rows (3,129 in "
                                                 "the authors' checkpoint)"),)),
    "refcoco": ReleasedHead(_refcoco_rules),
    "vcr_q2a": _VCR,
    "vcr_qa2r": _VCR,
}


def released_head(task: str) -> ReleasedHead | None:
    return RELEASED_HEADS.get(task)


def released_vocabularies() -> dict[str, str]:
    """{meta key: what its file lists} of every released fine-tuned checkpoint's head (`--answers`, ...)."""
    vocabularies: dict[str, str] = {}
    for head in RELEASED_HEADS.values():
        for key, what in head.vocabularies:
            vocabularies.setdefault(key, what)
    return vocabularies


def released_task_names() -> list[str]:
    """The tasks whose released fine-tuned checkpoints convert (`--task` choices)."""
    return list(RELEASED_HEADS)


def vocabulary_option(key: str) -> str:
    """The command-line option of a `released_vocabularies` meta key: answers -> --answers."""
    return "--" + key.replace("_", "-")
