#!/usr/bin/env bash
# olmo_jax GPU check: one prepared script for an H200 (also B200/B300) that in under
# 8 minutes prints the device; measures the bf16 matmul ceiling and copy bandwidth;
# checks every GPU kernel against its reference on random data; times the grouped
# matmul (Pallas vs ragged_dot vs dense of equal FLOPs) at 8 and 128 experts and the
# MXFP8 quantize kernel against copy bandwidth; trains 20 steps of a ~1B-active MoE and
# prints tokens/s and MFU; writes OUT_DIR/gpu_check.json and prints a table last.
# The work is in tools/gpu_check.py (sections, sizes, tolerances: see its docstring).
#
#   tools/gpu_check.sh [OUT_DIR] [extra gpu_check.py flags]
#   e.g. through the device tool:   tools/gpu_check.sh "$OUT"      (carry: [".whl"])
#        on a CPU, to try it:       GPU_CHECK_PYTHON=.venv/bin/python tools/gpu_check.sh /tmp/gc --dry-run
#
# Python: the machine's python3 (override with GPU_CHECK_PYTHON), which needs jax 0.12
# with its CUDA plugin, flax, optax, chex, orbax-checkpoint, ml_collections. A bare
# machine gets the missing ones from wheels carried in .whl/ (installed without an index
# into /tmp/olmo_jax_site). Prepare them once, in the repository root, on a machine that
# reaches a package index (.whl/ is git-ignored):
#
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
#     --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
#     jax==0.12.0.1 jaxlib==0.12.0.1 jax-cuda13-plugin==0.12.0.1 jax-cuda13-pjrt==0.12.0.1 \
#     flax==0.12.12 ml_collections==1.1.0
#
# Those six wheels are 224 MB (jax-cuda13-pjrt 135 MB, jaxlib 87 MB): more than the
# device tool's 64 MiB carry limit. Where the image already has jax 0.12 + its CUDA
# plugin, download only the last two (0.6 MB). For a CUDA 12 driver use the cuda12
# plugin and pjrt wheels instead. With no .whl/ the image's packages are used as they are.
set -uo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
PY="${GPU_CHECK_PYTHON:-python3}"
OUT_DIR="${1:-}"
[ $# -gt 0 ] && shift
LIMIT_S="${GPU_CHECK_TIMEOUT_S:-470}"

if compgen -G ".whl/*.whl" > /dev/null; then
  SITE=/tmp/olmo_jax_site
  echo "[gpu_check.sh] installing $(ls .whl/*.whl | wc -l) carried wheels into $SITE"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$SITE" .whl/*.whl || { echo "[gpu_check.sh] wheel install failed"; exit 2; }
  export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
# The ~1B-active training step needs most of the card; leave a little for the driver.
export XLA_PYTHON_CLIENT_MEM_FRACTION="${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.92}"

command -v nvidia-smi > /dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total \
  --format=csv,noheader || echo "[gpu_check.sh] no nvidia-smi"

if ! "$PY" - <<'EOF'
import importlib, sys
missing = []
for name in ("jax", "flax", "optax", "chex", "orbax.checkpoint", "ml_collections", "absl"):
    try:
        importlib.import_module(name)
    except Exception as e:
        missing.append(f"{name} ({type(e).__name__}: {e})")
if missing:
    print("[gpu_check.sh] missing Python packages: " + "; ".join(missing))
    print("[gpu_check.sh] carry them as wheels in .whl/ (see the top of tools/gpu_check.sh)")
    sys.exit(1)
import jax
major, minor = (int(p) for p in jax.__version__.split(".")[:2])
print(f"[gpu_check.sh] python {sys.version.split()[0]}, jax {jax.__version__}, devices {jax.devices()}")
if (major, minor) < (0, 12):
    print(f"[gpu_check.sh] WARNING: olmo_jax targets jax 0.12, found {jax.__version__}: "
          "Pallas Mosaic GPU APIs may differ; carry the jax 0.12 wheels (top of this script)")
EOF
then
  exit 2
fi

LOG=/dev/null
if [ -n "$OUT_DIR" ]; then
  mkdir -p "$OUT_DIR"
  LOG="$OUT_DIR/gpu_check.log"
fi
timeout "$LIMIT_S" "$PY" tools/gpu_check.py ${OUT_DIR:+"$OUT_DIR"} "$@" 2>&1 | tee "$LOG"
status=${PIPESTATUS[0]}
if [ "$status" = 124 ]; then
  echo "[gpu_check.sh] stopped after ${LIMIT_S}s; the JSON holds the sections that finished"
fi
exit "$status"
