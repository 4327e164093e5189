"""The visual-clue check: MLM accuracy on the words of held-out captions, with the image and with it blanked.

Task 1 of VL-BERT is "MLM with visual clues": a masked caption word should be easier to predict when the
model sees the picture. Every word of every held-out caption is masked exactly once: a caption of n words
gives min(n, WORD_STRIDE) sequences, sequence j masking words j, j + 7, j + 14, ... (all their WordPieces
become [MASK]): about 15% of the words, the training rate. The MLM head predicts them twice: once with the
image and its RoIs, once with the image blanked. The accuracy is over masked WordPieces, like the training
metric `mlm_acc`. Masking one word per sequence would cost 7 times as many forward passes.

Both conditions predict the same masked WordPieces, so they are compared token by token: the tokens right in only
one condition, and a two-sided exact sign test on them (tokens right or wrong in both say nothing about the image).
"""

from __future__ import annotations

import math

import torch

from vlbert_core.models.common.batch import collate_samples
from vlbert_core.models.common.inputs import IGNORE_INDEX, build_input_sequence
from vlbert_core.utils import get_logger

from .masking import word_groups

log = get_logger(__name__)

# Blanking keeps the input exactly in its training format: same boxes, same [IMG] elements, same length,
# with every pixel zeroed in the normalised image (the ImageNet-mean grey that masked-RoI training writes
# into masked boxes). The appearance of every box and of the whole image is gone. The boxes' geometry
# stays, which can only help the blanked run (e.g. box sizes hint at "small"/"large"): the gap measured
# is a lower bound on what the pixels contribute.
BLANKING = "pixels zeroed (normalised image = ImageNet mean), boxes and [IMG] elements kept"
WORD_STRIDE = 7          # every 7th word masked together: 1/7 = 14% of the words, as in training (15%)
CAPTIONS_PER_CHUNK = 16  # captions whose masked variants share one forward pass


def strided_word_variants(ids: list[int], tokens: list[str], mask_id: int,
                          stride: int = WORD_STRIDE) -> list[tuple[list[int], list[int]]]:
    """(input ids, labels) pairs that mask every whole word exactly once: variant j masks words j, j + stride,
    ... (their WordPieces -> [MASK], labelled with their ids); other positions unchanged, label IGNORE_INDEX."""
    groups = word_groups(tokens)
    variants = []
    for first in range(min(stride, len(groups))):
        masked, labels = list(ids), [IGNORE_INDEX] * len(ids)
        for group in groups[first::stride]:
            for i in group:
                masked[i], labels[i] = mask_id, ids[i]
        variants.append((masked, labels))
    return variants


def sign_test_p(wins: int, losses: int) -> float:
    """Two-sided exact sign test: the chance, if each discordant token were a fair coin, of a split at least as
    uneven as wins / losses."""
    n = wins + losses
    tail = sum(math.comb(n, k) for k in range(min(wins, losses) + 1)) / 2 ** n
    return min(1.0, 2 * tail)


@torch.no_grad()
def _chunk_correct(model, mlm_head, captions: list[dict], tokenizer, device) -> torch.Tensor:
    """Whether each masked WordPiece over all masked variants of `captions` is predicted right (bool, in a fixed
    order: caption, variant, position)."""
    def sequence(ids: list[int], num_boxes: int):
        return build_input_sequence(ids, None, num_boxes, cls_id=tokenizer.cls_token_id,
                                    sep_id=tokenizer.sep_token_id, pad_id=tokenizer.pad_token_id)

    # The visual network runs once per image; all masked variants of its caption reuse the features.
    images = collate_samples([{"sequence": sequence(c["ids"], len(c["boxes"])), "image": c["image"],
                               "boxes": c["boxes"]} for c in captions])
    roi_features = model.visual_features(images.to(device))                               # [C, R, D]
    samples, owner, labels = [], [], []
    for caption_index, caption in enumerate(captions):
        for masked_ids, variant_labels in caption["variants"]:
            # Pixels are not needed again, only the sequence and boxes: a 1-pixel stand-in keeps collate's checks.
            samples.append({"sequence": sequence(masked_ids, len(caption["boxes"])),
                            "image": caption["image"][:, :1, :1], "boxes": caption["boxes"]})
            owner.append(caption_index)
            labels.append([IGNORE_INDEX, *variant_labels])   # [CLS] first
    batch = collate_samples(samples)
    batch.images = None
    batch = batch.to(device)
    features = roi_features[torch.as_tensor(owner, device=device), : batch.boxes.shape[1]]
    hidden = model(batch, roi_features=features).text_states
    label_tensor = torch.full(batch.input_ids.shape, IGNORE_INDEX, dtype=torch.long)
    for row, row_labels in enumerate(labels):
        label_tensor[row, : len(row_labels)] = torch.as_tensor(row_labels)
    label_tensor = label_tensor.to(device)
    target = label_tensor != IGNORE_INDEX
    predicted = mlm_head(hidden[target]).argmax(-1)
    return (predicted == label_tensor[target]).cpu()


def visual_clue_check(model, mlm_head, held_out: list[dict], tokenizer, max_caption_len: int,
                      device: torch.device) -> dict:
    """MLM accuracy on the words of `held_out` captions (dicts with caption, image, boxes: see
    data.read_held_out_captions), with the image and blanked. Returns the record written to
    visual_clue.json."""
    was_training = model.training
    model.eval()
    mlm_head.eval()
    captions, words = [], 0
    for sample in held_out:
        ids = tokenizer(sample["caption"], add_special_tokens=False)["input_ids"][: max_caption_len - 2]
        if not ids:
            continue
        tokens = tokenizer.convert_ids_to_tokens(ids)
        variants = strided_word_variants(ids, tokens, tokenizer.mask_token_id)
        captions.append({"ids": ids, "variants": variants, "image": sample["image"], "boxes": sample["boxes"]})
        words += len(word_groups(tokens))
    record = {"captions": len(captions), "masked_words": words, "blanking": BLANKING,
              "metric": f"MLM accuracy over the WordPieces of every caption word, masked once, every "
                        f"{WORD_STRIDE}th word together"}
    results, right = {}, {}
    for condition in ("with_image", "blank_image"):
        chunks = []
        for start in range(0, len(captions), CAPTIONS_PER_CHUNK):
            chunk = captions[start:start + CAPTIONS_PER_CHUNK]
            if condition == "blank_image":
                chunk = [dict(c, image=torch.zeros_like(c["image"])) for c in chunk]
            chunks.append(_chunk_correct(model, mlm_head, chunk, tokenizer, device))
        right[condition] = torch.cat(chunks) if chunks else torch.zeros(0, dtype=torch.bool)
        correct, total = int(right[condition].sum()), right[condition].numel()
        results[condition] = {"mlm_acc": correct / total if total else None, "correct": correct,
                              "masked_tokens": total}
    record.update(results)
    only_with_image = int((right["with_image"] & ~right["blank_image"]).sum())
    only_blanked = int((right["blank_image"] & ~right["with_image"]).sum())
    record["paired"] = {"right_only_with_image": only_with_image, "right_only_blanked": only_blanked,
                        "sign_test_p": sign_test_p(only_with_image, only_blanked)}
    model.train(was_training)
    mlm_head.train(was_training)
    log.info("visual-clue check on %d held-out captions (%d words): MLM accuracy %s with the image, %s with it "
             "blanked; right only with the image / only blanked %d / %d (sign test p = %.3g)", record["captions"],
             words, results["with_image"]["mlm_acc"], results["blank_image"]["mlm_acc"], only_with_image,
             only_blanked, record["paired"]["sign_test_p"])
    return record
