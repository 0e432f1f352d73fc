"""Compiled memory of one training step, MXFP8 against bf16, from XLA's memory analysis
(compile only: nothing is allocated or run).

    .venv/bin/python tools/experiments/mxfp8_memory.py                 # configs/tiny.py x4, one device
    .venv/bin/python tools/experiments/mxfp8_memory.py --scale 8 --json out.json

Both runs are `--config.model.dtype=bfloat16`; the MXFP8 run sets
`model.moe.precision=mxfp8` and `model.attention_precision=mxfp8`. The config is
configs/tiny.py with d_model, the hidden sizes and head_dim multiplied by --scale (the
layer count, experts and top-k unchanged). Reported: temporary bytes (activations saved
for the backward pass and other scratch: what MXFP8 residuals shrink), argument and
output bytes (parameters and optimizer state, the same in both), and the ratio.
"""

from __future__ import annotations

import argparse
import json
import runpy
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from olmo_jax import config as config_lib  # noqa: E402
from olmo_jax.model.abstract import abstract_model  # noqa: E402
from olmo_jax.optim import build_optimizer  # noqa: E402
from olmo_jax.trainer.state import TrainState  # noqa: E402
from olmo_jax.trainer.step import make_train_step  # noqa: E402


def scaled_config(config_path: str, scale: int, precision: str, batch: int, seq: int):
    cfg = runpy.run_path(config_path)["get_config"]()
    m = cfg.model
    m.dtype = "bfloat16"
    m.head_dim = (m.head_dim or m.d_model // m.n_heads) * scale
    m.dense_hidden = (m.dense_hidden or 4 * m.d_model) * scale
    m.d_model *= scale
    m.moe.expert_hidden *= scale
    m.moe.precision = precision
    m.attention_precision = precision
    cfg.trainer.global_batch_size, cfg.trainer.seq_len = batch, seq
    return cfg


def step_memory(cfg, vocab_size: int = 384) -> dict:
    """Memory analysis of the compiled train step for this config (one device)."""
    model_cfg = config_lib.model_config(cfg, vocab_size)
    graphdef, params, model_state = abstract_model(model_cfg)
    tx, schedule = build_optimizer(cfg.optim, cfg.trainer.max_steps)
    state = TrainState(
        step=jax.ShapeDtypeStruct((), jnp.int32),
        params=params,
        opt_state=jax.eval_shape(tx.init, params),
        model_state=model_state,
        rng=jax.ShapeDtypeStruct((2,), jnp.uint32),
    )
    t = cfg.trainer
    batch = jax.ShapeDtypeStruct((t.global_batch_size, t.seq_len + 1), jnp.int32)
    step = make_train_step(graphdef, model_cfg, tx, schedule, t.grad_accum)
    mem = jax.jit(step, donate_argnums=0).lower(state, batch).compile().memory_analysis()
    return {
        "temp_bytes": int(mem.temp_size_in_bytes),
        "argument_bytes": int(mem.argument_size_in_bytes),
        "output_bytes": int(mem.output_size_in_bytes),
        "d_model": model_cfg.d_model,
        "expert_hidden": model_cfg.moe.expert_hidden,
        "tokens": t.global_batch_size * t.seq_len,
    }


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--config", default=str(ROOT / "configs" / "tiny.py"))
    p.add_argument("--scale", type=int, default=4)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--json", default="")
    a = p.parse_args(argv)
    out = {}
    for precision in ("bf16", "mxfp8"):
        out[precision] = step_memory(scaled_config(a.config, a.scale, precision, a.batch, a.seq))
    out["temp_ratio_mxfp8_over_bf16"] = out["mxfp8"]["temp_bytes"] / out["bf16"]["temp_bytes"]
    b = out["bf16"]
    print(f"configs/tiny.py x{a.scale}: d_model {b['d_model']}, expert_hidden "
          f"{b['expert_hidden']}, {b['tokens']} tokens/step, backend {jax.default_backend()}")
    print(f"{'':8} {'temp MiB':>10} {'args MiB':>10} {'out MiB':>10}")
    for k in ("bf16", "mxfp8"):
        r = out[k]
        print(f"{k:8} {r['temp_bytes'] / 2**20:10.1f} {r['argument_bytes'] / 2**20:10.1f} "
              f"{r['output_bytes'] / 2**20:10.1f}")
    print(f"temp ratio mxfp8/bf16: {out['temp_ratio_mxfp8_over_bf16']:.3f}")
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    main()
