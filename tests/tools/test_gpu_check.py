"""tools/gpu_check.sh end to end on the CPU with --dry-run: every section runs in its own
process (the Pallas kernels in GPU interpret mode, tiny shapes; cuDNN attention reported
as not run on a CPU), the kernel checks pass, the three olmo_jax training runs go through
the trainer's plan and their losses agree, the torch sections run in .venv-oracle
(transformers' OLMoE trains; OLMo-core's MoE model is built and says exactly why it
cannot train there), the JSON is written and the table printed last. Carried wheels
(.whl/, here a tiny pure-Python one in a temporary folder) are installed without an index
into the site folder the check then runs with. On a GPU the same script runs full sizes.
`make test` runs this file in both venvs: the dry run only in the jax 0.11.2 one (the GPU
image's jax, which the script meets there), the torch-only checks only in the other."""


import importlib.metadata
import json
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.image  # the jax 0.11.2 stage runs it (Makefile J11_TESTS)

ROOT = Path(__file__).resolve().parents[2]
ORACLE = ROOT / ".venv-oracle" / "bin" / "python"
if not ORACLE.exists():  # a worktree without its own venvs: the main checkout's
    ORACLE = Path("/work/main/.venv-oracle/bin/python")
needs_oracle = pytest.mark.skipif(not ORACLE.exists(), reason="no .venv-oracle (make oracle)")
IMAGE_JAX = importlib.metadata.version("jax").startswith("0.11.")  # the lent GPU image's jax
on_image_jax = pytest.mark.skipif(not IMAGE_JAX, reason="the dry run runs in make test's jax 0.11.2 "
                                  "stage (the GPU image's jax): .venv-jax011/bin/python -m pytest")
not_on_image_jax = pytest.mark.skipif(IMAGE_JAX, reason="checks .venv-oracle only: run in the main venv")

# Distributions on the lent H200 image that OLMo-core's import reaches (the device docs'
# package list), and setuptools' vendored ones (jaraco, backports, more-itertools).
IMAGE_TORCH = {
    "torch", "numpy", "requests", "urllib3", "certifi", "idna", "charset-normalizer", "rich",
    "pygments", "markdown-it-py", "mdurl", "pyyaml", "filelock", "packaging", "typing-extensions",
    "huggingface-hub", "hf-xet", "httpx", "httpcore", "h11", "anyio", "fsspec", "tqdm", "protobuf",
    "python-dateutil", "six", "pandas", "click", "setuptools", "sympy", "mpmath", "networkx",
    "jinja2", "markupsafe", "triton", "typer", "shellingham", "safetensors", "transformers",
    "tokenizers", "regex", "jaraco-context", "jaraco-functools", "jaraco-text", "backports-tarfile",
    "more-itertools", "pytz", "tzdata", "sniffio", "annotated-doc", "typing-inspection",
}


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


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


@needs_oracle
@on_image_jax
def test_gpu_check_dry_run(tmp_path):
    out, site = tmp_path / "out", tmp_path / "site"
    wheels = _pure_python_wheel(tmp_path / "whl").parent
    env = dict(os.environ, GPU_CHECK_PYTHON=sys.executable, GPU_CHECK_TORCH_PYTHON=str(ORACLE),
               XLA_FLAGS="", GPU_CHECK_WHEELS=str(wheels), GPU_CHECK_SITE=str(site))
    proc = subprocess.run([str(ROOT / "tools" / "gpu_check.sh"), str(out), "--dry-run"],
                          env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-3000:]
    assert f"installing carried wheels into {site}: olmo_jax_probe-1.0-py3-none-any.whl" in proc.stdout
    assert re.search(r"traffic: working tree \d+ bytes, of which carried wheels \d+ bytes", proc.stdout)
    assert (site / "olmo_jax_probe.py").read_text() == "CARRIED = True\n"
    results = json.loads((out / "gpu_check.json").read_text())
    s = results["sections"]
    assert list(s) == ["ceilings", "gmm", "attention", "mxfp8", "train_pallas", "train_ragged_dot",
                       "train_einsum", "hf", "olmo_core"]
    assert results["ok"]
    for name in ("ceilings", "gmm", "attention", "mxfp8", "train_pallas", "train_ragged_dot", "train_einsum", "hf"):
        assert "error" not in s[name], (name, s[name].get("error"))
    gmm = s["gmm"]["result"]
    products = [c["name"].split(":")[0] for c in gmm["checks"]]
    assert products == (["gmm forward"] * 2 + ["gmm dgrad"] * 2 + ["gmm wgrad"] * 2
                        + ["gmm forward, sender-major slots", "gmm wgrad, sender-major slots"])
    for name in ("gmm", "attention", "mxfp8"):
        assert all(c["ok"] for c in s[name]["result"]["checks"]), s[name]["result"]["checks"]
    assert "the target is cpu" in s["attention"]["result"]["cudnn"]["not_run"]
    runs = [s[n]["result"] for n in ("train_pallas", "train_ragged_dot", "train_einsum")]
    assert [r["resolved_gmm_impl"] for r in runs] == ["pallas", "ragged_dot", "einsum"]
    assert all(r["mesh"] == {"pipe": 1, "data": 1, "context": 1, "expert": 1} and r["tokens_per_s"] > 0
               for r in runs)
    assert results["summary"]["losses"]["ok"]
    hf = s["hf"]["result"]
    assert hf["tokens_per_s"] > 0 and len(hf["losses"]) == 2
    assert "vs_hf" in results["summary"]["ratios"]
    oc = s["olmo_core"]
    assert "tokens_per_s" in oc.get("result", {}) or ("transformer_engine" in oc["error"] or "CUDA" in oc["error"])
    tail = proc.stdout.strip().splitlines()
    assert tail[-1].startswith("overall") and "OK" in tail[-1]
    assert (out / "gpu_check.log").read_text().strip().endswith(tail[-1])


