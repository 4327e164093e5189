"""ViLBertModel (Lu et al. 2019): a text stream and a visual stream joined by co-attention layers, on the same
Fast R-CNN visual network and the same batches (ModelBatch) as VL-BERT.

From a ModelBatch (VL-BERT's layout: text elements first, then `[IMG]` elements and `[END]`):
- the text stream is the text elements (`[CLS] A [SEP] (B [SEP])`) with BERT token types from the segments
  (A = 0, B = 1) and positions 0..T-1;
- the visual stream is one region per box slot of `batch.boxes`: box 0, the whole image, plays the authors'
  first (global) region; each region is its RoI feature and its 5-d location. A masked RoI (pre-training) has its
  feature zeroed, as the authors mask a region; the visual network itself sees the whole image.
ViLBERT has no text-only input: a row without an image is an error.

The global region (config `global_region`): the authors' is the mean of the other regions' precomputed features
at location (0, 0, 1, 1, 1) (`mean_of_regions`, what a converted released model is set to); the default,
`whole_image_box`, is the visual network's feature of the whole-image box at that box's location.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from ..common.batch import ModelBatch
from ..common.encoder import bert_encoder_key_map
from ..common.initialization import copy_tensors, init_new_parameters
from ..common.inputs import TEXT
from ..common.output import EncoderOutput, HeadSpec
from ..common.pretrained import PretrainedModel
from ..common.visual import FastRCNNVisualNetwork, features_per_shared_image
from .config import ViLBertConfig, task_token_id
from .embeddings import TASK_TOKEN_POSITION, ImageEmbeddings, TextEmbeddings, region_locations
from .encoder import ViLBertEncoder

# transformers BertModel keys of the embeddings -> ours (the text layers: bert_encoder_key_map)
_BERT_EMBEDDING_KEYS = {
    "embeddings.word_embeddings.weight": "embeddings.word_embeddings.weight",
    "embeddings.position_embeddings.weight": "embeddings.position_embeddings.weight",
    "embeddings.token_type_embeddings.weight": "embeddings.token_type_embeddings.weight",
    "embeddings.LayerNorm.weight": "embeddings.layer_norm.weight",
    "embeddings.LayerNorm.bias": "embeddings.layer_norm.bias",
}


@dataclass
class ViLBertStreams:
    """What `ViLBertModel.forward_streams` computes, stage by stage (the states at padded positions are whatever
    the layers leave there)."""

    text_embeddings: torch.Tensor    # [B, T, hidden]
    visual_embeddings: torch.Tensor  # [B, R, v_hidden]
    text_states: torch.Tensor        # [B, T, hidden]
    visual_states: torch.Tensor      # [B, R, v_hidden]
    pooled_text: torch.Tensor        # [B, bi_hidden]: t_pooler([CLS])
    pooled_visual: torch.Tensor      # [B, bi_hidden]: v_pooler(region 0)
    pooled: torch.Tensor             # [B, bi_hidden]: the two fused (fusion_method)


class Pooler(nn.Module):
    """The first element's state -> Linear -> ReLU (the authors' BertTextPooler / BertImagePooler: ReLU, not
    BERT's tanh, into bi_hidden_size)."""

    def __init__(self, width: int, out_width: int):
        super().__init__()
        self.dense = nn.Linear(width, out_width)

    def forward(self, states: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.dense(states[:, 0]))


def require_images(batch: ModelBatch, where: str) -> None:
    if batch.boxes is None or batch.box_valid is None or batch.image_size is None or not bool(batch.has_image.all()):
        rows = (~batch.has_image).nonzero().flatten().tolist()
        raise ValueError(f"{where}: ViLBERT has no text-only input, every row needs an image and its boxes; rows "
                         f"{rows} of the batch have none")


