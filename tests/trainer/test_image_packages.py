"""Training needs only the lent GPU image's packages plus the wheels tools/gpu_check.sh
carries (tools/requirements/gpu_wheels.txt): a short `python -m olmo_jax.train --config=configs/tiny.py`
run in a child process finishes, and every module it imported belongs to the standard
library, olmo_jax, the repository's configs, or a distribution that the image's packages
(jax, jaxlib, flax, optax, orbax-checkpoint, chex, absl-py, numpy, tokenizers, tensorboard,
safetensors, PyYAML) or the carried ones require; and every carried wheel's own
requirements are on the image or carried too. `make test` runs this file in the jax
0.11.2 venv (.venv-jax011, the image's jax) as well as in .venv."""

import importlib.metadata as md
import json
import os
import re
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

pytestmark = pytest.mark.image  # the jax 0.11.2 stage runs it (Makefile J11_TESTS)

REPO = Path(__file__).resolve().parents[2]
IMAGE = ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "chex", "absl-py", "numpy",
         "tokenizers", "safetensors", "PyYAML", "tensorboard")
PINS = REPO / "tools" / "requirements" / "gpu_wheels.txt"
CARRIED = tuple(line.split("==")[0] for line in PINS.read_text().splitlines()
                if line.strip() and not line.startswith("#"))

# Runs olmo_jax.train as `python -m` would and writes the top-level modules it imported
# with their files (None: built in or made at run time, e.g. Cython's runtime modules).
CHILD = """
import atexit, json, runpy, sys
out = sys.argv[1]
def dump():
    tops = {m.split(".")[0] for m in list(sys.modules)}
    json.dump({m: getattr(sys.modules.get(m), "__file__", None) for m in tops}, open(out, "w"))
atexit.register(dump)
sys.argv = ["olmo_jax.train", *sys.argv[2:]]
runpy.run_module("olmo_jax.train", run_name="__main__", alter_sys=True)
"""


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _closure(roots) -> set[str]:
    """The distributions `roots` need at run time (requirements behind an extra left out)."""
    seen, todo = set(), [_norm(r) for r in roots]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            reqs = md.requires(name) or []
        except md.PackageNotFoundError:
            continue  # a requirement for another platform or Python
        for req in reqs:
            if "extra ==" not in req and "extra==" not in req:
                todo.append(_norm(re.split(r"[\s<>=!~;\[(]", req.strip(), maxsplit=1)[0]))
    return seen


def test_the_carried_wheels_need_nothing_else():
    on_image = _closure(IMAGE)
    missing = _closure(CARRIED) - on_image - {_norm(c) for c in CARRIED}
    assert not missing, f"add to tools/requirements/gpu_wheels.txt (the carried wheels need them): {sorted(missing)}"
    assert not {_norm(c) for c in CARRIED} & on_image, "a carried wheel the image already has"


def test_tiny_trains_with_the_gpu_images_packages(tmp_path):
    modules_path, run_dir = tmp_path / "modules.json", tmp_path / "run"
    args = [
        "--config=configs/tiny.py", "--config.trainer.max_steps=5", "--config.optim.shorten_warmup=True",
        f"--config.trainer.run_dir={run_dir}",
        "--config.trainer.log_every=1", "--config.trainer.eval_every=5", "--config.trainer.eval_batches=1",
        "--config.trainer.global_batch_size=8", "--config.trainer.seq_len=64", "--config.model.n_layers=2",
    ]
    env = dict(os.environ, XLA_FLAGS="", PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, "-c", CHILD, str(modules_path), *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    records = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5]
    assert all(0 < r["loss"] < 10 for r in records) and "eval_loss" in records[-1]

    allowed = _closure(IMAGE + CARRIED)
    owners = md.packages_distributions()
    stdlib = {sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib")}
    outside = {}
    for mod, file in json.loads(modules_path.read_text()).items():
        if (mod in sys.stdlib_module_names or file is None or mod.startswith("__editable__")
                or any((REPO / file).resolve().is_relative_to(p) for p in (REPO, *stdlib))):
            continue  # the standard library, olmo_jax and configs/, the editable install's finder
        dists = {_norm(d) for d in owners.get(mod, [])}
        if not dists & allowed:
            outside[mod] = sorted(dists) or "no distribution"
    assert not outside, f"training imported modules the GPU image lacks: {outside}"
