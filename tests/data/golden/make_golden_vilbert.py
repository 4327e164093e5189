"""Writes the golden files of tests/convert/test_golden_vilbert.py: the reference batch (vilbert.inputs.npz) and the
outputs of the AUTHORS' ViLBERT at every stage on it (vilbert.authors.npz), for the stand-in checkpoint of the
small config (vlbert_core/convert/vilbert/reference.py SMALL_CONFIG: hidden 32, v_hidden 24, 3 text, 2 visual and
2 co-attention layers, vocabulary 64) with seed 0, and vilbert.json (config, seed, the differences seen); then the
same for the fine-tuned layout (their VILBertForVLTasks, every task head) without task tokens (vilbert_tasks.*)
and with them (vilbert_tasks_tokens.*, as multi_task_model.bin); with --authors-repo-beta (a checkout of
jiasenlu/vilbert_beta), for the ViLBERT paper's single-task layout too (vilbert_tasks_beta.*).

It needs the authors' code, so CI does not run it: a checkout of facebookresearch/vilbert-multi-task and a
Python environment with torch and numpy (their vilbert/utils.py is stood in for: convert/vilbert/authors_runner.py).

Run: uv run python tests/data/golden/make_golden_vilbert.py --authors-repo vilbert-multi-task \
         --authors-python ENV/bin/python
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from vlbert_core.convert.vilbert.reference import main as verify

HERE = Path(__file__).parent


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--authors-repo", required=True)
    parser.add_argument("--authors-python", required=True)
    parser.add_argument("--authors-repo-beta", default=None, help="a checkout of jiasenlu/vilbert_beta")
    args = parser.parse_args()
    runs = [(args.authors_repo, []), (args.authors_repo, ["--layout", "vl-tasks"]),
            (args.authors_repo, ["--layout", "vl-tasks", "--task-tokens"])]
    if args.authors_repo_beta:
        runs.append((args.authors_repo_beta, ["--layout", "vl-tasks-beta"]))
    for repo, layout in runs:
        status = verify(["--authors-repo", repo, "--authors-python", args.authors_python, "--small",
                         "--seed", "0", "--golden-out", str(HERE), *layout])
        if status:
            return status
    return 0


if __name__ == "__main__":
    sys.exit(main())