def text_stream(batch: ModelBatch, type_vocab_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input ids, token types, mask), each [B, T]: the text elements of each row, which VL-BERT's layout puts
    first, padded to the longest row's T."""
    is_text = (batch.element_kind == TEXT) & batch.attention_mask
    counts = is_text.sum(1)
    length = int(counts.max())
    mask = torch.arange(length, device=counts.device)[None, :] < counts[:, None]
    if not torch.equal(is_text[:, :length], mask):
        raise ValueError("ViLBertModel: the text elements of a row must come first (VL-BERT's input layout)")
    token_types = batch.segment_ids[:, :length].masked_fill(~mask, 0)
    if bool((token_types >= type_vocab_size).any()) or bool((token_types < 0).any()):
        raise ValueError(f"ViLBertModel: text segments must be in 0..{type_vocab_size - 1} (sentences A and B), got "
                         f"{sorted(set(token_types[mask].tolist()))}")
    return batch.input_ids[:, :length], token_types, mask


def with_task_token(text_mask: torch.Tensor) -> torch.Tensor:
    """The text mask [B, T] of a stream with the task token inserted: [B, T + 1]. The authors prepend a 1 to the
    mask while the token goes after [CLS]; as [CLS] is always real, both give this."""
    if not bool(text_mask[:, 0].all()):
        raise ValueError("ViLBertModel: every row's first text element ([CLS]) must be real")
    return torch.cat([text_mask[:, :TASK_TOKEN_POSITION], text_mask.new_ones(text_mask.shape[0], 1),
                      text_mask[:, TASK_TOKEN_POSITION:]], dim=1)


def drop_task_token(text_states: torch.Tensor) -> torch.Tensor:
    """[B, T + 1, ...] states of a stream with the task token -> [B, T, ...], the words' only."""
    return torch.cat([text_states[:, :TASK_TOKEN_POSITION], text_states[:, TASK_TOKEN_POSITION + 1:]], dim=1)


GLOBAL_LOCATION = (0.0, 0.0, 1.0, 1.0, 1.0)


