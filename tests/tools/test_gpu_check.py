"""tools/gpu_check.sh end to end on the CPU with --dry-run: every section runs (the
Pallas kernels in GPU interpret mode, tiny sizes), the kernel checks pass, the JSON is
written and the table printed last. On a GPU the same script runs with full sizes.
Carried wheels (.whl/, here a tiny pure-Python one in a temporary folder) are installed
without an index into the site folder that the check then runs with. The suite runs
this file in the jax 0.11.2 venv too (the GPU image's jax)."""

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _pure_python_wheel(folder: Path) -> Path:
    """A minimal valid wheel of one module (what `pip download ml_collections` brings)."""
    folder.mkdir()
    path = folder / "olmo_jax_probe-1.0-py3-none-any.whl"
    info = "olmo_jax_probe-1.0.dist-info"
    files = {
        "olmo_jax_probe.py": "CARRIED = True\n",
        f"{info}/METADATA": "Metadata-Version: 2.1\nName: olmo_jax_probe\nVersion: 1.0\n",
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = "".join(f"{name},,\n" for name in [*files, f"{info}/RECORD"])
    with zipfile.ZipFile(path, "w") as z:
        for name, text in {**files, f"{info}/RECORD": record}.items():
            z.writestr(name, text)
    return path


def test_gpu_check_dry_run(tmp_path):
    out, site = tmp_path / "out", tmp_path / "site"
    wheels = _pure_python_wheel(tmp_path / "whl").parent
    env = dict(os.environ, GPU_CHECK_PYTHON=sys.executable, XLA_FLAGS="",
               GPU_CHECK_WHEELS=str(wheels), GPU_CHECK_SITE=str(site))
    proc = subprocess.run(
        [str(ROOT / "tools" / "gpu_check.sh"), str(out), "--dry-run"],
        env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"installing carried wheels into {site}: olmo_jax_probe-1.0-py3-none-any.whl" in proc.stdout
    assert (site / "olmo_jax_probe.py").read_text() == "CARRIED = True\n"
    results = json.loads((out / "gpu_check.json").read_text())
    sections = results["sections"]
    names = ["device", "ceilings", "kernels", "gmm_timing", "mxfp8_timing", "train"]
    assert list(sections) == names
    assert results["ok"] and not any("error" in s for s in sections.values())
    checks = sections["kernels"]["checks"]
    assert len(checks) == 5 and all(c["ok"] for c in checks)
    assert sections["train"]["bf16_auto"]["tokens_per_s"] > 0
    tail = proc.stdout.strip().splitlines()
    assert tail[-1].startswith("overall") and "OK" in tail[-1]
    assert (out / "gpu_check.log").read_text().strip().endswith(tail[-1])


def test_gpu_check_refuses_a_cpu_without_dry_run():
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "gpu_check.py"), "--sections", "device"],
        env=dict(os.environ, XLA_FLAGS=""), capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 2 and "--dry-run" in proc.stderr
