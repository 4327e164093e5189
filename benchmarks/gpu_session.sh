#!/usr/bin/env bash
# The one device command of a GPU session for issue 57: everything it measures, under $OUT, within a budget.
#
#   bash benchmarks/gpu_session.sh [BUDGET_S]     # on the GPU machine (default 540 s; it stops itself by then)
#   bash benchmarks/gpu_session.sh --dry-run      # anywhere: prints the steps and their time limits, runs none
#
# Steps (each under `timeout`, its share of what is left of the budget):
#   1. the machine: nvidia-smi, python, torch, CUDA, the commit (summary.txt, with each step's rc and seconds)
#   2. benchmarks/gpu.py --only pretrain loader: pre-training at the released batch and the largest that fits,
#      the loader, ours beside the authors' step at the released batch and at 4x (--authors-repo), the
#      GPU-hours estimate (gpu.log, gpu.json)
#   3. benchmarks/gpu.py --only --ab ...: each A/B switch against today's code on every workload it changes
#      (bf16, channels_last, foreach, rois_batch, then compile, the slowest to build) (ab.log, ab.json)
#   4. the rehearsal DAG on the GPU (config/rehearsal.yaml + config/rehearsal_gpu.yaml) under Snakemake, its
#      wall time and per-rule seconds from the rules' benchmark files (dag.log, rule_times.md, rule_tsv.tgz)
#
# Python: the GPU machine reaches no package registry and its code runs under that machine's own python3 (its
# torch, torchvision, numpy, PyYAML, transformers, pyarrow), not the project's .venv: a .venv cannot travel
# (its interpreter is a link into this machine's pyenv, and torch alone is far over the 64 MiB a call carries).
# No `uv sync` or `uv run` runs here. What that python lacks travels as wheels in .whl/ (carry [".whl",
# ".authors"]; benchmarks/gpu_session_wheels.sh fetches them), installed with pip --no-index into /tmp/site.
# The authors' checkout travels as .authors/VL-BERT (git clone of jackroos/VL-BERT).
set -u -o pipefail
DRY=0
BUDGET=540
for arg in "$@"; do
  case "$arg" in
    --dry-run) DRY=1 ;;
    *) BUDGET="$arg" ;;
  esac
done
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/gpu_session_out}"
PY="${PYTHON:-python3}"
AUTHORS="${AUTHORS_REPO:-.authors/VL-BERT}"
START=$(date +%s)
left() { echo $(( BUDGET - ($(date +%s) - START) )); }
# share PERCENT of what is left, minus a reserve of 15 s for the files after it
share() { local s=$(( ($(left) - 15) * $1 / 100 )); [ "$s" -lt 1 ] && s=1; echo "$s"; }

step() {   # step NAME PERCENT LOG COMMAND...
  local name=$1 percent=$2 log=$3; shift 3
  local limit; limit=$(share "$percent")
  if [ "$DRY" = 1 ]; then
    echo "step $name: at most $percent% of what is left (of $BUDGET s): $*"
    return 0
  fi
  echo "step $name: up to $limit s: $*" | tee -a "$OUT/summary.txt"
  local t0; t0=$(date +%s)
  PYTHONUNBUFFERED=1 timeout --kill-after=10 "$limit" "$@" >"$OUT/$log" 2>&1
  local rc=$?
  echo "step $name: rc $rc after $(( $(date +%s) - t0 )) s" | tee -a "$OUT/summary.txt"
}

GPU_ARGS=(benchmarks/gpu.py --device cuda --only pretrain loader --authors-repo "$AUTHORS" --authors-python "$PY"
          --authors-multiples 1 4 --authors-pairs 2 --out-json "$OUT/gpu.json")
AB_ARGS=(benchmarks/gpu.py --device cuda --only --ab bf16 channels_last foreach rois_batch compile
         --out-json "$OUT/ab.json")
DAG_DIR=/tmp/rehearsal_gpu
DAG_ARGS=(-m snakemake -s "$PWD/Snakefile" -d "$DAG_DIR" --cores all results/tables/table4_ablation.csv
          --configfile "$PWD/config/rehearsal.yaml" "$PWD/config/rehearsal_gpu.yaml")

if [ "$DRY" = 1 ]; then
  echo "gpu_session: dry run (budget $BUDGET s; nothing is run). Python: $PY with .whl/*.whl on PYTHONPATH"
  echo "step env: nvidia-smi, python, torch, the commit (into summary.txt)"
  step gpu 40 gpu.log "$PY" "${GPU_ARGS[@]}"
  step ab 45 ab.log "$PY" "${AB_ARGS[@]}"
  step dag 95 dag.log "$PY" "${DAG_ARGS[@]}"
  echo "step rule_times: $PY -c 'vlbert_core.rule_times.rule_table(...)' over $DAG_DIR/benchmarks/rules"
  exit 0
fi

mkdir -p "$OUT"
: >"$OUT/summary.txt"
if compgen -G ".whl/*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "gpu_session: the carried wheels did not install" | tee -a "$OUT/summary.txt"; exit 1; }
  export PYTHONPATH="/tmp/site:$PWD/.whl/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
{ nvidia-smi; "$PY" -c 'import sys, torch; print(sys.version); print("torch", torch.__version__, "CUDA",
  torch.version.cuda, torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU")'; git log -1 --format=%H 2>/dev/null; } \
  >>"$OUT/summary.txt" 2>&1
[ -d "$AUTHORS" ] || echo "gpu_session: no authors' checkout at $AUTHORS" | tee -a "$OUT/summary.txt"
step gpu 40 gpu.log "$PY" "${GPU_ARGS[@]}"
step ab 45 ab.log "$PY" "${AB_ARGS[@]}"
rm -rf "$DAG_DIR"
DAG_T0=$(date +%s)
step dag 95 dag.log "$PY" "${DAG_ARGS[@]}"
echo "dag wall: $(( $(date +%s) - DAG_T0 )) s" | tee -a "$OUT/summary.txt"
"$PY" - "$DAG_DIR" >"$OUT/rule_times.md" 2>&1 <<'PYEOF'
import sys
from vlbert_core.rule_times import rule_table, rule_times, run_wall_seconds
print(rule_table(rule_times(sys.argv[1]), run_wall_seconds(sys.argv[1])))
PYEOF
tar -czf "$OUT/rule_tsv.tgz" -C "$DAG_DIR" benchmarks/rules .snakemake/log 2>/dev/null
echo "gpu_session: $(( $(date +%s) - START )) s of $BUDGET" | tee -a "$OUT/summary.txt"
