"""python -m vlbert_core.convert.verify LAYOUT --authors-repo DIR [--authors-python PY] (--checkpoint F | --stand-in M)

Does a converted checkpoint compute what the authors' code computes? Runs the authors' model (jackroos/VL-BERT,
a checkout you downloaded, in its own Python environment) and the converted one on the same small batch
(vlbert/reference.py), and prints the largest difference at every stage: RoI features, their visual embedding, the
input embeddings, each encoder layer at the real elements, and the heads' logits (pre-training: MLM at masked
words of captions and of text-only rows, masked-RoI classification at the chosen boxes, and the three losses).

LAYOUT is one of reference.LAYOUTS: pretrain-e2e, pretrain-prec, vqa, refcoco, vcr. ViLBERT's layouts
(facebookresearch/vilbert-multi-task) are checked the same way: `vilbert` (pretrained_model.bin) and
`vilbert-tasks` (a VILBertForVLTasks checkpoint: multi_task_model.bin with --task-tokens, a per-task fine-tuned
file without; every task head is compared too) and `vilbert-beta-tasks` (the ViLBERT paper's single-task files,
--authors-repo a checkout of jiasenlu/vilbert_beta); their options are those of python -m
vlbert_core.convert.vilbert.reference (VILBERT_LAYOUTS). The checkpoint is either
the authors' file (--checkpoint, with what its conversion needs: --bert-path, and --visual-weights for the prec
and VQA ones, --answers / --object-names for VQA / VCR) or a stand-in written from a manifest of
vlbert_core/convert/manifests with trained-like random values (--stand-in, --seed). --golden-out writes the batch and a
few of the authors' numbers per stage (tests/data/golden/, compared by tests/convert/test_golden_released.py).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

# The model and the reference batch (torch) are imported where a check runs: --help answers without them.
from .released_heads import LAYOUTS, get_layout

RUNNER = Path(__file__).parent / "vlbert" / "authors_runner.py"
TOLERANCE = 1e-4        # the largest |difference| a stage may show (fp32, CPU)
STAND_IN_VOCABULARY_SIZES = {"answers": 3129, "object_names": 81}   # the released heads' sizes
INPUTS_FILE, NUMBERS_FILE = "{layout}.inputs.npz", "{layout}.json"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m vlbert_core.convert.verify", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("layout", choices=list(LAYOUTS))
    parser.add_argument("--authors-repo", required=True, type=Path, help="a checkout of jackroos/VL-BERT")
    parser.add_argument("--authors-config", default=None,
                        help="the authors' config of the checkpoint, relative to --authors-repo (default: the BASE one of "
                             "LAYOUT, reference.LAYOUTS; e.g. cfgs/pretrain/large_e2e_16x16G_fp16.yaml for LARGE)")
    parser.add_argument("--authors-python", default=sys.executable,
                        help="the Python of the authors' environment (torch, torchvision, easydict, pyyaml, ...); "
                             "default: this one")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--checkpoint", type=Path, help="the authors' checkpoint file")
    source.add_argument("--stand-in", type=Path, help="a manifest (vlbert_core/convert/manifests/*.json): write a stand-in")
    parser.add_argument("--seed", type=int, default=0, help="of the stand-in's values and of the batch")
    parser.add_argument("--bert-path", type=Path, default=None,
                        help="bert-base-uncased (vocab.txt, config.json); a stand-in's default: one written here")
    parser.add_argument("--visual-weights", type=Path, default=None, help="resnet101-pt-vgbua-0000.model (prec, VQA)")
    parser.add_argument("--answers", type=Path, default=None, help="VQA: the 3,129 answers, one a line")
    parser.add_argument("--object-names", type=Path, default=None, help="VCR: the 81 object classes, one a line")
    parser.add_argument("--workdir", type=Path, default=None, help="keep the intermediate files here")
    parser.add_argument("--golden-out", type=Path, default=None, help="write the golden files into this directory")
    parser.add_argument("--json", type=Path, default=None, help="write the comparison rows as JSON")
    return parser


def write_stand_in_files(manifest_path: Path, layout, workdir: Path, seed: int, bert_path: Path | None = None,
                         visual_weights: Path | None = None) -> dict:
    """A stand-in checkpoint of `manifest_path` (trained-like values of `seed`) and what its conversion needs,
    written into `workdir`: a BERT directory (unless `bert_path`), the ResNet-101 of the precomputed layouts
    (unless `visual_weights`) and placeholder answer / object-name lists of the released heads' sizes."""
    from .manifest import Manifest
    from .vlbert.reference import write_reference_checkpoint
    from .stand_in import write_bert_stand_in, write_manifest_stand_in

    manifest = Manifest.load(manifest_path)
    checkpoint = workdir / manifest.file
    write_reference_checkpoint(manifest, checkpoint, seed)
    files = {"checkpoint": checkpoint, "bert_path": bert_path, "visual_weights": visual_weights, "vocabularies": {}}
    if files["bert_path"] is None:
        files["bert_path"] = write_bert_stand_in(workdir / "bert-base-uncased", seed=seed, bert_layers=1)
    if layout.precomputed and files["visual_weights"] is None:
        files["visual_weights"] = workdir / "resnet101-pt-vgbua-0000.model"
        write_manifest_stand_in(Path(manifest_path).with_name("resnet101-pt-vgbua.json"), files["visual_weights"],
                                seed=seed)
    for key, size in STAND_IN_VOCABULARY_SIZES.items():
        path = workdir / f"{key}.txt"
        path.write_text("".join(f"{key}_{i}\n" for i in range(size)))
        files["vocabularies"][key] = path
    return files


