"""Writes the golden files of tests/convert/test_golden_released.py: for each released layout (vlbert_core/convert/
released_heads.py LAYOUTS), the reference batch (<layout>.inputs.npz) and a few numbers per stage of the AUTHORS'
model on it (<layout>.json), computed from the stand-in checkpoint of the layout's manifest (seed 0).

It needs the authors' code, so CI does not run it: a checkout of jackroos/VL-BERT and a Python environment
that runs it (torch and torchvision as pinned here, easydict, pyyaml, boto3, requests, tqdm, regex; their
RoIAlign extension is not needed, docs/released-architecture.md says how it is stood in for).

Run: uv run python tests/data/golden/make_golden.py --authors-repo VL-BERT --authors-python ENV/bin/python
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from vlbert_core.convert.released_heads import LAYOUTS
from vlbert_core.convert.verify import main as verify

HERE = Path(__file__).parent
MANIFESTS = HERE.parents[2] / "vlbert_core" / "convert" / "manifests"  # package data (MANIFEST_DIR)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--authors-repo", required=True)
    parser.add_argument("--authors-python", required=True)
    parser.add_argument("--layouts", nargs="*", default=list(LAYOUTS))
    args = parser.parse_args()
    failed = []
    for name in args.layouts:
        code = verify([name, "--authors-repo", args.authors_repo, "--authors-python", args.authors_python,
                       "--stand-in", str(MANIFESTS / f"{LAYOUTS[name].manifest}.json"), "--seed", "0",
                       "--golden-out", str(HERE)])
        if code:
            failed.append(name)
    if failed:
        print(f"ABOVE the tolerance: {failed}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
