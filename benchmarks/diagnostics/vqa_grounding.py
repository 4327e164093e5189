"""What pre-training taught about VQA's objects: the pre-trained MLM head answers VQA val questions zero-shot (#54).

A diagnostic: run to settle one question, not a benchmark that is re-run. Backs docs/benchmarks.md "What
pre-training teaches about VQA's objects (zero-shot)" and docs/default-run.md "Why pre-training does not help
more".

The world's VQA asks `what color is the star?` and `what is the blue object?`; its captions say `a small red
circle above a blue star`. If pre-training taught the model to find a named object among the RoIs and read it,
the pre-trained MLM head fills `a [MASK] star` with the star's colour on an image it never saw. This script
rewrites each colour and kind question of a VQA split into that caption form (the world's own word order: size,
colour, kind), lets each setting's pre-trained model (`results/pretrain/<setting>/model.safetensors` and
`heads.safetensors`, no fine-tuning) predict the masked word among the question type's candidates (the 7 colours,
the 8 kinds), once with the image and once blanked (pixels zeroed, boxes kept, as the visual-clue check does),
and scores the prediction against the consensus answer. Counting and yes/no questions have no caption form and
are left out (the counts of questions kept and left out are printed).

    uv run python benchmarks/diagnostics/vqa_grounding.py [--run RUN_DIR] [--settings none a b c d full]
                                                          [--model LABEL=PRETRAIN_DIR ...] [--split val] [--write-docs]

RUN_DIR is a finished default run (`snakemake ... results/tables/table4_ablation.csv`; default: this checkout).
`--model` adds a pre-trained directory of another run under a label (e.g. `a@2400=../longer/results/pretrain/a`),
with its own config (another model size loads too) and RUN_DIR's VQA data and RoIs; `--max-rois` for a model
pre-trained with another `model.max_rois`. About 1 minute per setting on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import collections
import re
import sys
import time
from dataclasses import dataclass
from datetime import date
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/, for docs_section
sys.path.insert(0, str(Path(__file__).resolve().parent))  # visual_grounding's Run
from docs_section import replace_section  # noqa: E402
from visual_grounding import Run, VLBertForPretraining  # noqa: E402

from vlbert_core.models.common.batch import collate_samples  # noqa: E402
from vlbert_core.models.common.config import visual_pixel_format  # noqa: E402
from vlbert_core.models.registry import from_pretrained  # noqa: E402
from vlbert_core.pretrain.settings import get_setting  # noqa: E402
from vlbert_core.stats import format_p_value, mcnemar_exact  # noqa: E402
from vlbert_core.tasks.finetune import read_task_rois  # noqa: E402
from vlbert_core.tasks.registry import get_task  # noqa: E402
from vlbert_core.tasks.samples import ImageLoader, Tokens  # noqa: E402
from vlbert_core.tasks.vqa import normalize_answer  # noqa: E402
from vlbert_core.world.vocabulary import CATEGORIES, COLOUR_NAMES  # noqa: E402

HEADING = "## What pre-training teaches about VQA's objects (zero-shot)"
BATCH = 32
# the world's question templates (vlbert_core/world/language.py) and the caption phrase that says the same
CAPTION_FORMS = (
    ("colour", re.compile(r"what color is the (?P<kind>\w+)\?"), "a {mask} {kind}"),
    ("colour", re.compile(r"what color is the (?P<size>\w+) (?P<kind>\w+)\?"), "a {size} {mask} {kind}"),
    ("kind", re.compile(r"what is the (?P<colour>\w+) object\?"), "a {colour} {mask}"),
    ("kind", re.compile(r"what kind of object is the (?P<size>\w+) (?P<colour>\w+) one\?"), "a {size} {colour} {mask}"),
)
CANDIDATES = {"colour": tuple(COLOUR_NAMES), "kind": tuple(c.name for c in CATEGORIES)}


@dataclass
class Probe:
    index: int      # position in the split's VqaData
    kind: str       # colour | kind
    caption: str    # the question in caption form, with the tokenizer's mask token
    answer: str     # the consensus answer, normalised


def caption_form(question: str, mask: str) -> tuple[str, str] | None:
    """(question kind, caption with `mask`) of a colour or kind question; None for the other questions."""
    for kind, pattern, form in CAPTION_FORMS:
        match = pattern.fullmatch(question.strip())
        if match:
            return kind, form.format(mask=mask, **match.groupdict())
    return None


def probes_of(data, mask: str) -> tuple[list[Probe], int]:
    """The questions of `data` with a caption form, and how many had none."""
    probes, left_out = [], 0
    for index, (question, _) in enumerate(data.questions):
        form = caption_form(question.question, mask)
        if form is None:
            left_out += 1
            continue
        probes.append(Probe(index, form[0], form[1], normalize_answer(question.multiple_choice_answer)))
    return probes, left_out


def load_pretrained_dir(setting: str, directory: Path) -> VLBertForPretraining:
    """A pre-trained model with its MLM head, from the directory `pretrain` writes (any setting, `none` included),
    built from that directory's own config (so a model of another size loads too)."""
    from safetensors.torch import load_file

    module = VLBertForPretraining(from_pretrained(directory), get_setting(setting))
    module.heads.load_state_dict(load_file(str(directory / "heads.safetensors")))
    return module.eval()


