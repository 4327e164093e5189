"""How much of a VCR candidate reaches the `[CLS]` output of the BERT initialiser, layer by layer (#19).

A diagnostic: run to settle one question, not a benchmark that is re-run. Backs docs/benchmarks.md "What the
[CLS] output carries in the BERT initialiser" and docs/default-run.md "Why pre-training does not help more"
(the `[CLS]` bullet).

VCR scores each of a question's four candidate sequences from one vector (DESIGN §4: `[CLS]`). BERT-BASE
was pre-trained with next-sentence prediction on `[CLS]`, so its `[CLS]` output summarises the pair from the
start. The embedded world's initialiser (MiniLM-L6, sentence-transformers' all-MiniLM-L6-v2) was trained with
mean pooling instead, and the world keeps only its first `model.num_hidden_layers` layers. This script
measures, for each layer's output, how far apart the four candidates of a question are:

    spread = RMS distance of a question's candidate vectors from their mean / RMS vector length

for the `[CLS]` output and for the mean of the text outputs (finetune.sentence_readout: text_mean). A spread
near 0 means the head sees the same vector for every candidate: a score from it cannot tell them apart until
fine-tuning has taught `[CLS]` to gather the words.

    uv run python benchmarks/diagnostics/sentence_readout.py VCR_JSONL [--config config/config.yaml] [--questions 200]
                                                 [--write-docs]

VCR_JSONL is a VCR split in the official format, e.g. resources/synthetic/vcr/val.jsonl of a run (the `world`
rule writes it). Only the text is read: no image, no fine-tuned model.
"""

from __future__ import annotations

import argparse
import sys
from datetime import date
from pathlib import Path
from typing import TYPE_CHECKING

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/, for docs_section
from docs_section import replace_section  # noqa: E402

# torch, transformers and the tokenizer are imported where the BERT runs: --help answers without them
from vlbert_core.tasks.vcr import candidate_texts, load_vcr, mixed_tokens_to_words  # noqa: E402

if TYPE_CHECKING:
    import torch

HEADING = "## What the [CLS] output carries in the BERT initialiser"


def candidate_spread(vectors: torch.Tensor) -> float:
    """[questions, candidates, hidden] -> RMS distance from each question's candidate mean / RMS length."""
    if vectors.dim() != 3 or vectors.shape[1] < 2:
        raise ValueError(f"expected [questions, >= 2 candidates, hidden] vectors, got shape {tuple(vectors.shape)}")
    distance = (vectors - vectors.mean(dim=1, keepdim=True)).pow(2).sum(-1).mean().sqrt()
    length = vectors.pow(2).sum(-1).mean().sqrt()
    return float(distance / length)


def text(tokens, objects) -> str:
    return " ".join(word for word, _ in mixed_tokens_to_words(tokens, objects))


def layer_spreads(bert_spec: str, jsonl: Path, num_questions: int) -> list[tuple[int, float, float]]:
    """[(layer, [CLS] spread, text-mean spread)] over the Q->A candidates of the first questions of `jsonl`;
    layer 0 is the embeddings."""
    import torch
    from transformers import BertModel

    from vlbert_core.models.common.bert_init import load_tokenizer, resolve_bert_path

    items = load_vcr(jsonl)[:num_questions]
    if not items:
        raise ValueError(f"{jsonl}: no VCR questions")
    tokenizer = load_tokenizer(bert_spec)
    model = BertModel.from_pretrained(str(resolve_bert_path(bert_spec))).eval()
    firsts, seconds = [], []
    for item in items:
        question, answers = candidate_texts(item, "q2a")
        for answer in answers:
            firsts.append(text(question, item.objects))
            seconds.append(text(answer, item.objects))
    cls, means = [], []
    for start in range(0, len(firsts), 64):
        enc = tokenizer(firsts[start:start + 64], seconds[start:start + 64], return_tensors="pt", padding=True)
        with torch.no_grad():
            hidden = model(**enc, output_hidden_states=True).hidden_states
        weights = enc["attention_mask"].unsqueeze(-1).float()  # [CLS], words, [SEP]s: every text element
        cls.append(torch.stack([h[:, 0] for h in hidden]))
        means.append(torch.stack([(h * weights).sum(1) / weights.sum(1) for h in hidden]))
    cls_all, mean_all = torch.cat(cls, dim=1), torch.cat(means, dim=1)  # [layers + 1, pairs, hidden]
    shape = (len(items), len(firsts) // len(items), -1)
    return [(layer, candidate_spread(cls_all[layer].reshape(shape)), candidate_spread(mean_all[layer].reshape(shape)))
            for layer in range(cls_all.shape[0])]


def table(rows: list[tuple[int, float, float]], kept_layers: int) -> str:
    lines = ["| layer output | `[CLS]` spread | text-mean spread |", "|---|---:|---:|"]
    for layer, cls_spread, mean_spread in rows:
        name = "embeddings" if layer == 0 else f"layer {layer}"
        if layer == kept_layers:
            name += " (the world's model ends here)"
        lines.append(f"| {name} | {cls_spread:.4f} | {mean_spread:.4f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("vcr_jsonl", type=Path)
    parser.add_argument("--config", type=Path, default=Path("config/config.yaml"))
    parser.add_argument("--questions", type=int, default=200)
    parser.add_argument("--write-docs", action="store_true")
    args = parser.parse_args(argv)
    model_cfg = yaml.safe_load(args.config.read_text())["model"]
    rows = layer_spreads(model_cfg["bert_path"], args.vcr_jsonl, args.questions)
    result = table(rows, int(model_cfg["num_hidden_layers"]))
    print(result)
    if args.write_docs:
        body = (f"`uv run python benchmarks/diagnostics/sentence_readout.py {args.vcr_jsonl} --questions {args.questions}` "
                f"in a run directory, {date.today().isoformat()} (initialiser `{model_cfg['bert_path']}`, Q->A "
                f"candidates of the first {args.questions} questions, text only). Spread: how far apart a question's four candidate vectors are, relative "
                "to their length (0: the head sees one vector for all four).\n\n" + result)
        replace_section(HEADING, body)


if __name__ == "__main__":
    main()
