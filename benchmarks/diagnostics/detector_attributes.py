"""Benchmark: what the attribute head costs in detector training (config.yaml's detector, the world's data).

A diagnostic: run to settle one question, not a benchmark that is re-run. Backs docs/detector-attributes.md
"Measured" (the cost of the attribute head); with --write-docs it writes the section "Detector training: the
attribute head's cost" of docs/benchmarks.md.

Two detectors of the run's `detector:` config, one with `attribute_loss_weight: 0` (no attribute head, the
detector before the head existed) and one with the configured weight (the attribute head trained), take
training steps alternately (A B A B ...) on the same batches, so that a noisy shared machine slows both
alike; reported as median seconds per step and their ratio. Multiplied by the configured number of steps,
the ratio estimates the train_detector job's cost of the head.

    uv run python benchmarks/diagnostics/detector_attributes.py --steps 30 --write-docs

Needs the world's detector annotations (`snakemake --cores all resources/synthetic/detector/instances_train.json`
or any run of the workflow).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/, for docs_section
from docs_section import replace_section  # noqa: E402

import torch
import yaml

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from vlbert_core.detector import build_detector  # noqa: E402
from vlbert_core.detector.train import load_coco_split  # noqa: E402
from vlbert_core.utils import setup_compute  # noqa: E402

SECTION = "## Detector training: the attribute head's cost"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, default=REPO / "config" / "config.yaml")
    parser.add_argument("--steps", type=int, default=30, help="timed steps per detector (after 2 warm-up steps)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--write-docs", action="store_true", help=f"replace '{SECTION}' in docs/benchmarks.md")
    args = parser.parse_args(argv)
    setup_compute(args.threads)
    config = yaml.safe_load(args.config.read_text())
    cfg, sources = dict(config["detector"]), config["sources"]["detector"]
    weight = float(cfg.get("attribute_loss_weight", 0.0))
    if weight <= 0:
        raise ValueError(f"{args.config}: detector.attribute_loss_weight is {weight}: nothing to compare")
    categories, data, attributes = load_coco_split(REPO / sources["annotations"].format(split="train"),
                                                   REPO / sources["images"])
    if attributes is None:
        raise ValueError(f"{sources['annotations']}: no attributes in the detector's annotations")
    batch_size = int(cfg["train"]["batch_size"])
    models = {}
    for name, extra in (("without head", {"attribute_loss_weight": 0.0}),
                        ("with head", {"attribute_loss_weight": weight, "num_attributes": len(attributes)})):
        torch.manual_seed(0)
        model = build_detector({**cfg, **extra}, len(categories)).train()
        optimizer = torch.optim.SGD(model.parameters(), lr=float(cfg["train"]["lr"]) / 10, momentum=0.9)
        models[name] = (model, optimizer, "num_attributes" in extra)
    times: dict[str, list[float]] = {name: [] for name in models}
    generator = torch.Generator().manual_seed(0)
    for step in range(args.steps + 2):
        batch = [data[i] for i in torch.randint(len(data), (batch_size,), generator=generator).tolist()]
        images = [d.image.float().div(255.0) for d in batch]
        for name, (model, optimizer, with_attributes) in models.items():
            targets = [{"boxes": d.boxes, "labels": d.labels, **({"attributes": d.attributes} if with_attributes else {})}
                       for d in batch]
            started = time.perf_counter()
            loss = sum(model(images, targets).values())
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            if step >= 2:
                times[name].append(time.perf_counter() - started)
    median = {name: statistics.median(t) for name, t in times.items()}
    ratio = median["with head"] / median["without head"]
    steps = int(cfg["train"]["steps"])
    body = "\n".join([
        f"Measured {time.strftime('%Y-%m-%d')} with `uv run python benchmarks/diagnostics/detector_attributes.py --steps "
        f"{args.steps}{' --write-docs' if args.write_docs else ''}` ({args.threads} threads; {args.steps} timed "
        f"steps each, alternating, batch {batch_size}, config/config.yaml's detector on the world's "
        f"{len(data)} training images):",
        "",
        "| detector | median s / step |",
        "|---|---|",
        *(f"| {name} | {m:.3f} |" for name, m in median.items()),
        "",
        f"Ratio {ratio:.3f}: the attribute head adds {100 * (ratio - 1):+.1f}% to a training step, about "
        f"{(median['with head'] - median['without head']) * steps:+.0f} s over the configured {steps} steps "
        "(on this machine's load at the time).",
    ]) + "\n"
    print(body)
    if args.write_docs:
        replace_section(SECTION, body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
