#!/usr/bin/env bash
# olmo_jax GPU check for the lent H200 as it is (Python 3.12, jax 0.11.2 + jax-cuda13,
# flax, optax, orbax, chex, absl, torch 2.11, transformers 5.17; no registry): in under
# 8 minutes, each section in its own process with its own time budget
# (tools/gpu_check/driver.py): ceilings, grouped-matmul kernels, attention (cuDNN vs
# XLA), MXFP8 numerics, configs/gpu_check_1b.py trained 30 steps through the trainer's
# plan with gmm_impl pallas / ragged_dot / einsum, then the same shape in torch with
# transformers' OlmoeForCausalLM and OLMo-core 3's MoE model. One table is printed last;
# OUT_DIR gets gpu_check.json (every section's result) and gpu_check.log.
#
#   tools/gpu_check.sh [OUT_DIR] [driver flags, e.g. --sections ceilings,gmm]
#   on the device, through the `run` tool:  tools/gpu_check.sh "$OUT"    carry: [".whl"]
#   on a CPU (make test):  GPU_CHECK_PYTHON=.venv/bin/python GPU_CHECK_TORCH_PYTHON=.venv-oracle/bin/python \
#                          tools/gpu_check.sh /tmp/gc --dry-run
#
# Wheels: the image lacks ml_collections (and grain for `python -m olmo_jax.train`) and
# OLMo-core with the pure-Python part of its import closure. `make gpu-wheels` downloads
# the pinned tools/requirements/gpu_wheels*.txt into the git-ignored .whl/ here; this script installs
# them there with `pip install --no-index --no-deps --target` ahead of the image's
# packages, and puts the repository on PYTHONPATH. It prints the bytes that travelled.
set -uo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
PY="${GPU_CHECK_PYTHON:-python3}"
export GPU_CHECK_TORCH_PYTHON="${GPU_CHECK_TORCH_PYTHON:-$PY}"
OUT_DIR="${1:-/tmp/olmo_jax_gpu_check}"
[ $# -gt 0 ] && shift
mkdir -p "$OUT_DIR"
LIMIT_S="${GPU_CHECK_TIMEOUT_S:-475}"

# What travels with a `run` call: the tracked and the untracked, not ignored files (git
# ls-files; where there is no git, as on the device, the copy that arrived: du) with the
# carried, ignored .whl/; the device tool's limit is 64 MiB.
whl_bytes=0
WHEELS="${GPU_CHECK_WHEELS:-$REPO/.whl}"  # overridable for the CPU test
compgen -G "$WHEELS/*.whl" > /dev/null && whl_bytes=$(cat "$WHEELS"/*.whl | wc -c)
if files_bytes=$(cd "$REPO" && git ls-files -z -c -o --exclude-standard 2>/dev/null \
                 | xargs -0 -r stat -L -c %s -- 2>/dev/null | awk '{s += $1} END {print s + 0}') \
   && [ "${files_bytes:-0}" -gt 0 ]; then
  tree_bytes=$(( files_bytes + whl_bytes ))
else
  tree_bytes=$(du -sb --exclude=.git --exclude=.venv\* --exclude=runs "$REPO" 2>/dev/null | cut -f1)
fi
if [ "$whl_bytes" -gt 0 ]; then
  SITE="${GPU_CHECK_SITE:-/tmp/olmo_jax_site}"
  echo "[gpu_check.sh] installing carried wheels into $SITE:" $(cd "$WHEELS" && ls *.whl)
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$SITE" "$WHEELS"/*.whl || { echo "[gpu_check.sh] wheel install failed"; exit 2; }
  export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi
echo "[gpu_check.sh] traffic: working tree $tree_bytes bytes, of which carried wheels $whl_bytes bytes" \
  "($(( tree_bytes * 100 / (64 * 1048576) ))% of the 64 MiB limit)"
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
# The ~1B-active training step needs most of the card; each section is its own process.
export XLA_PYTHON_CLIENT_MEM_FRACTION="${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.92}"

command -v nvidia-smi > /dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total \
  --format=csv,noheader || echo "[gpu_check.sh] no nvidia-smi"
"$PY" -c "import sys, jax; print('[gpu_check.sh] python', sys.version.split()[0], 'jax', jax.__version__, jax.devices())" \
  || { echo "[gpu_check.sh] $PY cannot import jax"; exit 2; }
if [[ " $* " != *" --dry-run "* ]] && ! "$PY" -c "import jax, sys; sys.exit(jax.devices()[0].platform != 'gpu')"; then
  echo "[gpu_check.sh] no GPU: jax sees $("$PY" -c 'import jax; print(jax.devices()[0].platform)'); use --dry-run on a CPU"
  exit 2
fi

timeout -k 5 "$LIMIT_S" "$PY" tools/gpu_check/driver.py "$OUT_DIR" --deadline-s $(( LIMIT_S - 10 )) "$@" 2>&1 \
  | tee "$OUT_DIR/gpu_check.log"
status=${PIPESTATUS[0]}
[ "$status" = 124 ] && echo "[gpu_check.sh] stopped after ${LIMIT_S}s; $OUT_DIR/gpu_check.json holds the sections that finished"
exit "$status"
