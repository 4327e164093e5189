"""The authors' side of benchmarks/vs_authors.py: their pre-training model (jackroos/VL-BERT,
ResNetVLBERTForPretrainingMultitask) trained for a few steps on a batch, timed, in the authors' own environment.

Runs under the authors' Python: it imports torch, numpy and their code (from --repo), never this package, only
the plain helpers of vlbert_core/convert/authors_runner.py, which build their model with the CPU stand-ins it
needs (torchvision's RoIAlign for their compiled op, yaml.load's Loader) and feed it a batch in their conventions.

    PY benchmarks/authors_step.py --repo VL-BERT --config cfgs/pretrain/base_e2e_16x16G_fp16.yaml \\
        --checkpoint stand-in.model --vocab vocab.txt --inputs batch.npz --threads 1 --steps 3

Prints one JSON line: the step times, the peak RSS and the three losses in eval mode (dropout off) on the batch.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "vlbert_core" / "convert"))
import authors_runner as runner  # noqa: E402


def step_arguments(inputs: dict) -> tuple:
    """The positional arguments of their pre-training forward. The pixels of masked RoIs are zeroed here, once:
    their data loader does it, outside the step."""
    return (runner.masked_images(inputs), runner.boxes_padded(inputs, -2.0), runner.im_info(inputs, True),
            runner.t(inputs["text"]), torch.ones(inputs["text"].shape[0], dtype=torch.long),
            runner.t(inputs["mlm_labels"]), runner.t(inputs["mvrc_ops"]), runner.t(inputs["mvrc_labels"]),
            runner.t(inputs["aux_text"]), runner.t(inputs["aux_mlm_labels"]))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repo", required=True)
    parser.add_argument("--config", required=True, help="their config, relative to --repo")
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--vocab", required=True)
    parser.add_argument("--inputs", required=True, help="the batch (.npz, benchmarks/vs_authors.py)")
    parser.add_argument("--threads", type=int, required=True)
    parser.add_argument("--steps", type=int, default=3, help="timed steps, after one untimed")
    parser.add_argument("--lr", type=float, default=1e-4)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    repo = os.path.abspath(args.repo)
    sys.path.insert(0, repo)
    runner.install_stand_ins()
    with np.load(args.inputs, allow_pickle=False) as data:
        inputs = {k: data[k] for k in data.files}
    with tempfile.TemporaryDirectory() as workdir:
        model, _ = runner.build_model(repo, "pretrain", args.config, args.vocab, workdir)
    runner.load_checkpoint(model, args.checkpoint)
    batch = step_arguments(inputs)

    with torch.no_grad():          # eval mode: no dropout, so both sides' losses can be compared
        outputs, _ = model(*batch)
    losses = {"mlm_caption": float(outputs["mlm_loss_wvc"].mean()), "mlm_text": float(outputs["mlm_loss_aux"].mean()),
              "roi": float(outputs["mvrc_loss"].mean())}

    model.train()
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=args.lr)
    times = []
    for step in range(args.steps + 1):
        start = time.perf_counter()
        _, loss = model(*batch)
        loss.mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step > 0:
            times.append(time.perf_counter() - start)
    print(json.dumps({"side": "authors", "step_s": times, "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                      "losses": losses, "trainable": sum(p.numel() for p in model.parameters() if p.requires_grad)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
