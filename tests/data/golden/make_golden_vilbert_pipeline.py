"""Writes the golden files of tests/convert/test_golden_vilbert_pipeline.py: two images with their detector and
ground-truth boxes (vilbert-pipeline.inputs.npz) and the outputs of the AUTHORS' feature reader and ViLBERT at
every stage on the RoI features our pipeline computes for them, for the stand-in of
vlbert_core/convert/vilbert/pipeline_check.py PIPELINE_CONFIG with seed 0: the detections alone
(vilbert-pipeline.authors.npz) and the VCR merge with the ground-truth boxes (vilbert-pipeline.authors-vcr.npz);
vilbert-pipeline.json has the config, the seed and the differences seen.

It needs the authors' code, so CI does not run it: a checkout of facebookresearch/vilbert-multi-task and a Python
environment with torch, numpy, lmdb and h5py (convert/vilbert/authors_reader_runner.py says what is stood in for).

Run: uv run python tests/data/golden/make_golden_vilbert_pipeline.py --authors-repo vilbert-multi-task \
         --authors-python ENV/bin/python
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from vlbert_core.convert.vilbert.pipeline_check import main as verify

HERE = Path(__file__).parent


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--authors-repo", required=True)
    parser.add_argument("--authors-python", required=True)
    args = parser.parse_args()
    return verify(["--authors-repo", args.authors_repo, "--authors-python", args.authors_python, "--vcr-form",
                   "--seed", "0", "--golden-out", str(HERE)])


if __name__ == "__main__":
    sys.exit(main())
