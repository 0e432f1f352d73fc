"""Where the planner compiles a step: XLA:GPU for a GPU device kind wherever it can, XLA:CPU
as the labelled fallback.

XLA:GPU compiles deviceless for abstract GPUs of a kind (olmo_jax.targets) in an
interpreter whose jaxlib has the jax CUDA plugin. The project's main venv has none; its
GPU compile venv (.venv-gpu, `make gpu-venv`) has. So, for `--device-kind h100 | h200 |
b200 | b300` (`where`):
  here        this interpreter has the plugin: compile in-process on abstract GPUs;
  subprocess  a GPU compile venv exists (`$OLMO_JAX_GPU_PYTHON`, else .venv-gpu/bin/python
              of the checkout olmo_jax is imported from): run the planner there
              (`python -m olmo_jax.planner.command IN OUT`: the config pickled in, the
              rendered plan and its JSON out), with this checkout first on PYTHONPATH;
  fallback    neither: XLA:CPU on fake CPU devices, every plan saying so and why.
`--compiler=xla_cpu` asks for the XLA:CPU program; `xla_gpu` refuses to fall back.
Errors of the config (ConfigError, DataError) come back as such; any other failure of
the GPU compile is raised with the worker's last output, never replaced by a CPU plan.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import pickle
import subprocess
import tempfile
from pathlib import Path

from olmo_jax import targets

GPU_PYTHON_ENV = "OLMO_JAX_GPU_PYTHON"
COMPILERS = ("auto", "xla_gpu", "xla_cpu")
ROOT = Path(__file__).resolve().parents[2]  # the checkout olmo_jax is imported from


@dataclasses.dataclass(frozen=True)
class Where:
    how: str  # "here" | "subprocess" | "cpu"
    note: str = ""  # why XLA:CPU (the fallback), for the plan's notes
    python: str = ""  # the GPU venv's interpreter (subprocess)

    @property
    def gpu(self) -> bool:
        return self.how != "cpu"


def has_cuda_plugin() -> bool:
    try:
        return importlib.util.find_spec("jax_plugins.xla_cuda12") is not None
    except ModuleNotFoundError:  # no jax_plugins namespace at all
        return False


def gpu_python() -> Path | None:
    """The GPU compile venv's interpreter, when one exists."""
    env = os.environ.get(GPU_PYTHON_ENV)
    if env:
        return Path(env) if Path(env).exists() else None
    path = ROOT / ".venv-gpu" / "bin" / "python"
    return path if path.exists() else None


def where(kind: str, compiler: str = "auto") -> Where:
    """Where a plan for device kind `kind` compiles (module docstring)."""
    if compiler not in COMPILERS:
        raise ValueError(f"--compiler={compiler}: choose one of {', '.join(COMPILERS)}")
    if kind not in targets.KINDS:
        if compiler == "xla_gpu":
            raise ValueError(f"--compiler=xla_gpu needs a GPU --device-kind "
                             f"({', '.join(targets.KINDS)}), not {kind}")
        return Where("cpu")
    if compiler == "xla_cpu":
        return Where("cpu", "XLA:CPU program (--compiler=xla_cpu), priced for the "
                            f"{kind.upper()}: the fallback's estimate, not XLA:GPU's")
    if has_cuda_plugin():
        return Where("here")
    if (py := gpu_python()) is not None:
        return Where("subprocess", python=str(py))
    if compiler == "xla_gpu":
        raise ValueError(f"--compiler=xla_gpu: no XLA:GPU here (this jaxlib has no CUDA plugin) "
                         f"and no GPU compile venv ({ROOT / '.venv-gpu'}: `make gpu-venv`, or "
                         f"set ${GPU_PYTHON_ENV})")
    return Where("cpu", f"XLA:CPU FALLBACK: no XLA:GPU compile here (no jax CUDA plugin, no "
                        f"{ROOT / '.venv-gpu'}; `make gpu-venv`): XLA:CPU's program priced for "
                        f"the {kind.upper()}, an estimate of what XLA:GPU would compile")


def run_in_gpu_venv(python: str, cfg, n_devices: int, kind: str, compare: bool,
                    config_path: str = "") -> dict:
    """api.plan_config's {"text", "json"} for `cfg`, planned on XLA:GPU by the GPU venv's
    `python` (its worker: olmo_jax/planner/command.py)."""
    from olmo_jax.errors import ConfigError, DataError

    with tempfile.TemporaryDirectory(prefix="olmo_jax_xla_gpu_") as tmp:
        src, dst = Path(tmp) / "in.pkl", Path(tmp) / "out.json"
        src.write_bytes(pickle.dumps({"cfg": cfg, "n_devices": n_devices, "kind": kind,
                                      "compare": compare, "config_path": config_path}))
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
        env.pop("JAX_PLATFORMS", None)  # the worker's jax must see the CUDA plugin
        env.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")  # no CUDA driver needed
        proc = subprocess.run([python, "-m", "olmo_jax.planner.command", str(src), str(dst)],
                              env=env, capture_output=True, text=True, check=False)
        out = json.loads(dst.read_text()) if dst.exists() else None
    if out is not None and "error" in out:
        raise (DataError if out["kind"] == "DataError" else ConfigError)(out["error"])
    if proc.returncode != 0 or out is None:
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-15:])
        raise RuntimeError(f"the XLA:GPU plan ({python} -m olmo_jax.planner.command) failed "
                           f"with exit code {proc.returncode}:\n{tail}")
    return out
