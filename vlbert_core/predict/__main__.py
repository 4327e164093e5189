"""Ask a fine-tuned model about images: prints (and with --out writes) the answers as JSON.

  VQA:      --model results/finetune/vqa/full/full --detector results/detector/model.pt
            --image photo.jpg --text "what colour is the ball?" [--top-k 5]
  RefCOCO+: --model results/finetune/refcoco/full/full --detector results/detector/model.pt
            --image photo.jpg --text "the red ball on the left" [--draw chosen.png]
            [--boxes X1,Y1,X2,Y2 ...: your own candidate boxes instead of the detector's RoIs]
  Your own task (tasks.custom.<name> of the config, docs/own-data.md):
            --model results/finetune/custom_<name>/full/full --detector results/detector/model.pt
            --config config/config.yaml --config my_task.yaml --image photo.jpg --text "a sentence"
            [--top-k 3]: the labels ranked with their probabilities
  VCR:      --model results/finetune/vcr_q2a/full/full --image photo.jpg
            --objects person:10,20,60,90 dog:70,40,120,95 --text "why is [0] next to [1] ?"
            --choices "[0] owns [1] ." "it is raining ." "[1] is lost ." "[0] is cooking ."
            (QA->R model: --answer "[0] owns [1] ." and --choices are the four rationales),
            or --annotations val.jsonl --id val-0 --images-dir .../vcr1images (VCR's own format).
  Retrieval: --model results/finetune/retrieval/vilbert/half --detector results/detector/model.pt
            --rank-images FOLDER --text "a caption" [--top-k 5]: the folder's images that best match each
            caption, best first

--image and --text repeat (pairs in order; one of them given once goes with every other);
--queries FILE takes one JSON query per line ({"image", "text", ...}, docs/predict.md).
Images are paths or http(s) URLs (fetched with the config's cc.download settings, or a custom
task's tasks.custom.<name>.download). An image over the config's max_image_pixels (width x height;
default 89,478,485) is refused from its header, before it is decoded.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from vlbert_core.utils import atomic_path

from .api import (PredictError, Predictor, check_image_sizes, check_query_images, draw_format, image_cap,
                  read_model_task, url_scheme)

DEFAULT_CONFIG = Path("config/config.yaml")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m vlbert_core.predict", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, type=Path,
                        help="fine-tuned model directory, results/finetune/<task>/<setting>/<schedule>")
    parser.add_argument("--task", help="fail unless the model was fine-tuned on this task or dataset "
                                       "(vqa, refcoco, vcr, vcr_q2a, vcr_qa2r, custom_<name>)")
    parser.add_argument("--detector", type=Path,
                        help="detector checkpoint (results/detector/model.pt) for tasks that read detected RoIs")
    parser.add_argument("--config", action="append", type=Path,
                        help=f"the run's config (rois: selection, download settings for URLs, your own tasks' "
                             f"tasks.custom entries); repeat to merge, "
                             f"later ones win (default: {DEFAULT_CONFIG} when it exists)")
    parser.add_argument("--image", action="append", default=[], help="image path or http(s) URL; repeat")
    parser.add_argument("--text", action="append", default=[],
                        help="question (VQA, VCR) or referring expression (RefCOCO+); repeat")
    parser.add_argument("--boxes", nargs="+", metavar="X1,Y1,X2,Y2",
                        help="RefCOCO+: candidate boxes in image pixels (default: the detector's RoIs)")
    parser.add_argument("--objects", nargs="+", metavar="NAME:X1,Y1,X2,Y2",
                        help="VCR: the image's objects; [i] in the texts refers to object i (from 0)")
    parser.add_argument("--choices", nargs="+", help="VCR: the four candidate answers (Q->A) or rationales (QA->R)")
    parser.add_argument("--answer", help="VCR QA->R: the answer whose rationales are ranked")
    parser.add_argument("--annotations", type=Path, help="queries from a file in the dataset's own format (VCR jsonl)")
    parser.add_argument("--id", help="with --annotations: the one question to ask (VCR annot_id)")
    parser.add_argument("--images-dir", type=Path,
                        help="with --annotations: the folder its image paths are relative to (default: the file's)")
    parser.add_argument("--queries", type=Path, help="JSON lines, one query object per line")
    parser.add_argument("--rank-images", type=Path, metavar="FOLDER",
                        help="retrieval: rank the folder's .jpg/.jpeg/.png images for each --text caption")
    parser.add_argument("--top-k", type=int, default=5, help="answers / boxes listed per query (default 5)")
    parser.add_argument("--draw", type=Path, help="RefCOCO+: the image with the chosen box, as PNG (PATH.png) or JPEG "
                                                  "(PATH.jpg); several queries: PATH_<n>.png")
    parser.add_argument("--out", type=Path, help="also write the JSON here")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default cpu)")
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


DEVICE_PATTERN = r"cpu|cuda(:\d+)?"


def check_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The flags' values, before any file is read (issue #56): a bad one is argparse's error, exit 2."""
    import re

    if args.top_k < 1:
        parser.error(f"--top-k {args.top_k}: must be at least 1")
    if not re.fullmatch(DEVICE_PATTERN, args.device):
        parser.error(f"--device {args.device!r}: expected cpu, cuda or cuda:N")
    for value in args.image:
        try:
            url_scheme(value)
        except PredictError as err:
            parser.error(f"--{err}")   # "--image ftp://...: unsupported URL scheme 'ftp'; ..."
    if args.draw is not None:
        try:
            draw_format(args.draw)
        except PredictError as err:
            parser.error(f"--draw {args.draw}: {str(err).split(': ', 1)[1]}")
    for value in args.boxes or ():
        try:
            _numbers(value, "--boxes")
        except PredictError as err:
            parser.error(str(err))