@needs_oracle
@not_on_image_jax
def test_olmo_core_imports_need_only_the_image_and_the_carried_wheels():
    pins = (ROOT / "tools" / "requirements" / "gpu_wheels_torch.txt").read_text().splitlines()
    carried = {_norm(line.split("==")[0]) for line in pins if line.strip() and not line.startswith("#")}
    probe = ("import sys, json, importlib.metadata as md\n"
             "import olmo_core.nn.transformer, olmo_core.nn.ddp.model, olmo_core.nn.moe.v2.router\n"
             "owners = md.packages_distributions()\n"
             "tops = {m.split('.')[0] for m in sys.modules}\n"
             "print(json.dumps(sorted({d for m in tops for d in owners.get(m, [])})))\n")
    proc = subprocess.run([str(ORACLE), "-c", probe], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    used = {_norm(d) for d in json.loads(proc.stdout.strip().splitlines()[-1])}
    assert "ai2-olmo-core" in used
    missing = used - IMAGE_TORCH - carried
    assert not missing, f"add to tools/requirements/gpu_wheels_torch.txt (OLMo-core imports them): {sorted(missing)}"



def test_gpu_check_refuses_a_cpu_without_dry_run(tmp_path):
    proc = subprocess.run([str(ROOT / "tools" / "gpu_check.sh"), str(tmp_path)],
                          env=dict(os.environ, GPU_CHECK_PYTHON=sys.executable, XLA_FLAGS="",
                                   GPU_CHECK_WHEELS=str(tmp_path / "none")),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "--dry-run" in proc.stdout


def test_the_loss_check_and_ratios_catch_what_they_should():
    sys.path.insert(0, str(ROOT / "tools" / "gpu_check"))
    import table

    def run(losses, tok_s=100.0, mfu=0.5, impl="pallas"):
        return {"result": {"losses": losses, "tokens_per_s": tok_s, "mfu": mfu, "gmm_impl": impl, "step_ms": 1.0,
                           "resolved_gmm_impl": impl, "compile_s": 1.0}}

    base = [11.5, 11.4, 11.2]
    agree = {"train_pallas": run(base), "train_ragged_dot": run([11.5, 11.41, 11.25], impl="ragged_dot"),
             "train_einsum": run([11.5001, 11.39, 11.21], impl="einsum"),
             "hf": {"result": {"tokens_per_s": 50.0, "step_ms": 2.0, "losses": base}},
             "olmo_core": {"error": "no transformer_engine"}}
    s = table.summarize(agree)
    assert s["ok"] and s["losses"]["ok"] and s["ratios"] == {"vs_hf": 2.0}
    assert s["goals_met"] == {"mfu": True, "vs_hf": True}
    first_off = dict(agree, train_einsum=run([11.7, 11.4, 11.2], impl="einsum"))  # 1.7e-2 at step 1
    assert not table.summarize(first_off)["losses"]["ok"]
    curve_off = dict(agree, train_ragged_dot=run([11.5, 11.4, 11.6], impl="ragged_dot"))  # 3.6e-2 later
    assert not table.summarize(curve_off)["ok"]
    missing = dict(agree, train_einsum={"error": "timed out after its budget of 70 s"})
    summary = table.summarize(missing)
    assert not summary["ok"] and "did not finish" in summary["losses"]["why"]
    text = table.render({"dry_run": False, "sections": missing, "summary": summary, "total_s": 1.0})
    assert "timed out after its budget" in text and text.splitlines()[-1].startswith("overall      FAILED")
