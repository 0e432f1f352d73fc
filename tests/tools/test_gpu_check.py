"""tools/gpu_check.sh end to end on the CPU with --dry-run: every section runs (the
Pallas kernels in GPU interpret mode, tiny sizes), the kernel checks pass, the JSON is
written and the table printed last. On a GPU the same script runs with full sizes."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_gpu_check_dry_run(tmp_path):
    env = dict(os.environ, GPU_CHECK_PYTHON=sys.executable, XLA_FLAGS="")
    proc = subprocess.run(
        [str(ROOT / "tools" / "gpu_check.sh"), str(tmp_path), "--dry-run"],
        env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads((tmp_path / "gpu_check.json").read_text())
    sections = results["sections"]
    names = ["device", "ceilings", "kernels", "gmm_timing", "mxfp8_timing", "train"]
    assert list(sections) == names
    assert results["ok"] and not any("error" in s for s in sections.values())
    checks = sections["kernels"]["checks"]
    assert len(checks) == 5 and all(c["ok"] for c in checks)
    assert sections["train"]["bf16_auto"]["tokens_per_s"] > 0
    tail = proc.stdout.strip().splitlines()
    assert tail[-1].startswith("overall") and "OK" in tail[-1]
    assert (tmp_path / "gpu_check.log").read_text().strip().endswith(tail[-1])


def test_gpu_check_refuses_a_cpu_without_dry_run():
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "gpu_check.py"), "--sections", "device"],
        env=dict(os.environ, XLA_FLAGS=""), capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 2 and "--dry-run" in proc.stderr