def convert_files(files: dict, layout, out_dir: Path) -> Path:
    """Convert `files` (write_stand_in_files' or the user's) into `out_dir`, replacing what is there."""
    from .vlbert.checkpoint import convert_vlbert

    shutil.rmtree(out_dir, ignore_errors=True)
    convert_vlbert(files["checkpoint"], out_dir, bert_path=str(files["bert_path"]),
                   visual_weights=files["visual_weights"], task=layout.task, vocabulary_files=files["vocabularies"])
    return out_dir


def run_authors(args, layout, checkpoint: Path, vocab: Path, inputs_path: Path, out_path: Path) -> dict:
    from .stages import load_arrays

    command = [str(args.authors_python), str(RUNNER), "--repo", str(args.authors_repo), "--layout", layout.name,
               "--config", args.authors_config or layout.authors_config, "--checkpoint", str(checkpoint),
               "--vocab", str(vocab), "--inputs", str(inputs_path), "--out", str(out_path)]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"the authors' model failed ({' '.join(command)}):\n{result.stderr[-4000:]}")
    return load_arrays(out_path)


def verify(args) -> list[dict]:
    from vlbert_core.models.common.config import visual_pixel_format
    from vlbert_core.models.registry import family

    from .stages import compare_stages, golden_numbers, save_arrays
    from .vlbert.reference import normalised_images, our_outputs, reference_inputs

    layout = get_layout(args.layout)
    with tempfile.TemporaryDirectory() as scratch:
        workdir = args.workdir or Path(scratch)
        workdir.mkdir(parents=True, exist_ok=True)
        if args.stand_in is not None:
            files = write_stand_in_files(args.stand_in, layout, workdir, args.seed, args.bert_path, args.visual_weights)
        else:
            if args.bert_path is None:
                raise SystemExit("--checkpoint needs --bert-path (the BERT whose vocab.txt tokenises for it)")
            files = {"checkpoint": args.checkpoint, "bert_path": args.bert_path, "visual_weights": args.visual_weights,
                     "vocabularies": {"answers": args.answers, "object_names": args.object_names}}
        converted = convert_files(files, layout, workdir / "converted")
        inputs = reference_inputs(layout, args.seed)
        config = json.loads((converted / "config.json").read_text())   # a fine-tuned model's holds 'encoder'
        pixel_format = visual_pixel_format(family("vlbert").config_class.from_dict(config.get("encoder", config)))
        runner_inputs = dict(inputs, normalised_images=normalised_images(inputs, pixel_format))
        inputs_path = workdir / "inputs.npz"
        save_arrays(runner_inputs, inputs_path)
        theirs = run_authors(args, layout, files["checkpoint"], Path(files["bert_path"]) / "vocab.txt", inputs_path,
                             workdir / "authors.npz")
        ours = our_outputs(layout, converted, inputs)
        rows = compare_stages(ours, theirs)
        missing = sorted(set(theirs) - set(ours))
        if missing:
            raise SystemExit(f"stages the authors' run has and ours lacks: {missing}")
        if args.golden_out is not None:
            args.golden_out.mkdir(parents=True, exist_ok=True)
            save_arrays(inputs, args.golden_out / INPUTS_FILE.format(layout=layout.name))
            record = {"layout": layout.name, "manifest": Path(args.stand_in or "").stem, "seed": args.seed,
                      "authors_config": args.authors_config or layout.authors_config, "tolerance": TOLERANCE,
                      "largest_differences": {r["stage"]: r["max_abs_diff"] for r in rows},
                      "stages": golden_numbers(theirs, args.seed)}
            (args.golden_out / NUMBERS_FILE.format(layout=layout.name)).write_text(
                json.dumps(record, indent=1, sort_keys=True) + "\n")
    return rows


