"""`python -m vlbert_core.convert vilbert`: ViLBERT's converter subcommand (its registry record's `converter`).
Builds its parser without torch; the conversion (checkpoint.py) is imported when it runs."""

from __future__ import annotations

import argparse

from ..released_heads import VILBERT_TASK_HEADS

COMMAND = "vilbert"


def add_parser(sub) -> None:
    vil = sub.add_parser(
        COMMAND, help="ViLBERT's released checkpoints (facebookresearch/vilbert-multi-task) -> a model directory",
        description="IN: a state dict of facebookresearch/vilbert-multi-task: pretrained_model.bin (their "
                    "BertForMultiModalPreTraining), or a fine-tuned VILBertForVLTasks checkpoint "
                    "(multi_task_model.bin with its task tokens, or a per-task fine-tuned file). OUT_DIR: a ViLBERT "
                    "model directory (model.safetensors + config.json, heads.safetensors with the MLM, region and "
                    "alignment heads; for a fine-tuned checkpoint also task_heads.safetensors with every task head: "
                    "VQA, GQA, VCR / retrieval score, NLVR2, SNLI-VE, RefCOCO+ region score, word score) for "
                    "pretrain.init_from or fine-tuning; conversion_report.json beside.")
    vil.add_argument("in_path", metavar="IN")
    vil.add_argument("out_dir", metavar="OUT_DIR")
    vil.add_argument("--bert-path", required=True,
                     help="the BERT directory whose vocab.txt tokenises for this model (bert-base-uncased); recorded "
                          "in the model's config.json")
    vil.add_argument("--detector", required=True,
                     help="a detector checkpoint of this project (e.g. bottom-up attention's, from `bottom-up`): the "
                          "visual network, which the released file lacks (its region features were precomputed); "
                          "its RoI features must be v_feature_size wide and its classes + background v_target_size")
    vil.add_argument("--task", default=None, choices=list(VILBERT_TASK_HEADS),
                     help="a fine-tuned checkpoint only: write a fine-tuned model directory of this task instead (what "
                          "vlbert_core.predict answers with), its head the released one the task reads (vqa: "
                          "vil_prediction, refcoco: vision_logit, retrieval: vil_logit) and, with task tokens, the "
                          "task's token")
    vil.add_argument("--answers", default=None,
                     help=f"--task vqa: {dict(VILBERT_TASK_HEADS['vqa'].vocabularies)['answers']}, one a line")
    vil.add_argument("--config", default=None,
                     help="the authors' config of the checkpoint (default: config/bert_base_6layer_6conect.json's "
                          "values; sizes are read off the tensors, heads and co-attention placement from here)")


def run(args: argparse.Namespace) -> None:
    from ..accounting import REPORT_FILE
    from .checkpoint import convert_vilbert

    converted = convert_vilbert(args.in_path, args.out_dir, detector=args.detector, bert_path=args.bert_path,
                                config_path=args.config, task=args.task, answers_path=args.answers)
    report = converted.report
    print(f"{args.in_path} -> {args.out_dir}: {len(report.mapped)} tensors mapped, {len(report.dropped)} dropped, "
          f"{len(report.filled)} filled ({args.out_dir}/{REPORT_FILE})")
