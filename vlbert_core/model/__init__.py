"""VL-BERT: embeddings, the Fast R-CNN visual network, the SDPA encoder and the pre-training heads."""

from .batch import VLBertBatch, collate_samples, image_to_tensor
from .bert_init import load_tokenizer, resolve_bert_path
from .config import VLBertConfig
from .heads import MaskedRoIClassificationHead, MLMHead, PretrainingHeads, RelationshipHead
from .inputs import END, IMG, TEXT, InputSequence, boxes_with_whole_image, build_input_sequence
from .visual import FastRCNNVisualNetwork
from .vlbert import VLBertModel, VLBertOutput

__all__ = [
    "END", "IMG", "TEXT", "FastRCNNVisualNetwork", "InputSequence", "MLMHead", "MaskedRoIClassificationHead",
    "PretrainingHeads", "RelationshipHead", "VLBertBatch", "VLBertConfig", "VLBertModel", "VLBertOutput",
    "boxes_with_whole_image", "build_input_sequence", "collate_samples", "image_to_tensor", "load_tokenizer",
    "resolve_bert_path",
]
