"""The GPU check's driver (run by tools/gpu_check.sh): every section in its own process
with its own time budget, one after another (so JAX's and torch's GPU memory never meet
and a crash or a hang costs one section), the results in OUT_DIR/gpu_check.json
(rewritten after each section; gpu_check.sh adds gpu_check.log), and one table printed
last whatever failed.

    python tools/gpu_check/driver.py [OUT_DIR] [--dry-run] [--sections a,b] [--deadline-s 470]

Sections, budgets in seconds on the GPU (tools/gpu_check/{jax_kernels,jax_train,torch_train}.py
say what each measures): ceilings, gmm, attention, mxfp8, then configs/gpu_check_1b.py trained
30 steps with gmm_impl pallas, ragged_dot and einsum, then the same shape and batch in
torch with transformers' OlmoeForCausalLM and OLMo-core 3's MoE model. A section gets
min(its budget, the time left before --deadline-s); one with under 5 s left is skipped.
The torch sections run under $GPU_CHECK_TORCH_PYTHON (default: this Python).

Exit status 0 when every olmo_jax section ran, its checks passed and the three training
runs' losses agree; the two torch references are reported (ran, or the exact reason they
did not) without deciding it."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
import table  # noqa: E402

HERE = Path(__file__).resolve().parent
STEPS, DRY_STEPS = 30, 1
DRY_XLA_FLAGS = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
# name: (script, arguments, GPU budget s)
SECTIONS = {
    "ceilings": ("jax_kernels.py", ["ceilings"], 25),
    "gmm": ("jax_kernels.py", ["gmm"], 50),
    "attention": ("jax_kernels.py", ["attention"], 35),
    "mxfp8": ("jax_kernels.py", ["mxfp8"], 25),
    "train_pallas": ("jax_train.py", ["train", "--gmm-impl", "pallas"], 80),
    "train_ragged_dot": ("jax_train.py", ["train", "--gmm-impl", "ragged_dot"], 70),
    "train_einsum": ("jax_train.py", ["train", "--gmm-impl", "einsum"], 70),
    "hf": ("torch_train.py", ["hf"], 55),
    "olmo_core": ("torch_train.py", ["olmo_core"], 45),
}
TORCH = ("hf", "olmo_core")


def run_section(name: str, work_dir: Path, dry: bool, budget: float) -> dict:
    script, args, _ = SECTIONS[name]
    result_path = work_dir / f"{name}.json"
    result_path.unlink(missing_ok=True)
    python = os.environ.get("GPU_CHECK_TORCH_PYTHON", sys.executable) if name in TORCH else sys.executable
    cmd = [python, str(HERE / script), *args, str(result_path),
           "--steps", str(DRY_STEPS if dry else STEPS)]
    if name in TORCH:
        cmd += ["--shape", json.dumps(common.shape(dry))]
    if dry:
        cmd.append("--dry-run")
    env = dict(os.environ)
    if dry:  # XLA:CPU compiles the tiny programs faster unoptimized (numbers mean nothing there)
        env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {DRY_XLA_FLAGS}".strip()
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, start_new_session=True, env=env)  # its own group: a timeout ends all of it
    try:
        rc = proc.wait(timeout=budget)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        return {"error": f"timed out after its budget of {budget:.0f} s", "seconds": budget}
    if not result_path.exists():
        return {"error": f"the process exited with status {rc} and wrote no result",
                "seconds": time.perf_counter() - t0}
    return json.loads(result_path.read_text())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out_dir", nargs="?", default="")
    p.add_argument("--dry-run", action="store_true")
    p.add_argument("--sections", default=",".join(SECTIONS))
    p.add_argument("--deadline-s", type=float, default=470.0)
    a = p.parse_args(argv)
    names = [s for s in a.sections.split(",") if s]
    unknown = set(names) - set(SECTIONS)
    if unknown:
        p.error(f"unknown sections {sorted(unknown)}; choose from {list(SECTIONS)}")
    out_dir = Path(a.out_dir or "/tmp/olmo_jax_gpu_check")
    out_dir.mkdir(parents=True, exist_ok=True)
    # Each section's own JSON goes beside, not into OUT_DIR: the device tool brings back at
    # most 8 files, and gpu_check.json holds every section's result anyway.
    work_dir = Path(tempfile.mkdtemp(prefix="olmo_jax_gpu_check_"))
    start = time.perf_counter()
    results = {"dry_run": a.dry_run, "sections": {}}
    for name in names:
        left = a.deadline_s - (time.perf_counter() - start)
        budget = min(SECTIONS[name][2] * (4 if a.dry_run else 1), left)
        print(f"[gpu_check] {name} (budget {budget:.0f} s) ...", flush=True)
        if budget < 5:
            res = {"error": f"skipped: {left:.0f} s left before the {a.deadline_s:.0f} s deadline"}
        else:
            res = run_section(name, work_dir, a.dry_run, budget)
        results["sections"][name] = res
        print(f"[gpu_check] {name}: " + (f"ERROR {res['error'][:300]}" if "error" in res
                                          else f"done in {res.get('seconds', 0):.1f} s"), flush=True)
        (out_dir / "gpu_check.json").write_text(json.dumps(results, indent=1, default=str))
    try:
        results["summary"] = table.summarize(results["sections"])
    except Exception as e:
        results["summary"] = {"ok": False, "error": f"{type(e).__name__}: {e}"}
    results["ok"] = results["summary"]["ok"]
    results["total_s"] = time.perf_counter() - start
    (out_dir / "gpu_check.json").write_text(json.dumps(results, indent=1, default=str))
    try:
        text = table.render(results)
    except Exception as e:  # the table must come out whatever a section returned
        text = f"table failed ({type(e).__name__}: {e}); the results:\n" + json.dumps(results, indent=1, default=str)
    print(text, flush=True)
    return 0 if results["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