def check_inputs(args: argparse.Namespace) -> None:
    """The input and output paths other than the images (`check_query_images`), before the model loads: what must
    be a file is one, what must be a folder is one, and where the outputs go exists."""
    from vlbert_core.config_schema import check_input_dir, check_input_file

    if args.detector is not None:
        check_input_file(args.detector, "--detector")
    if args.annotations is not None:
        check_input_file(args.annotations, "--annotations")
    if args.images_dir is not None:
        check_input_dir(args.images_dir, "--images-dir")
    for flag, out in (("--out", args.out), ("--draw", args.draw)):
        if out is None:
            continue
        if out.is_dir():
            raise IsADirectoryError(f"{flag} {out} is a directory, not a file name")
        if not out.parent.is_dir():
            raise FileNotFoundError(f"{flag} {out}: its folder {out.parent} does not exist")


def check_device(device: str) -> None:
    """--device cuda on a machine without CUDA: an error saying how to run on the CPU, before the model loads."""
    if device.startswith("cuda"):
        if not any(Path("/dev").glob("nvidia[0-9]*")) and not Path("/proc/driver/nvidia").exists():
            available = False   # no NVIDIA device node: no CUDA, said without importing torch (seconds, 0.5 GB)
        else:
            import torch

            available = torch.cuda.is_available()
        if not available:
            raise RuntimeError(f"--device {device}: torch sees no CUDA device on this machine; run on the CPU with "
                               f"--device cpu (the default)")


def read_config(paths: list[Path] | None) -> dict:
    """The --config files merged (config/config.yaml when none is given and it exists), each read with the one
    reader (a key given twice is an error) and validated against config/schema.yaml (vlbert_core/config_schema.py)."""
    from vlbert_core.config_schema import read_configs

    if paths is None:
        paths = [DEFAULT_CONFIG] if DEFAULT_CONFIG.is_file() else []
    try:
        return read_configs(paths, "--config")
    except FileNotFoundError as err:
        raise PredictError(str(err)) from None


def _numbers(text: str, what: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",")]
    except ValueError:
        values = []
    if len(values) != 4:
        raise PredictError(f"{what} {text!r}: expected four numbers X1,Y1,X2,Y2")
    return values


