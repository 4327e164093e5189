"""VLBertModel: embeddings (with the visual feature term), the Fast R-CNN visual network and the encoder."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from ..common.batch import ModelBatch
from ..common.encoder import bert_encoder_key_map
from ..common.initialization import INIT_STD, copy_tensors, init_new_parameters
from ..common.inputs import IMG, TEXT
from ..common.output import EncoderOutput, HeadSpec
from ..common.pretrained import PretrainedModel
from ..common.visual import FastRCNNVisualNetwork, features_per_shared_image
from .config import SENTENCE_READOUTS, VLBertConfig
from .embeddings import VLBertEmbeddings
from .encoder import VLBertEncoder


_BERT_EMBEDDING_KEYS = {
    "embeddings.word_embeddings.weight": "embeddings.word_embeddings.weight",
    "embeddings.position_embeddings.weight": "embeddings.position_embeddings.weight",
    "embeddings.LayerNorm.weight": "embeddings.layer_norm.weight",
    "embeddings.LayerNorm.bias": "embeddings.layer_norm.bias",
}


@dataclass
class VLBertOutput(EncoderOutput):
    """The family-neutral outputs, read out of VL-BERT's one interleaved sequence: `text_states` is the whole
    sequence output (the text elements come first; the other positions are the `[IMG]`/`[END]` outputs),
    `visual_states` the `[IMG]` outputs placed at their box, `pooled` the sentence readout
    (VLBertConfig.sentence_readout)."""

    sequence_output: torch.Tensor | None = None  # [B, L, hidden]: the same tensor as text_states


def img_states(sequence_output: torch.Tensor, batch: ModelBatch) -> torch.Tensor:
    """[B, R, hidden]: the `[IMG]` outputs placed at their box index (zeros for padded boxes and rows without
    an image)."""
    batch_size, _, hidden = sequence_output.shape
    num_boxes = 0 if batch.boxes is None else batch.boxes.shape[1]
    out = sequence_output.new_zeros(batch_size, num_boxes, hidden)
    if num_boxes == 0:
        return out
    sample_idx, position = (batch.element_kind == IMG).nonzero(as_tuple=True)
    box_idx = batch.roi_index[sample_idx, position]
    return out.index_put((sample_idx, box_idx), sequence_output[sample_idx, position])


def sentence_readout(sequence_output: torch.Tensor, batch: ModelBatch, readout: str) -> torch.Tensor:
    """[B, hidden]: VL-BERT's one vector per sample (VLBertConfig.sentence_readout).

    "cls" is the `[CLS]` output (always the first element). "text_mean" averages the outputs of the sample's
    text elements (`[CLS]`, the word pieces, the `[SEP]`s), padding, `[IMG]` and `[END]` left out: how a
    checkpoint trained with mean pooling (sentence-transformers) makes its sentence vector. The visual elements
    reach it through attention.
    """
    if readout not in SENTENCE_READOUTS:
        raise ValueError(f"sentence readout must be one of {SENTENCE_READOUTS}, got {readout!r}")
    if readout == "cls":
        return sequence_output[:, 0]
    weights = ((batch.element_kind == TEXT) & batch.attention_mask).to(sequence_output.dtype)
    return (weights.unsqueeze(-1) * sequence_output).sum(1) / weights.sum(1, keepdim=True)


def vlbert_output(sequence_output: torch.Tensor, batch: ModelBatch, roi_features: torch.Tensor | None,
                  readout: str) -> VLBertOutput:
    visual_mask = (batch.box_valid if batch.box_valid is not None
                   else sequence_output.new_zeros(batch.batch_size, 0, dtype=torch.bool))
    return VLBertOutput(text_states=sequence_output,
                        text_mask=(batch.element_kind == TEXT) & batch.attention_mask,
                        visual_states=img_states(sequence_output, batch), visual_mask=visual_mask,
                        pooled=sentence_readout(sequence_output, batch, readout), roi_features=roi_features,
                        sequence_output=sequence_output)


class VLBertModel(PretrainedModel, nn.Module):
    model_type: ClassVar[str] = "vlbert"
    config_class: ClassVar[type] = VLBertConfig

    def __init__(self, config: VLBertConfig):
        super().__init__()
        self.config = config
        self.embeddings = VLBertEmbeddings(config)
        self.visual_network = FastRCNNVisualNetwork(config)
        self.encoder = VLBertEncoder(config)
        init_new_parameters(self.embeddings)
        init_new_parameters(self.encoder)
        self.embeddings.reset_special_parameters(INIT_STD)

    def word_embeddings(self) -> nn.Embedding:
        return self.embeddings.word_embeddings

    def visual_features(self, batch: ModelBatch, rows_per_image: int = 1) -> torch.Tensor | None:
        """The visual network's RoI features [B, R, appearance_dim] (zeros for text-only samples), or None
        when the batch has no image.

        With masked_roi_input "pixels" the masked RoIs' pixels are zeroed first; with "feature" the network sees
        the whole image and the embeddings replace the masked RoIs' features (VisualFeatureEmbedding).
        `rows_per_image` > 1: each run of that many consecutive rows shares one image and its boxes (the
        four VCR candidates); the network runs once per image and its features repeat over the run.
        """
        roi_masked = batch.roi_masked if self.config.masked_roi_input == "pixels" else None
        if rows_per_image > 1:
            return features_per_shared_image(self.visual_network, batch, rows_per_image, roi_masked)
        roi_features = None
        if batch.images is not None and bool(batch.has_image.any()):
            if bool(batch.has_image.all()):
                roi_features = self.visual_network(batch.images, batch.boxes, batch.box_valid, roi_masked,
                                                   batch.instance_masks)
            else:
                # The CNN runs only on the samples that have an image (text-only samples share the batch).
                idx = batch.has_image.nonzero(as_tuple=True)[0]
                masked = None if roi_masked is None else roi_masked[idx]
                shapes = None if batch.instance_masks is None else batch.instance_masks[idx]
                features = self.visual_network(batch.images[idx], batch.boxes[idx], batch.box_valid[idx], masked,
                                               shapes)
                roi_features = features.new_zeros(batch.batch_size, *features.shape[1:])
                roi_features = roi_features.index_copy(0, idx, features)
        return roi_features

    def encode(self, batch: ModelBatch, roi_features: torch.Tensor | None = None,
               rows_per_image: int = 1) -> VLBertOutput:
        """The sequence outputs of a batch: what the pre-training and fine-tuning heads read.

        `roi_features`, if given, replaces the visual network's output (`visual_features(batch,
        rows_per_image)`, computed with the batch's RoI masking), e.g. features of a frozen visual network
        computed once per image. A training step may bypass only a frozen visual network: its output then
        depends on nothing that trains."""
        if roi_features is None:
            roi_features = self.visual_features(batch, rows_per_image)
        elif self.visual_network.tune and torch.is_grad_enabled():
            raise ValueError("VLBertModel.encode: precomputed roi_features would bypass the tuned visual network "
                             "(tune_frcnn) in a step that computes gradients")
        embedded = self.embeddings(batch.input_ids, batch.element_kind, batch.segment_ids, batch.position_ids,
                                   batch.roi_index, batch.has_image, batch.boxes, roi_features, batch.roi_masked,
                                   batch.image_size)
        return vlbert_output(self.encoder(embedded, batch.attention_mask), batch, roi_features,
                             self.config.sentence_readout)

    def forward(self, batch: ModelBatch, roi_features: torch.Tensor | None = None,
                rows_per_image: int = 1) -> VLBertOutput:
        return self.encode(batch, roi_features, rows_per_image)

    def head_spec(self) -> HeadSpec:
        """What a task head on this model reads: one width everywhere; VQA answers at the `[MASK]`."""
        c = self.config
        return HeadSpec(text_width=c.hidden_size, visual_width=c.hidden_size, pooled_width=c.hidden_size,
                        dropout=c.hidden_dropout_prob, hidden_act=c.hidden_act, layer_norm_eps=c.layer_norm_eps,
                        layout=c.task_heads, answer_readout="mask")

    # ---- initialisation, saving and loading -------------------------------------------------------

    def load_bert_weights(self, bert_state: dict[str, torch.Tensor]) -> None:
        """Copy BERT's embeddings and first num_hidden_layers layers (transformers BertModel keys)."""
        mapping = dict(_BERT_EMBEDDING_KEYS)
        mapping.update(bert_encoder_key_map(self.config.num_hidden_layers))
        copy_tensors(self, bert_state, mapping, where=f"BERT checkpoint {self.config.bert_path!r}")
        with torch.no_grad():
            # Segments A and B come from BERT's token types; segment C (visual) is new.
            token_types = bert_state.get("embeddings.token_type_embeddings.weight")
            if token_types is not None:
                rows = min(token_types.shape[0], 2)
                self.embeddings.segment_embeddings.weight[:rows].copy_(token_types[:rows])
