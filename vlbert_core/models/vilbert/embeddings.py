"""ViLBERT's two input embeddings: BERT's for the text stream, a linear one of (feature, location) for the regions."""

from __future__ import annotations

import torch
from torch import nn

from .config import ViLBertConfig

LOCATION_DIM = 5   # x1/W, y1/H, x2/W, y2/H, box area / image area


class TextEmbeddings(nn.Module):
    """BERT's input embedding: word + position (0..T-1) + token type, LayerNorm, dropout."""

    def __init__(self, config: ViLBertConfig):
        super().__init__()
        hidden = config.hidden_size
        self.word_embeddings = nn.Embedding(config.vocab_size, hidden)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, hidden)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, hidden)
        self.layer_norm = nn.LayerNorm(hidden, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor) -> torch.Tensor:
        """input_ids, token_type_ids: Long [B, T] -> [B, T, hidden]."""
        length = input_ids.shape[1]
        if length > self.position_embeddings.num_embeddings:
            raise ValueError(f"TextEmbeddings: {length} text elements, max_position_embeddings is "
                             f"{self.position_embeddings.num_embeddings}")
        positions = torch.arange(length, device=input_ids.device)[None, :]
        embeddings = (self.word_embeddings(input_ids) + self.position_embeddings(positions)
                      + self.token_type_embeddings(token_type_ids))
        return self.dropout(self.layer_norm(embeddings))


class ImageEmbeddings(nn.Module):
    """One vector per region: Linear(feature) + Linear(5-d location), LayerNorm, dropout (the authors'
    BertImageEmbeddings; its dropout is BERT's hidden_dropout_prob, not the visual stream's)."""

    def __init__(self, config: ViLBertConfig):
        super().__init__()
        self.feature = nn.Linear(config.appearance_dim, config.v_hidden_size)
        self.location = nn.Linear(LOCATION_DIM, config.v_hidden_size)
        self.layer_norm = nn.LayerNorm(config.v_hidden_size, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, features: torch.Tensor, locations: torch.Tensor) -> torch.Tensor:
        """features [B, R, appearance_dim], locations [B, R, 5] -> [B, R, v_hidden]."""
        return self.dropout(self.layer_norm(self.feature(features) + self.location(locations.to(features.dtype))))


def region_locations(boxes: torch.Tensor, image_size: torch.Tensor) -> torch.Tensor:
    """The 5-d location of each box, as the authors' datasets compute it: (x1/W, y1/H, x2/W, y2/H,
    (x2 - x1)(y2 - y1) / (W H)), the area taken in pixels before the corners are divided.

    boxes [B, R, 4] pixel x1, y1, x2, y2; image_size [B, 2] (W, H) of the image the boxes are in -> [B, R, 5]."""
    size = image_size[:, None, :].to(boxes.dtype).clamp(min=1.0)                  # [B, 1, 2]; clamp: no 0/0
    width, height = size[..., 0:1], size[..., 1:2]
    area = (boxes[..., 2:3] - boxes[..., 0:1]) * (boxes[..., 3:4] - boxes[..., 1:2]) / (width * height)
    return torch.cat([boxes / size.repeat(1, 1, 2), area], dim=-1)
