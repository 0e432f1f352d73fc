"""`python -m olmo_jax.planner.command IN OUT`: the GPU compile venv's worker
(planner/xla_gpu.py's `run_in_gpu_venv` starts it). It runs the planner's API,
`api.plan_config`, on the pickled config IN, compiling on XLA:GPU, and writes the
rendered plan and its JSON (or the config's error) to OUT.
"""

from __future__ import annotations

import json
import os
import pickle
import sys
from pathlib import Path

from olmo_jax.errors import ConfigError, DataError
from olmo_jax.planner import xla_gpu
from olmo_jax.planner.api import plan_config


def _worker(src: str, dst: str) -> int:
    os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")

    args = pickle.loads(Path(src).read_bytes())
    if not xla_gpu.has_cuda_plugin():
        print(f"{sys.executable} has no jax CUDA plugin", file=sys.stderr)
        return 1
    try:
        out = plan_config(args["cfg"], args["n_devices"], args["kind"], compare=args["compare"],
                          compiler="xla_gpu", config_path=args["config_path"])
    except (ConfigError, DataError) as e:
        out = {"error": str(e), "kind": type(e).__name__}
    Path(dst).write_text(json.dumps(out, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(_worker(*sys.argv[1:]))
