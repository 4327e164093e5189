"""ViLBERT (Lu et al. 2019, facebookresearch/vilbert-multi-task): a second model family beside VL-BERT, on the same
visual network, batches and task heads (model_type "vilbert" in vlbert_core.model_registry)."""

from .config import ViLBertConfig
from .model import ViLBertModel, ViLBertStreams
from .pretraining import ALIGNED_INDEX, ViLBertPretrainingHeads, load_vilbert_pretraining_heads

__all__ = ["ALIGNED_INDEX", "ViLBertConfig", "ViLBertModel", "ViLBertPretrainingHeads", "ViLBertStreams",
           "load_vilbert_pretraining_heads"]
