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

    def __len__(self) -> int:
        return len(self.input_ids)


def build_input_sequence(ids_a: list[int], ids_b: list[int] | None, num_rois: int | None, *, cls_id: int,
                         sep_id: int, pad_id: int, text_only_end: bool = False) -> InputSequence:
    """[CLS] A [SEP] (B [SEP])? then num_rois [IMG] elements, then [END].

    num_rois None builds a text-only <Text, ∅> sample (no [IMG]; no [END] either, unless `text_only_end`, as the
    released code, whose text-only samples end with [END] right after the text); otherwise num_rois counts
    box 0 (the whole image) and must be >= 1. Segments: A = 0, B = 1, IMG/END = 2. Positions: text
    0, 1, ...; every [IMG] shares the next id (RoIs are unordered) and [END] takes the one after.
    """
    ids_a = [int(i) for i in ids_a]
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
    elif text_only_end:
        input_ids.append(pad_id)
        element_kind.append(END)
        segment_ids.append(SEGMENT_VISUAL)
        position_ids.append(num_text)
        roi_index.append(0)
    return InputSequence(input_ids=input_ids, element_kind=element_kind, segment_ids=segment_ids,
                         position_ids=position_ids, roi_index=roi_index)


def boxes_with_whole_image(boxes: np.ndarray, image_w: float, image_h: float, max_rois: int) -> np.ndarray:
    """Prepend the whole-image box [0, 0, W, H] and keep the first max_rois - 1 given boxes.

    `boxes` (N x 4, x1,y1,x2,y2 in pixels of the image the model sees) must already be sorted by score.
    """
    if max_rois < 1:
        raise ValueError(f"boxes_with_whole_image: max_rois must be >= 1, got {max_rois}")
    if image_w <= 0 or image_h <= 0:
        raise ValueError(f"boxes_with_whole_image: image size must be positive, got {image_w}x{image_h}")
    boxes = np.asarray(boxes, dtype=np.float32).reshape(-1, 4)
    whole = np.array([[0.0, 0.0, float(image_w), float(image_h)]], dtype=np.float32)
    return np.concatenate([whole, boxes[: max_rois - 1]], axis=0)
