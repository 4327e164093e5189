"""Pre-training masks: whole-word MLM masking (15%, 80/10/10) and RoI masking (15% chosen, 90% masked)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from vlbert_core.models.common.inputs import IGNORE_INDEX

WORD_MASK_PROB = 0.15
MASK_TOKEN_SHARE = 0.8    # of the chosen words: replaced by [MASK]
RANDOM_TOKEN_SHARE = 0.1  # ... by random tokens; the remaining 10% stay as they are
ROI_SELECT_PROB = 0.15
ROI_MASK_SHARE = 0.9      # of the chosen RoIs: pixels zeroed; the other 10% keep their pixels


@dataclass(frozen=True)
class MaskingVocab:
    mask_id: int
    random_ids: np.ndarray  # ordinary WordPiece ids that a "random token" replacement draws from

    @classmethod
    def from_tokenizer(cls, tokenizer) -> "MaskingVocab":
        special = set(tokenizer.all_special_ids)
        vocab = tokenizer.get_vocab()
        ids = sorted(i for tok, i in vocab.items()
                     if i not in special and not (tok.startswith("[") and tok.endswith("]")))
        return cls(mask_id=int(tokenizer.mask_token_id), random_ids=np.asarray(ids, dtype=np.int64))


def word_groups(tokens: list[str]) -> list[list[int]]:
    """Token indices grouped into whole words: a WordPiece starting with "##" continues the previous word."""
    groups: list[list[int]] = []
    for i, tok in enumerate(tokens):
        if tok.startswith("##") and groups:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def whole_word_mask(input_ids: list[int], tokens: list[str], rng: np.random.Generator,
                    vocab: MaskingVocab, prob: float = WORD_MASK_PROB) -> tuple[list[int], list[int]]:
    """Mask whole words of one token sequence (no [CLS]/[SEP] in it).

    Each word is chosen with probability `prob` (independently, as in the released code); all its
    WordPieces get their original id as label, and are together replaced by [MASK] (80%), by random
    tokens (10%) or left unchanged (10%). Returns (new ids, labels with IGNORE_INDEX elsewhere).
    """
    if len(input_ids) != len(tokens):
        raise ValueError(f"whole_word_mask: {len(input_ids)} ids but {len(tokens)} tokens")
    ids = list(input_ids)
    labels = [IGNORE_INDEX] * len(ids)
    for group in word_groups(tokens):
        draw = rng.random()
        if draw >= prob:
            continue
        draw /= prob
        for i in group:
            labels[i] = input_ids[i]
        if draw < MASK_TOKEN_SHARE:
            for i in group:
                ids[i] = vocab.mask_id
        elif draw < MASK_TOKEN_SHARE + RANDOM_TOKEN_SHARE:
            for i in group:
                ids[i] = int(vocab.random_ids[rng.integers(len(vocab.random_ids))])
    return ids, labels


def mask_rois(num_rois: int, rng: np.random.Generator, select_prob: float = ROI_SELECT_PROB,
              mask_share: float = ROI_MASK_SHARE) -> tuple[np.ndarray, np.ndarray]:
    """Choose RoIs for masked RoI classification; box 0 (the whole image) is never chosen.

    Returns (selected, masked), Bool [num_rois]: selected RoIs carry a classification target; of those,
    90% are masked (pixels zeroed before the CNN, masked-RoI token), 10% keep their pixels.
    """
    selected = np.zeros(num_rois, dtype=bool)
    masked = np.zeros(num_rois, dtype=bool)
    for r in range(1, num_rois):
        draw = rng.random()
        if draw < select_prob:
            selected[r] = True
            masked[r] = draw / select_prob < mask_share
    return selected, masked
