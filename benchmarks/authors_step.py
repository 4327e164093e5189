"""The authors' side of benchmarks/vs_authors.py: their pre-training model (jackroos/VL-BERT,
ResNetVLBERTForPretrainingMultitask) trained for a few steps on a batch, timed, in the authors' own environment.

Runs under the authors' Python: it imports torch, numpy and their code (from --repo), never this package, only
the plain helpers of vlbert_core/convert/authors_runner.py, which build their model with the CPU stand-ins it
needs (torchvision's RoIAlign for their compiled op, yaml.load's Loader) and feed it a batch in their conventions.

    PY benchmarks/authors_step.py --repo VL-BERT --config cfgs/pretrain/base_e2e_16x16G_fp16.yaml \\
        --checkpoint stand-in.model --vocab vocab.txt --inputs batch.npz --threads 1 --steps 3

Prints one JSON line: the step times, the peak RSS (and on a GPU the peak of torch.cuda.max_memory_allocated over
the timed steps) and the three losses in eval mode (dropout off) on the batch.

By default a step is fp32 forward, backward and plain SGD on the CPU (benchmarks/vs_authors.py). benchmarks/gpu.py
--authors-repo runs their training loop's step instead (common/trainer.py, pretrain/function/train.py):
`--device cuda --precision fp16 --optimizer adamw --clip 10`: forward under torch.autocast fp16 with a dynamic
GradScaler in place of apex amp O2 (which keeps an fp16 copy of the model and fp32 master weights; autocast keeps
fp32 weights and casts per operation), backward, unscale, clip_grad_norm_, their own AdamW
(common/nlp/bert/optimization.py). Packages their code imports but this step never calls (easydict for their
config, boto3 / botocore for S3 downloads) are stood in for where missing (`install_missing_imports`), so the
step also runs under a Python that has only torch, torchvision, numpy and PyYAML (a GPU machine's).
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "vlbert_core" / "convert" / "vlbert"))
import authors_runner as runner  # noqa: E402


def step_arguments(inputs: dict) -> tuple:
    """The positional arguments of their pre-training forward. The pixels of masked RoIs are zeroed here, once:
    their data loader does it, outside the step."""
    return (runner.masked_images(inputs), runner.boxes_padded(inputs, -2.0), runner.im_info(inputs, True),
            runner.t(inputs["text"]), torch.ones(inputs["text"].shape[0], dtype=torch.long),
            runner.t(inputs["mlm_labels"]), runner.t(inputs["mvrc_ops"]), runner.t(inputs["mvrc_labels"]),
            runner.t(inputs["aux_text"]), runner.t(inputs["aux_mlm_labels"]))


def install_missing_imports() -> list[str]:
    """Stand-ins for the modules their code imports without using them in this step, where they are missing:
    easydict.EasyDict (their config container: a dict whose keys are attributes, nested dicts converted) and
    boto3 / botocore.exceptions (imported by external/pytorch_pretrained_bert/file_utils.py for s3:// URLs)."""
    import importlib.util
    import types

    installed = []
    if importlib.util.find_spec("easydict") is None:
        class EasyDict(dict):
            def __init__(self, d=None, **kwargs):
                super().__init__()
                for k, v in {**(d or {}), **kwargs}.items():
                    setattr(self, k, v)

            def __setattr__(self, name, value):
                if isinstance(value, dict) and not isinstance(value, EasyDict):
                    value = EasyDict(value)
                elif isinstance(value, (list, tuple)):
                    value = type(value)(EasyDict(x) if isinstance(x, dict) else x for x in value)
                super().__setattr__(name, value)
                super().__setitem__(name, value)

            __setitem__ = __setattr__

        sys.modules["easydict"] = types.ModuleType("easydict")
        sys.modules["easydict"].EasyDict = EasyDict
        installed.append("easydict")
    if importlib.util.find_spec("boto3") is None:
        sys.modules["boto3"] = types.ModuleType("boto3")
        installed.append("boto3")
    if importlib.util.find_spec("botocore") is None:
        botocore, exceptions = types.ModuleType("botocore"), types.ModuleType("botocore.exceptions")
        exceptions.ClientError = type("ClientError", (Exception,), {})
        botocore.exceptions = exceptions
        sys.modules.update({"botocore": botocore, "botocore.exceptions": exceptions})
        installed.append("botocore")
    return installed


def their_optimizer(model, name: str, lr: float, weight_decay: float):
    """SGD (vs_authors.py), or their AdamW as pretrain/function/train.py builds it (one group, their WD)."""
    params = [p for p in model.parameters() if p.requires_grad]
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr)
    from common.nlp.bert.optimization import AdamW

    return AdamW(params, lr=lr, betas=(0.9, 0.999), eps=1e-6, weight_decay=weight_decay)


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
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--precision", choices=["fp32", "fp16"], default="fp32",
                        help="fp16: torch.autocast fp16 + GradScaler, their apex O2's stand-in")
    parser.add_argument("--optimizer", choices=["sgd", "adamw"], default="sgd")
    parser.add_argument("--weight-decay", type=float, default=1e-4, help="of their AdamW")
    parser.add_argument("--clip", type=float, default=0.0, help="clip_grad_norm_ (0: none)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps before the timed ones")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    repo = os.path.abspath(args.repo)
    sys.path.insert(0, repo)
    stood_in = install_missing_imports()
    if stood_in:
        print(f"authors_step: stand-ins for the unused imports {', '.join(stood_in)}", file=sys.stderr)
    runner.install_stand_ins()
    device = torch.device(args.device)
    with np.load(args.inputs, allow_pickle=False) as data:
        inputs = {k: data[k] for k in data.files}
    with tempfile.TemporaryDirectory() as workdir:
        # their pre-training model (the e2e and prec layouts build the same class; args.config says which)
        model, _ = runner.build_model(repo, runner.LAYOUTS["pretrain-e2e"], args.config, args.vocab, workdir)
    runner.load_checkpoint(model, args.checkpoint)
    model.to(device)
    batch = tuple(x.to(device) for x in step_arguments(inputs))

    with torch.no_grad():          # eval mode: no dropout, so both sides' losses can be compared
        outputs, _ = model(*batch)
    losses = {"mlm_caption": float(outputs["mlm_loss_wvc"].mean()), "mlm_text": float(outputs["mlm_loss_aux"].mean()),
              "roi": float(outputs["mvrc_loss"].mean())}

    model.train()
    optimizer = their_optimizer(model, args.optimizer, args.lr, args.weight_decay)
    fp16 = args.precision == "fp16"
    scaler = torch.amp.GradScaler(device.type, enabled=fp16)
    trainable = [p for p in model.parameters() if p.requires_grad]

    def step():
        with torch.autocast(device.type, dtype=torch.float16, enabled=fp16):
            _, loss = model(*batch)
        scaler.scale(loss.mean()).backward()
        if args.clip > 0:
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(trainable, args.clip)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)

    def synchronize():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    if device.type == "cuda":   # as benchmarks/gpu.py measure(): the peak over the warm-up and timed steps
        torch.cuda.reset_peak_memory_stats(device)
    for _ in range(args.warmup):
        step()
    synchronize()
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        step()
        synchronize()
        times.append(time.perf_counter() - start)
    peak_gpu = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    print(json.dumps({"side": "authors", "step_s": times,
                      "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                      "peak_gpu_bytes": peak_gpu, "losses": losses,
                      "trainable": sum(p.numel() for p in model.parameters() if p.requires_grad)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