def checked_text(value: str, what: str) -> str:
    """A text given on the command line, which must be UTF-8: the shell hands other bytes through as
    undecodable characters, which no tokenizer takes."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as err:
        raise PredictError(f"{what}: not UTF-8 text (a byte the terminal did not send as UTF-8 at character "
                           f"{err.start + 1}: {value[:err.start]!r}...); give the text in UTF-8") from None
    return value


def flag_queries(args: argparse.Namespace) -> list[dict]:
    """The queries of --image / --text and the flags that go with every one of them."""
    texts = [checked_text(t, f"--text #{i + 1}") for i, t in enumerate(args.text)]
    choices = [checked_text(c, f"--choices #{i + 1}") for i, c in enumerate(args.choices or [])]
    answer = None if args.answer is None else checked_text(args.answer, "--answer")
    images = args.image
    if not images and not texts:
        return []
    if not images or not texts:
        raise PredictError("give both --image and --text")
    if len(images) != len(texts) and 1 not in (len(images), len(texts)):
        raise PredictError(f"{len(images)} --image and {len(texts)} --text: give as many of each, or one of them once")
    count = max(len(images), len(texts))
    extra: dict = {}
    if args.boxes:
        extra["boxes"] = [_numbers(b, "--boxes") for b in args.boxes]
    if args.objects:
        objects = []
        for spec in args.objects:
            name, sep, box = spec.rpartition(":")
            if not sep or not name:
                raise PredictError(f"--objects {spec!r}: expected NAME:X1,Y1,X2,Y2")
            objects.append({"name": name, "box": _numbers(box, f"--objects {name}")})
        extra["objects"] = objects
    if choices:
        extra["choices"] = choices
    if answer:
        extra["answer"] = answer
    return [{"image": images[i if len(images) > 1 else 0], "text": texts[i if len(texts) > 1 else 0], **extra}
            for i in range(count)]


def file_queries(path: Path) -> list[dict]:
    from vlbert_core.utils import read_jsonl

    if path.is_dir():
        raise PredictError(f"--queries {path} is a directory, not a file")
    if not path.is_file():
        raise PredictError(f"--queries {path} does not exist")
    return read_jsonl(path)


def draw_paths(path: Path | None, count: int) -> list[Path] | None:
    if path is None:
        return None
    if count == 1:
        return [path]
    return [path.with_name(f"{path.stem}_{i}{path.suffix or '.png'}") for i in range(count)]


def folder_images(folder: Path) -> list[str]:
    """The images of a folder to rank, sorted by name."""
    from vlbert_core.tasks.retrieval import IMAGE_SUFFIXES

    if not folder.exists():
        raise PredictError(f"--rank-images {folder} does not exist")
    if not folder.is_dir():
        raise PredictError(f"--rank-images {folder} is a file, not a folder")
    images = [str(p) for p in sorted(folder.iterdir()) if p.suffix.lower() in IMAGE_SUFFIXES]
    if not images:
        raise PredictError(f"--rank-images {folder} has no {'/'.join(IMAGE_SUFFIXES)} image")
    return images


def rank_folder(args: argparse.Namespace, config: dict) -> dict:
    """--rank-images: each --text caption with the folder's images, best first."""
    from vlbert_core.tasks.retrieval import rank_images

    if args.image or args.queries or args.annotations or not args.text:
        raise PredictError("--rank-images takes --text captions only (no --image, --queries or --annotations)")
    captions = [checked_text(t, f"--text #{i + 1}") for i, t in enumerate(args.text)]
    images = folder_images(args.rank_images)
    max_image_pixels = image_cap(config)
    check_image_sizes(images, max_image_pixels)
    check_device(args.device)
    predictor = Predictor(args.model, task=args.task, detector=args.detector, config=config, device=args.device,
                          max_image_pixels=max_image_pixels)
    if predictor.task.name != "retrieval":
        raise PredictError(f"--rank-images needs a retrieval model; {args.model} holds a {predictor.task.name} one")
    results = [{"text": caption, "images": rank_images(predictor, caption, images, top_k=args.top_k)}
               for caption in captions]
    return {"model": str(args.model), "task": predictor.task.name, "results": results}


def main(argv: list[str] | None = None) -> dict:
    parser = build_parser()
    args = parser.parse_args(argv)
    check_arguments(parser, args)   # the flags' values (exit 2); then every input, before the model loads (exit 1)
    config = read_config(args.config)
    check_inputs(args)
    if args.rank_images is not None:
        return emit(rank_folder(args, config), args.out)
    queries = flag_queries(args)
    if args.queries:
        queries += file_queries(args.queries)
    max_image_pixels = image_cap(config)   # the config's max_image_pixels
    check_query_images(queries, max_image_pixels)   # local files: kind, header, the boxes they are given
    read_model_task(args.model)   # the model directory and its config.json, before torch is imported
    check_device(args.device)
    predictor = Predictor(args.model, task=args.task, detector=args.detector, config=config, device=args.device,
                          max_image_pixels=max_image_pixels)
    if args.annotations:
        queries += predictor.queries_from_file(args.annotations, key=args.id, images_dir=args.images_dir)
    if not queries:
        raise PredictError("nothing to ask: give --image and --text, --queries or --annotations")
    results = predictor.predict(queries, top_k=args.top_k, draw=draw_paths(args.draw, len(queries)))
    return emit({"model": str(args.model), "task": predictor.task.name, "results": results}, args.out)


def emit(payload: dict, out: Path | None) -> dict:
    """Print the answers as strict JSON (and write them to `out`): a NaN or infinity is an error naming the model
    (`check_finite`), never the `NaN` that strict JSON parsers reject."""
    from .api import check_finite

    check_finite(payload.get("results"), f"model {payload.get('model')}")
    text = json.dumps(payload, indent=1, allow_nan=False)
    if out:
        with atomic_path(out) as tmp:
            tmp.write_text(text + "\n")
    print(text)
    return payload


if __name__ == "__main__":
    from vlbert_core.cli import run_command

    sys.exit(run_command(main, "python -m vlbert_core.predict"))
