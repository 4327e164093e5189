"""The authors' released checkpoints (jackroos/VL-BERT): one `ReleasedLayout` record per kind of checkpoint
(LAYOUTS: its manifest, the authors' model and config, and how the reference check feeds and reads it), and the
heads of the fine-tuned ones, task by task: how their keys map onto our task heads in the released layout
(`model.task_heads: released`), and what the task meta needs that the checkpoint does not hold. The converter
(vlbert/checkpoint.py) takes a fine-tuned checkpoint for the task whose rules, each matching a key, cover every
key outside VL-BERT's body.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

# This module imports no torch: `python -m vlbert_core.convert --help` and `python -m vlbert_core.convert.verify
# --help` build their parsers from it alone. It imports nothing but the standard library either: the authors'
# side of the reference check (vlbert/authors_runner.py), which runs in the authors' environment without this
# package, reads LAYOUTS from this file.

# How a layout's reference batch is drawn and fed to both models (ReleasedLayout.inputs)
PRETRAINING_INPUTS = "pretraining"   # <caption, image> rows with masked words and RoIs, then text-only rows
SENTENCE_INPUTS = "sentence"         # one sentence per image (ReleasedLayout.sentence)
CANDIDATE_INPUTS = "candidates"      # a question and its candidate answers per image, words tagged with their box
INPUT_KINDS = (PRETRAINING_INPUTS, SENTENCE_INPUTS, CANDIDATE_INPUTS)


@dataclass(frozen=True)
class ReleasedLayout:
    """One kind of released checkpoint, the forward of the authors' code that computes it, and how the reference
    check feeds both models one batch and reads their outputs (vlbert/reference.py ours, vlbert/authors_runner.py
    theirs): the one record each of them reads instead of asking which task a layout is."""
    name: str
    manifest: str            # vlbert_core/convert/manifests/<manifest>.json: the checkpoint's keys, shapes and dtypes
    task: str | None         # our task of a fine-tuned head; None: a pre-trained model (MLM and masked-RoI heads)
    precomputed: bool        # RoI features are inputs (the authors' IMAGE_FEAT_PRECOMPUTED), not computed
    authors_config: str      # the authors' config the runner builds their model from
    authors_package: str     # the authors' package of the model: <package>.function.config and <package>.modules
    authors_class: str       # the model class in <package>.modules
    inputs: str              # INPUT_KINDS: what the reference batch holds, and which forward arguments it makes
    sentence: str | None = None           # SENTENCE_INPUTS: the batch's array of the sentence's word ids
    sentence_lengths: tuple[int, ...] = ()   # SENTENCE_INPUTS: the words of each image's sentence
    answer_slot: bool = False  # a [MASK] as our sentence B, where the answer is read (the authors' VQA adds it)
    rows_per_image: int = 1    # consecutive rows of one image (VCR: its candidates); the visual network runs per image
    output: str | None = None  # the stage our head's logits (the authors' label_logits) are kept as; None: the
    #                            pre-training heads' MLM and masked-RoI logits and losses
    per_box: bool = False      # `output` has one score per box, kept at the real boxes
    # (short, long) canvas every normalised image is zero-padded to, by its orientation (the authors' FixPadding
    # with their config's SCALES, vcr/data/transforms/build.py); None: padded to the batch's largest image
    fixed_canvas: tuple[int, int] | None = None
    # per-box layouts: the prediction is the argmax over every real box, box 0 (the whole image) included, as
    # the authors' inference_forward takes it; both sides then also report the predicted index and box
    whole_image_candidate: bool = False

    def __post_init__(self) -> None:
        if self.inputs not in INPUT_KINDS:
            raise ValueError(f"released layout {self.name!r}: inputs must be one of {INPUT_KINDS}, got {self.inputs!r}")
        if (self.inputs == SENTENCE_INPUTS) != (self.sentence is not None and bool(self.sentence_lengths)):
            raise ValueError(f"released layout {self.name!r}: a sentence (and its lengths) is what sentence inputs have")
        if (self.task is None) != (self.output is None) or (self.task is None) != (self.inputs == PRETRAINING_INPUTS):
            raise ValueError(f"released layout {self.name!r}: a pre-trained model has pre-training inputs and no "
                             "task output; a fine-tuned one has both")
        if self.whole_image_candidate and not self.per_box:
            raise ValueError(f"released layout {self.name!r}: box 0 as a candidate needs one score per box (per_box)")
        canvas = self.fixed_canvas
        if canvas is not None and (len(canvas) != 2 or not 0 < canvas[0] <= canvas[1]):
            raise ValueError(f"released layout {self.name!r}: fixed_canvas is (short, long) sides, got {canvas}")

    @property
    def pretrained(self) -> bool:
        """A pre-trained model's checkpoint (no task head)."""
        return self.task is None


