"""ViLBERT's two input embeddings: BERT's for the text stream, a linear one of (feature, location) for the regions."""

from __future__ import annotations

import torch
from torch import nn

from .config import ViLBertConfig

LOCATION_DIM = 5   # x1/W, y1/H, x2/W, y2/H, box area / image area


TASK_TOKEN_POSITION = 1   # where the task token goes: right after [CLS]


class TextEmbeddings(nn.Module):
    """BERT's input embedding: word + position (0..T-1) + token type, LayerNorm, dropout.

    With task tokens (config task_specific_tokens, the authors' multi-task models) the task's embedding is
    inserted at TASK_TOKEN_POSITION before the LayerNorm, with no position or token-type embedding of its own:
    the words keep positions 0..T-1 and the output is T + 1 long (vilbert-multi-task's BertEmbeddings)."""

    def __init__(self, config: ViLBertConfig):
        super().__init__()
        hidden = config.hidden_size
        self.word_embeddings = nn.Embedding(config.vocab_size, hidden)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, hidden)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, hidden)
        self.task_embeddings = (nn.Embedding(config.task_token_count, hidden) if config.task_specific_tokens
                                else None)
        self.layer_norm = nn.LayerNorm(hidden, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor,
                task_ids: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids, token_type_ids: Long [B, T]; task_ids Long [B] (with task tokens only) -> [B, T, hidden],
        or [B, T + 1, hidden] with the task token at TASK_TOKEN_POSITION."""
        length = input_ids.shape[1]
        if length > self.position_embeddings.num_embeddings:
            raise ValueError(f"TextEmbeddings: {length} text elements, max_position_embeddings is "
                             f"{self.position_embeddings.num_embeddings}")
        positions = torch.arange(length, device=input_ids.device)[None, :]
        embeddings = (self.word_embeddings(input_ids) + self.position_embeddings(positions)
                      + self.token_type_embeddings(token_type_ids))
        if (self.task_embeddings is None) != (task_ids is None):
            raise ValueError("TextEmbeddings: task ids are given exactly when the model has task tokens "
                             f"(task_specific_tokens={self.task_embeddings is not None}, task ids "
                             f"{'given' if task_ids is not None else 'not given'})")
        if self.task_embeddings is not None:
            count = self.task_embeddings.num_embeddings
            if task_ids.shape != input_ids.shape[:1] or bool(((task_ids < 0) | (task_ids >= count)).any()):
                raise ValueError(f"TextEmbeddings: task ids must be one per row in 0..{count - 1}, got "
                                 f"{task_ids.tolist()}")
            task = self.task_embeddings(task_ids)[:, None]
            embeddings = torch.cat([embeddings[:, :TASK_TOKEN_POSITION], task, embeddings[:, TASK_TOKEN_POSITION:]],
                                   dim=1)
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
