"""python -m vlbert_core.convert {vl-bert,vilbert,resnet101-pt-vgbua,bottom-up} IN OUT

Converts the authors' published files into this project's formats; each run writes a
conversion_report.json saying what happened to every tensor of IN.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from vlbert_core.cli import run_command

from .released_heads import (PUBLISHED_PRETRAINED, RELEASED_HEADS, released_task_names, released_vocabularies,
                             vocabulary_option)

BOTTOM_UP_MODULE = "vlbert_core.convert.bottom_up"
BOTTOM_UP_FILES = ("faster_rcnn_from_caffe_attr.pkl (py-bottom-up-attention, detectron2 layout)",
                   "bua-caffe-frcn-r101_with_attributes.pth (MILVLG/bottom-up-attention.pytorch)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m vlbert_core.convert",
        description="Convert the authors' published checkpoints (github.com/jackroos/VL-BERT, "
                    "model/pretrained_model/PREPARE_PRETRAINED_MODELS.md) into this project's formats.",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, metavar="{vl-bert,vilbert,resnet101-pt-vgbua,bottom-up}")

    # the tasks whose released fine-tuned checkpoints convert, and the lists their heads need (task registry)
    tasks = released_task_names()
    vl = sub.add_parser(
        "vl-bert", formatter_class=argparse.RawDescriptionHelpFormatter,
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

    vil = sub.add_parser(
        "vilbert", help="ViLBERT's pretrained_model.bin (facebookresearch/vilbert-multi-task) -> a model directory",
        description="IN: pretrained_model.bin of facebookresearch/vilbert-multi-task (a state dict of their "
                    "BertForMultiModalPreTraining). OUT_DIR: a ViLBERT model directory (model.safetensors + "
                    "config.json, heads.safetensors with the MLM, region and alignment heads) for pretrain.init_from "
                    "or fine-tuning; conversion_report.json beside.")
    vil.add_argument("in_path", metavar="IN")
    vil.add_argument("out_dir", metavar="OUT_DIR")
    vil.add_argument("--bert-path", required=True,
                     help="the BERT directory whose vocab.txt tokenises for this model (bert-base-uncased); recorded "
                          "in the model's config.json")
    vil.add_argument("--detector", required=True,
                     help="a detector checkpoint of this project (e.g. bottom-up attention's, from `bottom-up`): the "
                          "visual network, which the released file lacks (its region features were precomputed); "
                          "its RoI features must be v_feature_size wide and its classes + background v_target_size")
    vil.add_argument("--config", default=None,
                     help="the authors' config of the checkpoint (default: config/bert_base_6layer_6conect.json's "
                          "values; sizes are read off the tensors, heads and co-attention placement from here)")

    rn = sub.add_parser("resnet101-pt-vgbua", help="resnet101-pt-vgbua-0000.model -> initial weights of the "
                                                   "ResNet-101 C4 network (detector.backbone.init_weights)",
                        description="IN: resnet101-pt-vgbua-0000.model (ResNet-101 of bottom-up attention, "
                                    "converted from Caffe by the VL-BERT authors; holds layer4.* too). OUT: a "
                                    "torchvision-layout state dict (torch.save) for a backbone with depth 101, "
                                    "stride_in_1x1 true, pixel_format bgr255_caffe.")
    rn.add_argument("in_path", metavar="IN")
    rn.add_argument("out_path", metavar="OUT")

    bu = sub.add_parser("bottom-up", help="the bottom-up-attention detector: " + "; ".join(BOTTOM_UP_FILES)
                                          + " -> our detector checkpoint (detector.weights)",
                        description="IN: " + "; ".join(BOTTOM_UP_FILES) + ". OUT: our detector checkpoint.")
    bu.add_argument("in_path", metavar="IN")
    bu.add_argument("out_path", metavar="OUT")
    bu.add_argument("--source", default=None, choices=["bua-caffe", "detectron2-attr"],
                    help="the file's layout (default: .pkl files detectron2-attr, others bua-caffe)")
    bu.add_argument("--objects-vocab", default=None, help="objects_vocab.txt: the 1,600 class names, in label order")
    bu.add_argument("--attributes-vocab", default=None, help="attributes_vocab.txt: the 400 attribute names")
    return parser


def _load_bottom_up():
    try:
        module = importlib.import_module(BOTTOM_UP_MODULE)
    except ModuleNotFoundError as exc:
        if exc.name != BOTTOM_UP_MODULE:
            raise
        raise SystemExit(f"bottom-up: the bottom-up-attention detector converter ({BOTTOM_UP_MODULE}) is not "
                         "installed in this checkout; nothing was written") from None
    return module.convert_bottom_up


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "vl-bert":
        from .vlbert import REPORT_FILE, convert_vlbert

        converted = convert_vlbert(args.in_path, args.out_dir, bert_path=args.bert_path,
                                   visual_weights=args.visual_weights, task=args.task,
                                   vocabulary_files={key: getattr(args, key) for key in released_vocabularies()})
        report = converted.report
        print(f"{args.in_path} ({converted.layout.kind}) -> {args.out_dir}: {len(report.mapped)} tensors mapped, "
              f"{len(report.dropped)} dropped, {len(report.filled)} filled ({args.out_dir}/{REPORT_FILE})")
    elif args.command == "vilbert":
        from .vilbert import REPORT_FILE, convert_vilbert

        converted = convert_vilbert(args.in_path, args.out_dir, detector=args.detector, bert_path=args.bert_path,
                                    config_path=args.config)
        report = converted.report
        print(f"{args.in_path} -> {args.out_dir}: {len(report.mapped)} tensors mapped, {len(report.dropped)} dropped, "
              f"{len(report.filled)} filled ({args.out_dir}/{REPORT_FILE})")
    elif args.command == "resnet101-pt-vgbua":
        from .resnet import convert_resnet101, report_path

        report, backbone = convert_resnet101(args.in_path, args.out_path)
        print(f"{args.in_path} -> {args.out_path}: {len(report.mapped)} tensors mapped, {len(report.dropped)} "
              f"dropped, {len(report.filled)} filled ({report_path(args.out_path)}). Use it as "
              f"backbone init_weights with {backbone}")
    else:
        from .resnet import report_path

        convert_bottom_up = _load_bottom_up()
        report = convert_bottom_up(args.in_path, args.out_path, source=args.source, objects_vocab=args.objects_vocab,
                                   attributes_vocab=args.attributes_vocab, report_path=report_path(args.out_path))
        print(f"{args.in_path} -> {args.out_path}: {len(report.mapped)} tensors mapped, {len(report.dropped)} "
              f"dropped, {len(report.filled)} filled ({report_path(args.out_path)})")
    return 0


if __name__ == "__main__":
    sys.exit(run_command(main, "python -m vlbert_core.convert"))
