"""python -m vlbert_core.convert {vl-bert,vilbert,resnet101-pt-vgbua,bottom-up} IN OUT

Converts the authors' published files into this project's formats; each run writes a
conversion_report.json saying what happened to every tensor of IN.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from vlbert_core.cli import run_command
from vlbert_core.models.registry import families, resolve

BOTTOM_UP_MODULE = "vlbert_core.convert.bottom_up"
BOTTOM_UP_FILES = ("faster_rcnn_from_caffe_attr.pkl (py-bottom-up-attention, detectron2 layout)",
                   "bua-caffe-frcn-r101_with_attributes.pth (MILVLG/bottom-up-attention.pytorch)")


def family_converters() -> dict:
    """{subcommand: its module (COMMAND, add_parser, run)}: the converters of the registered model families (their
    registry record's `converter`), in the registry's order."""
    converters = (resolve(record.converter) for record in families() if record.converter is not None)
    return {converter.COMMAND: converter for converter in converters}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m vlbert_core.convert",
        description="Convert the authors' published checkpoints (github.com/jackroos/VL-BERT, "
                    "model/pretrained_model/PREPARE_PRETRAINED_MODELS.md) into this project's formats.",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    converters = family_converters()
    sub = parser.add_subparsers(dest="command", required=True,
                                metavar="{" + ",".join([*converters, "resnet101-pt-vgbua", "bottom-up"]) + "}")
    for converter in converters.values():
        converter.add_parser(sub)

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


def check_output(args: argparse.Namespace) -> None:
    """OUT_DIR (the model families' converters) must not be an existing file, nor OUT (a checkpoint file) an
    existing directory: one line saying so, before IN is read."""
    from pathlib import Path

    out_dir = getattr(args, "out_dir", None)
    if out_dir is not None and Path(out_dir).exists() and not Path(out_dir).is_dir():
        raise NotADirectoryError(f"OUT_DIR {out_dir} is an existing file, not a directory: the converter writes a "
                                 f"model directory (model.safetensors, config.json) there; give a new or existing "
                                 f"folder")
    out_path = getattr(args, "out_path", None)
    if out_path is not None and Path(out_path).is_dir():
        raise IsADirectoryError(f"OUT {out_path} is a directory: the converter writes one checkpoint file; give its "
                                f"file name")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    check_output(args)
    converters = family_converters()
    if args.command in converters:
        converters[args.command].run(args)
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
