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
# Python: the machine's python3 (override with GPU_CHECK_PYTHON), which needs jax
# 0.11.2 .. 0.12.x with its CUDA plugin, flax >= 0.12.10, optax, chex, orbax-checkpoint,
# ml_collections, grain. The lent H200 image has all but the wheels listed in
# tools/gpu_wheels.txt (ml_collections, grain and grain's array_record, cloudpickle,
# portpicker: 4.6 MB, of which array_record 3.8 MB; their other dependencies are on the
# image; tests/trainer/test_image_packages.py checks that list). Carry them in .whl/: they
# are installed without an index and without deps into /tmp/olmo_jax_site, ahead of the
# image's packages. Prepare them once, in the repository root, on a machine that reaches
# a package index (.whl/ is git-ignored):
#
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 \
#     -d .whl -r tools/gpu_wheels.txt
#
# Nothing else is needed there: olmo_jax runs on jax 0.11.2 (olmo_jax/compat.py). On a
# bare machine with no jax, .whl/ may also hold jax/jaxlib/flax and the CUDA plugin+pjrt
# wheels, but those are ~220 MB, beyond the device tool's 64 MiB carry.
# With no .whl/ the machine's packages are used as they are.
set -uo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
PY="${GPU_CHECK_PYTHON:-python3}"
OUT_DIR="${1:-}"
[ $# -gt 0 ] && shift
LIMIT_S="${GPU_CHECK_TIMEOUT_S:-470}"

WHEELS="${GPU_CHECK_WHEELS:-$REPO/.whl}"  # overridable for the CPU test
if compgen -G "$WHEELS/*.whl" > /dev/null; then
  SITE="${GPU_CHECK_SITE:-/tmp/olmo_jax_site}"
  echo "[gpu_check.sh] installing carried wheels into $SITE:" $(cd "$WHEELS" && ls *.whl)
  if "$PY" -m pip --version > /dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target "$SITE" "$WHEELS"/*.whl || { echo "[gpu_check.sh] wheel install failed"; exit 2; }
  else  # no pip on the machine: a wheel (no scripts, no .data) is a zip of its site-packages files
    "$PY" - "$SITE" "$WHEELS"/*.whl <<'EOF' || exit 2
import sys, zipfile
for wheel in sys.argv[2:]:
    zipfile.ZipFile(wheel).extractall(sys.argv[1])
EOF
  fi
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
for name in ("jax", "flax", "optax", "chex", "orbax.checkpoint", "ml_collections", "absl", "grain"):
    try:
        importlib.import_module(name)
    except Exception as e:
        missing.append(f"{name} ({type(e).__name__}: {e})")
if missing:
    print("[gpu_check.sh] missing Python packages: " + "; ".join(missing))
    print("[gpu_check.sh] carry them as wheels in .whl/ (see the top of tools/gpu_check.sh)")
    sys.exit(1)
import jax
version = tuple(int(p) for p in jax.__version__.split(".")[:3])
print(f"[gpu_check.sh] python {sys.version.split()[0]}, jax {jax.__version__}, devices {jax.devices()}")
if not (0, 11, 2) <= version < (0, 13):
    print(f"[gpu_check.sh] jax {jax.__version__}: olmo_jax needs jax >= 0.11.2, < 0.13 (pyproject.toml)")
    sys.exit(1)
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
