"""Input embeddings: token + segment + position + visual feature, as in VL-BERT."""

from __future__ import annotations

import torch
from torch import nn

from ..common.inputs import END, IMG, TEXT
from .config import NUM_SEGMENTS, VLBertConfig

# Relation Networks' sin/cos box embedding: wavelengths wave_length^(i / (dim/8)), coordinates x100.
GEOMETRY_WAVE_LENGTH = 1000.0
GEOMETRY_COORD_SCALE = 100.0


def geometry_embedding(normalised_boxes: torch.Tensor, dim: int, wave_length: float = GEOMETRY_WAVE_LENGTH) -> torch.Tensor:
    """Sin/cos embedding of boxes [..., 4] in [0, 1] -> [..., dim].

    Each of the 4 coordinates gets dim/8 wavelengths 1000^(i/(dim/8)) (1000^(i/256) at dim 2048, as
    released) and a sin and a cos at each. The paper embeds the corners (x1/W, y1/H, x2/W, y2/H), which
    is what callers pass here; the released code embeds (centre, size) instead.
    """
    num_freqs = dim // 8
    exponents = torch.arange(num_freqs, device=normalised_boxes.device, dtype=torch.float32) / num_freqs
    wavelengths = torch.pow(torch.tensor(wave_length, device=normalised_boxes.device), exponents)
    angles = normalised_boxes.float()[..., None] * GEOMETRY_COORD_SCALE / wavelengths      # [..., 4, n]
    return torch.cat([angles.sin(), angles.cos()], dim=-1).flatten(-2)                       # [..., 8n]


# A feature dimension that barely varies is divided by at least this, so it cannot blow up.
APPEARANCE_STD_FLOOR = 1e-2


class VisualFeatureEmbedding(nn.Module):
    """[geometry || appearance] -> Dropout -> Linear -> ReLU, one vector per box (released `obj_downsample`).

    The geometry embeds the box corners or, with geometry_encoding "centre_size" as released, its centre and
    size, each divided by the width or height of the image the box is in (released: im_info, the resized
    image's size; common/fast_rcnn.py -> common/utils/bbox.py coordinate_embeddings).

    With masked_roi_input "feature" (the released "prec" models), the appearance of a masked RoI is replaced by
    the learned vector `masked_appearance` (released object_mask_visual_embedding, zero at start) before the
    projection.

    With `standardise_appearance`, each appearance dimension is first z-scored with the mean and standard
    deviation that `set_appearance_statistics` measured on RoI features. Raw features of a small frozen
    detector are mostly a constant vector (per dimension the mean exceeds the spread), so what tells one
    box from another is a small part of the visual term; z-scoring makes it the whole of it.
    """

    def __init__(self, config: VLBertConfig):
        super().__init__()
        self.geometry_dim = config.geometry_dim
        self.geometry_encoding = config.geometry_encoding
        self.standardise_appearance = config.standardise_appearance
        # Buffers, so they are saved with the model and every process and task uses the same numbers.
        self.register_buffer("appearance_mean", torch.zeros(config.appearance_dim))
        self.register_buffer("appearance_std", torch.ones(config.appearance_dim))
        # Only where masked RoIs reach the model as features: a parameter nothing reads would stall DDP.
        self.masked_appearance = (nn.Parameter(torch.zeros(config.appearance_dim))
                                  if config.masked_roi_input == "feature" else None)
        # The released config has Dropout(0.1) here, BERT's hidden dropout: taking the checkpoint's value
        # keeps 0.1 for every BERT and lets a dropout-free config be truly deterministic.
        self.dropout = nn.Dropout(config.hidden_dropout_prob)
        self.linear = nn.Linear(config.geometry_dim + config.appearance_dim, config.hidden_size)
        self.activation = nn.ReLU()

    @torch.no_grad()
    def set_appearance_statistics(self, features: torch.Tensor) -> None:
        """Per-dimension mean and standard deviation of `features` [N, appearance_dim], RoI features of real
        boxes from the visual network."""
        dim = self.appearance_mean.numel()
        if features.ndim != 2 or features.shape[1] != dim or features.shape[0] < 2:
            raise ValueError(f"set_appearance_statistics: need RoI features [N >= 2, {dim}], got {tuple(features.shape)}")
        features = features.float()
        self.appearance_mean.copy_(features.mean(0))
        self.appearance_std.copy_(features.std(0).clamp(min=APPEARANCE_STD_FLOOR))

    def forward(self, boxes: torch.Tensor, appearance: torch.Tensor, image_size: torch.Tensor,
                roi_masked: torch.Tensor | None = None) -> torch.Tensor:
        """boxes [B, R, 4] pixel x1,y1,x2,y2; appearance [B, R, D]; image_size [B, 2] (width, height);
        roi_masked Bool [B, R] (read with masked_roi_input "feature" only)."""
        if self.masked_appearance is not None and roi_masked is not None:
            appearance = torch.where(roi_masked[..., None], self.masked_appearance.to(appearance.dtype), appearance)
        if self.standardise_appearance:
            appearance = (appearance - self.appearance_mean.to(appearance.dtype)) / self.appearance_std.to(appearance.dtype)
        # clamp keeps the rows of text-only samples (size 0, no real box) finite
        size = image_size[:, None, :].to(boxes.dtype).clamp(min=1.0)                            # [B, 1, 2]
        if self.geometry_encoding == "centre_size":
            boxes = torch.cat([(boxes[..., :2] + boxes[..., 2:]) / 2, boxes[..., 2:] - boxes[..., :2]], dim=-1)
        normalised = boxes / size.repeat(1, 1, 2)
        geometry = geometry_embedding(normalised, self.geometry_dim).to(appearance.dtype)
        return self.activation(self.linear(self.dropout(torch.cat([geometry, appearance], dim=-1))))


