"""The StableHLO of the tiny config's train step, lowered ahead of time exactly as the
trainer builds it (trainer/loop.py's `_build` of the validated config, in a temporary
run_dir; nothing trains), on two meshes:

    single  1 CPU device (parallel.data=1, parallel.expert=1)
    de      data 2 x expert 4 on 8 fake CPU devices

    python tools/testing/dump_step_stablehlo.py OUT_DIR [--config configs/tiny.py]

writes OUT_DIR/<mesh>.stablehlo.mlir (`lowered.as_text()`) and prints each file's sha256.
A refactor that must not change behaviour leaves both hashes as they were. Each mesh is
lowered in its own process, since the number of fake devices is fixed when JAX starts.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import runpy
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MESHES = {  # name: (fake CPU devices, parallel.data, parallel.expert)
    "single": (1, 1, 1),
    "de": (8, 2, 4),
}


def lower_text(config_path: str, data: int, expert: int) -> str:
    """The lowered train step's StableHLO for the config at `config_path` on a
    data x expert mesh (in this process's devices)."""
    import jax
    import numpy as np
    from rich.console import Console

    from olmo_jax import config
    from olmo_jax.trainer import loop

    cfg = runpy.run_path(config_path)["get_config"]()
    cfg.parallel.data, cfg.parallel.expert, cfg.parallel.pipe = data, expert, 1
    with tempfile.TemporaryDirectory() as tmp:
        cfg.trainer.run_dir = str(Path(tmp) / "run")
        run = loop._build(config.validate(cfg), Console(quiet=True), main=True)
        try:
            t = run.t
            batch_spec = jax.ShapeDtypeStruct(
                run.plan.batch_shape(t.global_batch_size, t.seq_len), np.int32,
                sharding=run.plan.batch_sharding())
            lowered = run.step_fn.lower(loop._with_shardings(run.abstract, run.shardings),
                                        batch_spec)
            return lowered.as_text()
        finally:
            run.checkpoints.close()


def _child(args) -> None:
    import olmo_jax

    assert Path(olmo_jax.__file__).resolve().parent == REPO / "olmo_jax", olmo_jax.__file__
    _, data, expert = MESHES[args.mesh]
    text = lower_text(args.config, data, expert)
    out = Path(args.out) / f"{args.mesh}.stablehlo.mlir"
    out.write_text(text)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", help="folder for <mesh>.stablehlo.mlir")
    ap.add_argument("--config", default=str(REPO / "configs" / "tiny.py"))
    ap.add_argument("--mesh", choices=sorted(MESHES), help=argparse.SUPPRESS)  # child process
    args = ap.parse_args()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    if args.mesh:
        _child(args)
        return
    for name, (devices, _, _) in MESHES.items():
        env = dict(os.environ, JAX_PLATFORMS="cpu",  # olmo_jax from this checkout
                   XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
                   PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
        subprocess.run([sys.executable, __file__, args.out, "--config", args.config,
                        "--mesh", name], env=env, check=True, cwd=REPO)
        path = Path(args.out) / f"{name}.stablehlo.mlir"
        print(f"{hashlib.sha256(path.read_bytes()).hexdigest()}  {name}  {path}")


if __name__ == "__main__":
    main()
