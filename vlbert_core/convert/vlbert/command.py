"""`python -m vlbert_core.convert vl-bert`: VL-BERT's converter subcommand (its registry record's `converter`).
Builds its parser without torch; the conversion (checkpoint.py) is imported when it runs."""

from __future__ import annotations

import argparse

from ..released_heads import (PUBLISHED_PRETRAINED, RELEASED_HEADS, released_task_names, released_vocabularies,
                              vocabulary_option)

COMMAND = "vl-bert"


def add_parser(sub) -> None:
    # the tasks whose released fine-tuned checkpoints convert, and the lists their heads need (task registry)
    tasks = released_task_names()
    vl = sub.add_parser(
        COMMAND, formatter_class=argparse.RawDescriptionHelpFormatter,
        help=f"pre-trained {', '.join(PUBLISHED_PRETRAINED)}, or the authors' fine-tuned checkpoints of "
             f"{' / '.join(tasks)} -> a model directory",
        description="IN: " + ", ".join(PUBLISHED_PRETRAINED) + ", or a fine-tuned checkpoint of "
                    f"{' / '.join(tasks)} of the authors' code (<prefix>-<epoch>.model).\nOUT_DIR: a VL-BERT model "
                    "directory (model.safetensors + config.json) for pretrain.init_from, or for a fine-tuned "
                    "checkpoint a fine-tuned model directory with its task head; conversion_report.json beside.")
    vl.add_argument("in_path", metavar="IN")
    vl.add_argument("out_dir", metavar="OUT_DIR")
    vl.add_argument("--bert-path", required=True,
                    help="the BERT directory whose vocab.txt tokenises for this model (bert-base-uncased or "
                         "bert-large-uncased, as model.bert_path); recorded in the model's config.json")
    vl.add_argument("--visual-weights", default=None,
                    help="resnet101-pt-vgbua-0000.model: the visual network of the '-prec' checkpoints and the "
                         "fine-tuned ones that hold none (their RoI features were precomputed)")
    vl.add_argument("--task", default=None, choices=tasks,
                    help="the task of a fine-tuned checkpoint, read off its head; needed only to pick another "
                         "of the tasks that share one released head (the first of them by default)")
    for key, what in released_vocabularies().items():
        users = [name for name in tasks if key in dict(RELEASED_HEADS[name].vocabularies)]
        vl.add_argument(vocabulary_option(key), dest=key, default=None,
                        help=f"{' / '.join(users)}: {what}, one a line")


def run(args: argparse.Namespace) -> None:
    from ..accounting import REPORT_FILE
    from .checkpoint import convert_vlbert

    converted = convert_vlbert(args.in_path, args.out_dir, bert_path=args.bert_path,
                               visual_weights=args.visual_weights, task=args.task,
                               vocabulary_files={key: getattr(args, key) for key in released_vocabularies()})
    report = converted.report
    print(f"{args.in_path} ({converted.layout.kind}) -> {args.out_dir}: {len(report.mapped)} tensors mapped, "
          f"{len(report.dropped)} dropped, {len(report.filled)} filled ({args.out_dir}/{REPORT_FILE})")