@torch.no_grad()
def zero_shot(run: Run, module: VLBertForPretraining, data, probes: list[Probe]) -> dict[str, list[list[bool]]]:
    """{question kind: [right with the image, right blanked]} per probe, in order."""
    tok = run.tokenizer
    tokens = Tokens(tok)
    candidate_ids = {kind: [tok.convert_tokens_to_ids(word) for word in words] for kind, words in CANDIDATES.items()}
    right: dict[str, list[list[bool]]] = collections.defaultdict(lambda: [[], []])
    for start in range(0, len(probes), BATCH):
        chunk = probes[start:start + BATCH]
        samples = []
        for probe in chunk:
            sample = data.sample(probe.index)
            ids = tok(probe.caption, add_special_tokens=False)["input_ids"]
            samples.append({**sample, "sequence": tokens.sequence(ids, None, len(sample["boxes"]))})
        for column, blank in enumerate((False, True)):
            batch = collate_samples([{**s, "image": torch.zeros_like(s["image"])} if blank else s for s in samples])
            hidden = module.model(batch).sequence_output
            logits = module.heads.mlm(hidden[batch.input_ids == tok.mask_token_id])
            for row, probe in enumerate(chunk):
                words = CANDIDATES[probe.kind]
                predicted = words[int(logits[row, candidate_ids[probe.kind]].argmax())]
                right[probe.kind][column].append(predicted == probe.answer)
    return dict(right)


def table(results: dict[str, dict[str, list[list[bool]]]]) -> str:
    lines = ["| model | colour: with image / blanked | p | kind: with image / blanked | p |", "|---|---|---|---|---|"]
    for label, right in results.items():
        cells = []
        for kind in ("colour", "kind"):
            with_image, blanked = right.get(kind, [[], []])
            n = len(with_image)
            if n == 0:
                cells += ["no questions", "–"]
                continue
            cells.append(f"{100 * sum(with_image) / n:.1f} / {100 * sum(blanked) / n:.1f} (of {n})")
            cells.append(format_p_value(mcnemar_exact(with_image, blanked)))
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def parse_models(run: Run, settings: list[str], extra: list[str]) -> list[tuple[str, str, Path]]:
    """[(label, setting, directory)]: the run's own settings, then each LABEL=DIR (its setting is LABEL up to '@')."""
    models = [(s, s, run.root / "results" / "pretrain" / s) for s in settings]
    for item in extra:
        label, sep, directory = item.partition("=")
        if not sep:
            raise SystemExit(f"--model {item!r}: expected LABEL=PRETRAIN_DIR")
        models.append((label, label.split("@")[0], Path(directory)))
    for label, _, directory in models:
        for name in ("model.safetensors", "heads.safetensors"):
            if not (directory / name).is_file():
                raise SystemExit(f"{label}: {directory / name} is missing; run its pretrain job first")
    return models


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--run", type=Path, default=Path("."))
    parser.add_argument("--settings", nargs="*", default=["none", "a", "b", "c", "d", "full"])
    parser.add_argument("--model", action="append", default=[], metavar="LABEL=PRETRAIN_DIR")
    parser.add_argument("--split", default="val")
    parser.add_argument("--max-rois", type=int, help="boxes per image incl. box 0 (default: the run's model.max_rois)")
    parser.add_argument("--write-docs", action="store_true")
    args = parser.parse_args(argv)
    began = time.time()
    run = Run(args.run.resolve())
    models = parse_models(run, args.settings, args.model)
    sources = {key: str(run.root / path) for key, path in run.config["sources"]["vqa"].items()}
    task = get_task("vqa")
    rois, rois_source = read_task_rois([run.root / "results" / "rois" / "vqa" / f"{args.split}.parquet"])
    max_rois = args.max_rois or int(run.config["model"]["max_rois"])
    splits = {}  # pixel format -> (data, probes): the split is read once for all models that see images alike
    results = {}
    for label, setting, directory in models:
        module = load_pretrained_dir(setting, directory)
        pixel_format = visual_pixel_format(module.model.config)
        if pixel_format not in splits:
            images = ImageLoader(int(run.config["model"]["image_max_side"]), pixel_format=pixel_format)
            data = task.build_data(args.split, {}, sources=sources, tokens=Tokens(run.tokenizer), images=images,
                                   max_rois=max_rois, max_text_len=run.stream_cfg.max_text_len, rois=rois,
                                   rois_source=rois_source)
            splits[pixel_format] = (data, *probes_of(data, run.tokenizer.mask_token))
        data, probes, left_out = splits[pixel_format]
        results[label] = zero_shot(run, module, data, probes)
        print(f"{label}: {len(probes)} questions in caption form, {left_out} left out (counting, yes/no)", flush=True)
    result = table(results)
    print(result)
    if args.write_docs:
        models_note = "; ".join(f"`{label}`: {directory}" for label, _, directory in models[len(args.settings):])
        body = (f"Measured {date.today().isoformat()} with `uv run python benchmarks/diagnostics/vqa_grounding.py "
                f"--run RUN --split {args.split}" + (f" --max-rois {args.max_rois}" if args.max_rois else "")
                + "".join(f" --model {m}" for m in args.model)
                + f"` ({time.time() - began:.0f} s), RUN a finished default run"
                + (f"; {models_note}" if models_note else "")
                + ". Each colour or kind question of VQA's held-out split, rewritten as the captions say it "
                "(`what color is the star?` -> `a [MASK] star`), answered by the pre-trained MLM head among the "
                "7 colours or 8 kinds (chance 14 % / 12.5 %), with the image and blanked; p: exact McNemar, "
                "with image against blanked, over the same questions.\n\n" + result)
        replace_section(HEADING, body)


if __name__ == "__main__":
    main()
