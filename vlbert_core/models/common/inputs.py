"""The VL-BERT input sequence: [CLS] A [SEP] (B [SEP])? [IMG]... [END], with its segment and position ids."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

TEXT, IMG, END = 0, 1, 2  # element kinds
SEGMENT_A, SEGMENT_B, SEGMENT_VISUAL = 0, 1, 2
IGNORE_INDEX = -100  # label of positions without a target, for every loss (torch's cross_entropy default)


@dataclass
class InputSequence:
    input_ids: list[int]      # WordPiece ids; [IMG] and [END] elements carry pad_id (their token is learned)
    element_kind: list[int]   # TEXT / IMG / END
    segment_ids: list[int]
    position_ids: list[int]
    roi_index: list[int]      # IMG element -> index of its box in the sample's boxes; text/END -> 0
    # index of sentence A's first word piece: 1, after [CLS]; 0 in a "released" text-only row (no [CLS])
    words_start: int = 1

    def __len__(self) -> int:
        return len(self.input_ids)

    def word_labels(self, labels: list[int]) -> list[int]:
        """One label per element: `labels` (one per word piece of sentence A, in order) at those word pieces,
        IGNORE_INDEX before them ([CLS]) and after them to the end of the sequence."""
        out = [IGNORE_INDEX] * self.words_start + list(labels)
        if len(out) > len(self.input_ids):
            raise ValueError(f"InputSequence.word_labels: {len(labels)} labels from element {self.words_start} "
                             f"do not fit a sequence of {len(self.input_ids)} elements")
        return out + [IGNORE_INDEX] * (len(self.input_ids) - len(out))


# How a <Text, ∅> sample is laid out (VLBertConfig.text_only_layout):
# "bert": [CLS] text [SEP], BERT's own input, no visual element;
# "released": the word pieces alone, then [END] (the authors' general_corpus.py gives the ids only, and
# visual_linguistic_bert.py ends every row with [END] at the position id after the next, even with no object).
TEXT_ONLY_LAYOUTS = ("bert", "released")
# the special elements of each layout that count in a text-only row's max_text_len: "bert" its [CLS] and [SEP];
# "released" none (general_corpus.py cuts its ids to SEQ_LEN and [END] comes on top)
_TEXT_ONLY_SPECIALS = {"bert": 2, "released": 0}


def text_only_words(max_text_len: int, text_only_layout: str = "bert") -> int:
    """How many word pieces a text-only row of `text_only_layout` holds within `max_text_len`."""
    if text_only_layout not in TEXT_ONLY_LAYOUTS:
        raise ValueError(f"text_only_words: text_only_layout must be one of {TEXT_ONLY_LAYOUTS}, "
                         f"got {text_only_layout!r}")
    return int(max_text_len) - _TEXT_ONLY_SPECIALS[text_only_layout]


def build_input_sequence(ids_a: list[int], ids_b: list[int] | None, num_rois: int | None, *, cls_id: int,
                         sep_id: int, pad_id: int, text_only_layout: str = "bert") -> InputSequence:
    """[CLS] A [SEP] (B [SEP])? then num_rois [IMG] elements, then [END].

    num_rois None builds a text-only <Text, ∅> sample, laid out as `text_only_layout` says (TEXT_ONLY_LAYOUTS);
    otherwise num_rois counts box 0 (the whole image) and must be >= 1. Segments: A = 0, B = 1, IMG/END = 2.
    Positions: text 0..T-1; every [IMG] shares T (RoIs are unordered) and [END] takes T+1, also when there is
    no [IMG] (released text-only rows: the authors' [END] position is text_end + 1 whatever the objects).
    """
    if text_only_layout not in TEXT_ONLY_LAYOUTS:
        raise ValueError(f"build_input_sequence: text_only_layout must be one of {TEXT_ONLY_LAYOUTS}, "
                         f"got {text_only_layout!r}")
    ids_a = [int(i) for i in ids_a]
    if num_rois is None and text_only_layout == "released":
        if ids_b is not None:
            raise ValueError("build_input_sequence: a released text-only sample has one text, not a pair")
        num_text = len(ids_a)
        return InputSequence(input_ids=[*ids_a, pad_id], element_kind=[TEXT] * num_text + [END],
                             segment_ids=[SEGMENT_A] * num_text + [SEGMENT_VISUAL],
                             position_ids=[*range(num_text), num_text + 1], roi_index=[0] * (num_text + 1),
                             words_start=0)
    input_ids = [cls_id, *ids_a, sep_id]
    segment_ids = [SEGMENT_A] * len(input_ids)
    if ids_b is not None:
        ids_b = [int(i) for i in ids_b]
        input_ids += [*ids_b, sep_id]
        segment_ids += [SEGMENT_B] * (len(ids_b) + 1)
    num_text = len(input_ids)
    element_kind = [TEXT] * num_text
    position_ids = list(range(num_text))
    roi_index = [0] * num_text
    if num_rois is not None:
        if num_rois < 1:
            raise ValueError(f"build_input_sequence: num_rois must be >= 1 (box 0 is the whole image), got {num_rois}")
        input_ids += [pad_id] * (num_rois + 1)
        element_kind += [IMG] * num_rois + [END]
        segment_ids += [SEGMENT_VISUAL] * (num_rois + 1)
        position_ids += [num_text] * num_rois + [num_text + 1]
        roi_index += list(range(num_rois)) + [0]
    return InputSequence(input_ids=input_ids, element_kind=element_kind, segment_ids=segment_ids,
                         position_ids=position_ids, roi_index=roi_index)


def boxes_with_whole_image(boxes: np.ndarray, image_size: tuple[int, int], original_size: tuple[int, int],
                           max_rois: int) -> np.ndarray:
    """Box 0 (the whole image) followed by the first max_rois - 1 given boxes, all clamped into the image.

    `boxes` (N x 4, x1,y1,x2,y2, already scaled to the image the model sees, sorted by score); `image_size`
    (W, H): that image's size; `original_size` (W0, H0): the size the image had before it was resized. As the
    authors' datasets do (conceptual_captions.py, vqa.py, refcoco.py), box coordinates are pixel indices:
    box 0 is [0, 0, W0 - 1, H0 - 1] scaled by (W/W0, H/H0), and every box is clamped to [0, W - 1] x [0, H - 1].
    """
    if max_rois < 1:
        raise ValueError(f"boxes_with_whole_image: max_rois must be >= 1, got {max_rois}")
    (width, height), (orig_w, orig_h) = image_size, original_size
    if min(width, height, orig_w, orig_h) <= 0:
        raise ValueError(f"boxes_with_whole_image: image sizes must be positive, got {width}x{height} "
                         f"(original {orig_w}x{orig_h})")
    boxes = np.asarray(boxes, dtype=np.float32).reshape(-1, 4)
    whole = np.array([[0.0, 0.0, (orig_w - 1.0) * width / orig_w, (orig_h - 1.0) * height / orig_h]], dtype=np.float32)
    out = np.concatenate([whole, boxes[: max_rois - 1]], axis=0)
    out[:, 0::2] = out[:, 0::2].clip(0.0, width - 1.0)
    out[:, 1::2] = out[:, 1::2].clip(0.0, height - 1.0)
    return out