DETECTOR_LAYOUTS = {"bottom-up-detectron2-attr": "detectron2-attr", "bottom-up-bua-caffe": "bua-caffe"}
# ViLBERT's layouts -> the --layout of its reference check (convert/vilbert/reference.py), which does the work
VILBERT_LAYOUTS = {"vilbert": "pretrained", "vilbert-tasks": "vl-tasks", "vilbert-beta-tasks": "vl-tasks-beta"}


def verify_vilbert(argv: list[str]) -> int:
    from .vilbert.reference import main as vilbert_reference

    layout, rest = argv[0], argv[1:]
    if any(arg == "--layout" or arg.startswith("--layout=") for arg in rest):
        raise SystemExit(f"{layout}: the layout is the first argument; --layout is not taken")
    return vilbert_reference(["--layout", VILBERT_LAYOUTS[layout], *rest])


def build_detector_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m vlbert_core.convert.verify bottom-up-{detectron2-attr,bua-caffe}",
        description="Does the converted bottom-up-attention detector compute what the port computes? Compares our "
                    "converter + detector on the published file (or any file of its layout) with a reference NPZ that "
                    "a driver of the port's own extraction path wrote (docs/bottom-up-detector.md, 'Checked against "
                    "the ports': keys img<i>/fp32/<stage> and, for the port's own rounding, img<i>/fp64/<stage>), and "
                    "prints the largest difference per stage and whether the kept boxes are the same.")
    parser.add_argument("layout", choices=list(DETECTOR_LAYOUTS))
    parser.add_argument("--checkpoint", required=True, type=Path, help="the published file the port ran")
    parser.add_argument("--reference", required=True, type=Path, help="the port's per-stage NPZ")
    parser.add_argument("--images", required=True, type=Path, nargs="+", help="the images the port ran, in order")
    parser.add_argument("--config-override", default="{}",
                        help="JSON merged into the converted config, e.g. '{\"rpn_post_nms_test\": 1000}' to check "
                             "a run with another setting")
    parser.add_argument("--json", type=Path, default=None, help="write the comparison rows as JSON")
    return parser


def verify_detector(argv: list[str]) -> int:
    from .bottom_up import compare_with_port

    args = build_detector_parser().parse_args(argv)
    rows = compare_with_port(args.checkpoint, DETECTOR_LAYOUTS[args.layout], args.reference, args.images,
                             config_override=json.loads(args.config_override))
    print(f"{'stage':18s} {'ours - port':>12s} {'relative':>9s} {'port fp32 - fp64':>17s} {'relative':>9s}")
    for row in rows["stages"]:
        port = ("–".rjust(17) + " " + "–".rjust(9) if math.isnan(row["port_abs"])   # no float64 run of that stage
                else f"{row['port_abs']:17.3e} {row['port_rel']:9.2e}")
        print(f"{row['stage']:18s} {row['abs']:12.3e} {row['rel']:9.2e} {port}")
    for line in rows["kept"]:
        print(line)
    if args.json:
        stages = [{k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in row.items()}
                  for row in rows["stages"]]
        args.json.write_text(json.dumps({**rows, "stages": stages}, indent=1, allow_nan=False))
    return 0 if rows["same_kept_boxes"] else 1


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in DETECTOR_LAYOUTS:
        return verify_detector(argv)
    if argv and argv[0] in VILBERT_LAYOUTS:
        return verify_vilbert(argv)
    args = build_parser().parse_args(argv)
    from .stages import report_stages

    rows = verify(args)
    return report_stages(rows, f"{args.layout}: ours vs the authors' code ({args.checkpoint or args.stand_in}), fp32 on {os.cpu_count()} "
          f"CPU cores", TOLERANCE, args.json)


if __name__ == "__main__":
    from vlbert_core.cli import run_command

    sys.exit(run_command(main, "python -m vlbert_core.convert.verify"))
