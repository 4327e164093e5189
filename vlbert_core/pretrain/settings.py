"""The pre-training settings: which pre-training tasks each one switches on, and which model family it trains.
The Table 4 ablation settings (VL-BERT) and ViLBERT's (the model comparison, results/tables/model_comparison.csv).
The one place they live."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class PretrainSetting:
    name: str
    mlm_visual: bool       # Task 1: MLM with visual clues on <Caption, Image>
    masked_roi_cls: bool   # Task 2: masked RoI classification with linguistic clues
    relationship: bool     # sentence-image relationship prediction (mismatched pairs as negatives)
    text_corpus: bool      # <Text, ∅> samples from the text-only corpus, 1:1 with CC per mini-batch
    tune_frcnn: bool       # train stages 3-5 of the Fast R-CNN visual network
    model_type: str = "vlbert"  # the model family it pre-trains (vlbert_core.models.registry)

    @property
    def trains(self) -> bool:
        """False for `none`: the BERT-initialised model is written without a single step."""
        return self.mlm_visual or self.masked_roi_cls or self.relationship or self.text_corpus

    def to_dict(self) -> dict:
        return asdict(self)


SETTINGS: dict[str, PretrainSetting] = {
    s.name: s
    for s in (
        PretrainSetting("none", mlm_visual=False, masked_roi_cls=False, relationship=False, text_corpus=False, tune_frcnn=False),
        PretrainSetting("a", mlm_visual=True, masked_roi_cls=False, relationship=False, text_corpus=False, tune_frcnn=False),
        PretrainSetting("b", mlm_visual=True, masked_roi_cls=True, relationship=False, text_corpus=False, tune_frcnn=False),
        PretrainSetting("c", mlm_visual=True, masked_roi_cls=True, relationship=True, text_corpus=False, tune_frcnn=False),
        PretrainSetting("d", mlm_visual=True, masked_roi_cls=True, relationship=False, text_corpus=True, tune_frcnn=False),
        PretrainSetting("full", mlm_visual=True, masked_roi_cls=True, relationship=False, text_corpus=True, tune_frcnn=True),
        # ViLBERT (Lu et al. 2019): without pre-training, and with its two objectives, masked multi-modal modelling
        # (masked words + masked regions' detector classes) and multi-modal alignment, on <Caption, Image> pairs
        # with the detector frozen (its features were precomputed). VL-BERT's setting (c) switches on the same
        # three tasks: it is the ViLBERT paper's single-stream baseline, VL-BERT's architecture trained with
        # ViLBERT's objectives.
        PretrainSetting("vilbert_none", mlm_visual=False, masked_roi_cls=False, relationship=False, text_corpus=False,
                        tune_frcnn=False, model_type="vilbert"),
        PretrainSetting("vilbert", mlm_visual=True, masked_roi_cls=True, relationship=True, text_corpus=False,
                        tune_frcnn=False, model_type="vilbert"),
    )
}
# The Table 4 ablation (VL-BERT); the schema's pretrain.settings enumerates these and the ViLBERT ones.
ABLATION_SETTINGS = ("none", "a", "b", "c", "d", "full")
# The model comparison (results/tables/model_comparison.csv): each ViLBERT setting beside the VL-BERT setting it is
# compared with, same data, RoIs, schedule and seeds.
COMPARISON_PAIRS = (("none", "vilbert_none"), ("c", "vilbert"))


# Not a pre-training of ours: the authors' released pre-trained model (`pretrain.init_from`, a model directory
# written by `python -m vlbert_core.convert vl-bert`), fine-tuned and evaluated by this pipeline. Its fine-tunes
# and evals sit under this name beside the settings above; no pretrain job makes it.
RELEASED_SETTING = "released"


def get_setting(name: str) -> PretrainSetting:
    if name not in SETTINGS:
        raise ValueError(f"unknown pre-training setting {name!r}; expected one of {list(SETTINGS)}")
    return SETTINGS[name]