class VLBertEmbeddings(nn.Module):
    def __init__(self, config: VLBertConfig):
        super().__init__()
        hidden = config.hidden_size
        self.word_embeddings = nn.Embedding(config.vocab_size, hidden)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, hidden)
        self.segment_embeddings = nn.Embedding(NUM_SEGMENTS, hidden)
        self.layer_norm = nn.LayerNorm(hidden, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)
        # Learned token embeddings of the visual elements.
        self.img_token = nn.Parameter(torch.zeros(hidden))
        self.masked_roi_token = nn.Parameter(torch.zeros(hidden))
        self.end_token = nn.Parameter(torch.zeros(hidden))
        # The visual term of a text-only sample; zero at start so such a sample is exactly BERT's input.
        self.text_only_visual = nn.Parameter(torch.zeros(hidden))
        self.visual_feature = VisualFeatureEmbedding(config)
        # As released: the visual term enters through a LayerNorm (one for the words/[END], which see box 0,
        # and one for the [IMG] elements) whose weight starts at visual_scale_*_init (released: 0, so
        # training starts from BERT) and whose bias starts at 0.
        self.visual_norm_text = nn.LayerNorm(hidden, eps=config.layer_norm_eps)
        self.visual_norm_object = nn.LayerNorm(hidden, eps=config.layer_norm_eps)
        self.visual_scale_text_init = config.visual_scale_text_init
        self.visual_scale_object_init = config.visual_scale_object_init
        self.end_visual_term = config.end_visual_term
        self.text_only_visual_norm = config.text_only_visual_norm

    def reset_special_parameters(self, std: float) -> None:
        for p in (self.img_token, self.masked_roi_token, self.end_token):
            nn.init.normal_(p, std=std)
        nn.init.zeros_(self.text_only_visual)
        for norm, scale in ((self.visual_norm_text, self.visual_scale_text_init),
                            (self.visual_norm_object, self.visual_scale_object_init)):
            nn.init.constant_(norm.weight, scale)
            nn.init.zeros_(norm.bias)

    def forward(self, input_ids: torch.Tensor, element_kind: torch.Tensor, segment_ids: torch.Tensor,
                position_ids: torch.Tensor, roi_index: torch.Tensor, has_image: torch.Tensor,
                boxes: torch.Tensor | None, roi_features: torch.Tensor | None,
                roi_masked: torch.Tensor | None, image_size: torch.Tensor | None = None) -> torch.Tensor:
        is_img = (element_kind == IMG)[..., None]
        is_text = (element_kind == TEXT)[..., None]

        # Token: WordPiece for words, else one of the learned [IMG] / masked-RoI / [END] vectors.
        special = torch.stack([self.img_token, self.masked_roi_token, self.end_token])      # [3, H]
        special_index = torch.where(element_kind == END, 2, 0)
        if roi_masked is not None:
            element_masked = torch.gather(roi_masked, 1, roi_index) & (element_kind == IMG)
            special_index = special_index + element_masked.long()
        token = torch.where(is_text, self.word_embeddings(input_ids), special[special_index])

        text_only_visual = self.text_only_visual
        if self.text_only_visual_norm:
            text_only_visual = self.visual_norm_text(text_only_visual)
        visual = text_only_visual.expand_as(token)
        if roi_features is not None:
            if image_size is None:
                raise ValueError("VLBertEmbeddings: RoI features need the image sizes their boxes are in")
            per_box = self.visual_feature(boxes, roi_features, image_size, roi_masked)           # [B, R, H]
            # Each LayerNorm runs on the boxes, not the elements (an element is its box's vector): [IMG]
            # elements take their box through visual_norm_object; a word takes the box its roi_index names
            # (box 0, the whole image, unless the word refers to an object: VCR) through visual_norm_text, as
            # does [END] (box 0).
            index = roi_index[..., None].expand(-1, -1, per_box.shape[-1])
            image_visual = torch.where(is_img, torch.gather(self.visual_norm_object(per_box), 1, index),
                                       torch.gather(self.visual_norm_text(per_box), 1, index))
            visual = torch.where(has_image[:, None, None], image_visual, visual)
        if not self.end_visual_term:
            # released: [END] is its token embedding alone (plus position and segment)
            visual = visual.masked_fill((element_kind == END)[..., None], 0.0)

        embeddings = token + visual + self.position_embeddings(position_ids) + self.segment_embeddings(segment_ids)
        return self.dropout(self.layer_norm(embeddings))