def mean_global_region(features: torch.Tensor, locations: torch.Tensor, region_mask: torch.Tensor,
                       ground_truth: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Region 0 as the released models saw it, at location (0, 0, 1, 1, 1): the mean of regions 1.. (the real
    ones of each row, before any masking), as the authors' _image_features_reader computes g_feat / g_location.
    features [B, R, D], locations [B, R, 5], region_mask Bool [B, R] -> the two with row 0 replaced.

    `ground_truth` (Bool [B, R]) marks the ground-truth boxes of the authors' VCR form, which merges a detected
    and a ground-truth feature file (their vcr_dataset.py): each file's mean weighted by that file's row count,
    which counts its own row 0, so ((n_det + 1) mean_det + (n_gt + 1) mean_gt) / (n_det + n_gt + 2), not the
    plain mean of all the regions. Every row then needs at least one region of each kind."""
    real = region_mask.clone()
    real[:, 0] = False
    if ground_truth is None:
        others = real[..., None].to(features.dtype)
        mean = (features * others).sum(1) / others.sum(1).clamp(min=1.0)
    else:
        if ground_truth.shape != region_mask.shape:
            raise ValueError(f"mean_global_region: ground_truth has shape {tuple(ground_truth.shape)}, the regions "
                             f"{tuple(region_mask.shape)}")
        groups = [real & ~ground_truth, real & ground_truth]   # detected, ground truth
        counts = [group.sum(1) for group in groups]
        if any(bool((count == 0).any()) for count in counts):
            raise ValueError("mean_global_region: the VCR form needs at least one detected and one ground-truth "
                             "region in every row")
        mean = features.new_zeros(features.shape[0], features.shape[2])
        for group, count in zip(groups, counts):
            weight = group[..., None].to(features.dtype)
            group_mean = (features * weight).sum(1) / count[:, None].to(features.dtype)
            mean = mean + (count[:, None] + 1).to(features.dtype) * group_mean
        mean = mean / (counts[0] + counts[1] + 2)[:, None].to(features.dtype)
    global_location = locations.new_tensor(GLOBAL_LOCATION).expand(locations.shape[0], 1, 5)
    return torch.cat([mean[:, None], features[:, 1:]], 1), torch.cat([global_location, locations[:, 1:]], 1)


class ViLBertModel(PretrainedModel, nn.Module):
    model_type: ClassVar[str] = "vilbert"
    config_class: ClassVar[type] = ViLBertConfig
    # PretrainedModel.from_bert: BERT's fields the text stream must match
    bert_matched_keys: ClassVar[tuple[str, ...]] = (*PretrainedModel.bert_matched_keys, "type_vocab_size")

    def __init__(self, config: ViLBertConfig):
        super().__init__()
        self.config = config
        self.embeddings = TextEmbeddings(config)
        self.image_embeddings = ImageEmbeddings(config)
        self.visual_network = FastRCNNVisualNetwork(config)
        self.encoder = ViLBertEncoder(config)
        self.text_pooler = Pooler(config.hidden_size, config.bi_hidden_size)
        self.visual_pooler = Pooler(config.v_hidden_size, config.bi_hidden_size)
        for module in (self.embeddings, self.image_embeddings, self.encoder, self.text_pooler, self.visual_pooler):
            init_new_parameters(module)

    def task_config(self, task: str) -> dict:
        """With task tokens, the task token of `task` (the authors' id of its task, config.task_token_id)."""
        return {"task_id": task_token_id(task)} if self.config.task_specific_tokens else {}

    def word_embeddings(self) -> nn.Embedding:
        return self.embeddings.word_embeddings

    def head_spec(self) -> HeadSpec:
        """A task head reads words at hidden_size, regions at v_hidden_size and the fused pooled vector at
        bi_hidden_size; an answer head (VQA) reads the pooled vector, as the authors' VQA head does."""
        c = self.config
        return HeadSpec(text_width=c.hidden_size, visual_width=c.v_hidden_size, pooled_width=c.bi_hidden_size,
                        dropout=c.hidden_dropout_prob, hidden_act=c.hidden_act, layer_norm_eps=c.layer_norm_eps,
                        layout=c.task_heads, answer_readout="pooled")

    # ---- forward ---------------------------------------------------------------------------------------------

    def visual_features(self, batch: ModelBatch, rows_per_image: int = 1) -> torch.Tensor:
        """The visual network's RoI features [B, R, appearance_dim] of the whole images (no pixel is masked:
        `encode` zeroes a masked RoI's feature). `rows_per_image` > 1: each run of that many consecutive rows
        shares one image and its boxes (the VCR candidates); the network runs once per image."""
        require_images(batch, "ViLBertModel.visual_features")
        if batch.images is None:
            raise ValueError("ViLBertModel.visual_features: the batch has no images")
        return features_per_shared_image(self.visual_network, batch, rows_per_image)

    def forward_streams(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor, text_mask: torch.Tensor,
                        region_features: torch.Tensor, region_locations: torch.Tensor,
                        region_mask: torch.Tensor, task_ids: torch.Tensor | None = None) -> ViLBertStreams:
        """The authors' BertModel forward on explicit streams: words [B, T] (ids, token types, Bool mask) and
        regions [B, R] (features [B, R, appearance_dim], 5-d locations [B, R, 5], Bool mask). Position 0 of
        each stream ([CLS], the whole image) feeds its pooler.

        With task tokens (config task_specific_tokens) `task_ids` [B] gives each row's task token, inserted at
        TASK_TOKEN_POSITION: the text embeddings and states are then [B, T + 1, ...], their mask
        `with_task_token(text_mask)`."""
        text_embeddings = self.embeddings(input_ids, token_type_ids, task_ids)
        if self.config.task_specific_tokens:
            text_mask = with_task_token(text_mask)
        visual_embeddings = self.image_embeddings(region_features, region_locations)
        text_states, visual_states = self.encoder(text_embeddings, text_mask, visual_embeddings, region_mask)
        pooled_text, pooled_visual = self.text_pooler(text_states), self.visual_pooler(visual_states)
        pooled = pooled_text * pooled_visual if self.config.fusion_method == "mul" else pooled_text + pooled_visual
        return ViLBertStreams(text_embeddings=text_embeddings, visual_embeddings=visual_embeddings,
                              text_states=text_states, visual_states=visual_states, pooled_text=pooled_text,
                              pooled_visual=pooled_visual, pooled=pooled)

    def task_ids(self, rows: int, device: torch.device) -> torch.Tensor | None:
        """[rows] of the config's task_id (the task token `encode` feeds), or None for a model without task
        tokens."""
        if not self.config.task_specific_tokens:
            return None
        if self.config.task_id is None:
            raise ValueError("ViLBertModel: the model has task tokens (task_specific_tokens) but its config names no "
                             "task_id; set it to the task's token (models/vilbert/config.py task_token_id)")
        return torch.full((rows,), self.config.task_id, dtype=torch.long, device=device)

    def encode(self, batch: ModelBatch, roi_features: torch.Tensor | None = None,
               rows_per_image: int = 1) -> EncoderOutput:
        """The family-neutral outputs of a batch (models/common/output.py): text states at the text positions
        of batch.input_ids (zeros elsewhere), region states at their box slots (zeros at padded slots), and the
        fused pooled vector.

        `roi_features`, if given, replaces the visual network's output (`visual_features(batch,
        rows_per_image)`), e.g. features of a frozen network computed once per image. A training step may bypass
        only a frozen visual network: its output then depends on nothing that trains."""
        require_images(batch, "ViLBertModel.encode")
        if roi_features is None:
            roi_features = self.visual_features(batch, rows_per_image)
        elif self.visual_network.tune and torch.is_grad_enabled():
            raise ValueError("ViLBertModel.encode: precomputed roi_features would bypass the tuned visual network "
                             "(tune_frcnn) in a step that computes gradients")
        input_ids, token_types, text_mask = text_stream(batch, self.config.type_vocab_size)
        features, locations = roi_features, region_locations(batch.boxes, batch.image_size)
        if self.config.global_region == "mean_of_regions":
            features, locations = mean_global_region(features, locations, batch.box_valid)
        if batch.roi_masked is not None and bool(batch.roi_masked.any()):
            if bool(batch.roi_masked[:, 0].any()):
                raise ValueError("ViLBertModel.encode: box 0 (the whole image, read by the visual pooler) must never "
                                 "be masked")
            # the authors' masking of a region: its feature is zeroed, its location kept
            features = features.masked_fill(batch.roi_masked[..., None], 0.0)
        streams = self.forward_streams(input_ids, token_types, text_mask, features, locations, batch.box_valid,
                                       self.task_ids(input_ids.shape[0], input_ids.device))
        text_states = streams.text_states
        if self.config.task_specific_tokens:
            # the outputs stay aligned with batch.input_ids: the task token's state is read by no head here
            text_states = drop_task_token(text_states)
        text = text_states * text_mask[..., None].to(text_states.dtype)
        padding = text.new_zeros(text.shape[0], batch.input_ids.shape[1] - text.shape[1], text.shape[2])
        visual = streams.visual_states * batch.box_valid[..., None].to(streams.visual_states.dtype)
        return EncoderOutput(text_states=torch.cat([text, padding], dim=1),
                             text_mask=(batch.element_kind == TEXT) & batch.attention_mask,
                             visual_states=visual, visual_mask=batch.box_valid, pooled=streams.pooled,
                             roi_features=roi_features)

    def forward(self, batch: ModelBatch, roi_features: torch.Tensor | None = None,
                rows_per_image: int = 1) -> EncoderOutput:
        return self.encode(batch, roi_features, rows_per_image)

    # ---- initialisation, saving and loading -------------------------------------------------------------------

    def load_bert_weights(self, bert_state: dict[str, torch.Tensor]) -> None:
        """The text stream from BERT (transformers BertModel keys): its embeddings (token types included) and its
        first num_hidden_layers layers. BERT's pooler is not ViLBERT's text pooler (ReLU into bi_hidden_size):
        that one stays new, as in the authors' initialisation."""
        mapping = dict(_BERT_EMBEDDING_KEYS)
        mapping.update({bert: ours.replace("encoder.layers.", "encoder.text_layers.", 1)
                        for bert, ours in bert_encoder_key_map(self.config.num_hidden_layers).items()})
        copy_tensors(self, bert_state, mapping, where=f"BERT checkpoint {self.config.bert_path!r}")