_PRETRAIN_MODEL = {"authors_package": "pretrain", "authors_class": "ResNetVLBERTForPretrainingMultitask",
                   "inputs": PRETRAINING_INPUTS}
# The order is part of the reference batches: each layout's batch is drawn from (seed, its index here).
LAYOUTS = {layout.name: layout for layout in (
    ReleasedLayout("pretrain-e2e", "vl-bert-base-e2e", None, False, "cfgs/pretrain/base_e2e_16x16G_fp16.yaml",
                   **_PRETRAIN_MODEL),
    ReleasedLayout("pretrain-prec", "vl-bert-base-prec", None, True, "cfgs/pretrain/base_prec_4x16G_fp32.yaml",
                   **_PRETRAIN_MODEL),
    # <question, [MASK], image>: the answer logits at the [MASK]
    ReleasedLayout("vqa", "vqa-base", "vqa", True, "cfgs/vqa/base_4x16G_fp32.yaml", "vqa", "ResNetVLBERT",
                   SENTENCE_INPUTS, sentence="question", sentence_lengths=(7, 5), answer_slot=True,
                   output="answer_logits"),
    # <expression, image>: one score per box
    ReleasedLayout("refcoco", "refcoco-base", "refcoco", False, "cfgs/refcoco/base_detected_regions_4x16G.yaml",
                   "refcoco", "ResNetVLBERT", SENTENCE_INPUTS, sentence="expression", sentence_lengths=(6, 4),
                   output="box_scores", per_box=True, whole_image_candidate=True),
    # <question, answer, image> for each of 4 candidates: one score per candidate
    ReleasedLayout("vcr", "vcr-base", "vcr_q2a", False, "cfgs/vcr/base_q2a_4x16G_fp32.yaml", "vcr", "ResNetVLBERT",
                   CANDIDATE_INPUTS, rows_per_image=4, output="choice_scores", fixed_canvas=(600, 1200)),
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


# ---- ViLBERT (facebookresearch/vilbert-multi-task VILBertForVLTasks) ---------------------------------------------

@dataclass(frozen=True)
class ViLBertTaskHead:
    """Which of the released ViLBERT heads (tasks/modeling/vilbert_released.py HEAD_NAMES) a task of this pipeline
    reads, and the authors' input sizes of that task (vilbert_tasks.yml: max_seq_length, max_region_num)."""
    released_head: str
    max_text_len: int
    max_rois: int = 101   # their 100 detections + the global region
    vocabularies: tuple[tuple[str, str], ...] = ()   # (meta key, what its file lists), as ReleasedHead's


# task -> its released ViLBERT head; the tasks a fine-tuned ViLBERT converts to (`convert vilbert --task`) and
# whose head fine-tuning from a converted one starts from
VILBERT_TASK_HEADS: dict[str, ViLBertTaskHead] = {
    "vqa": ViLBertTaskHead("vqa", 23, vocabularies=(("answers", "the authors' 3,129 answers in the order of "
                                                                 "vil_prediction's rows (trainval_label2ans.pkl)"),)),
    "refcoco": ViLBertTaskHead("region_score", 20),
    "retrieval": ViLBertTaskHead("pair_score", 30),
}
