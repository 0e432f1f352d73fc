"""CPU training speed, side by side in one run: olmo_jax vs Hugging Face transformers'
OLMoE (torch, run in .venv-oracle), the same shape (configs/bench_cpu.py), float32,
dropless, AdamW with clipping, interleaved in rounds so both see the same machine.

    .venv/bin/python tools/bench/bench_vs_torch.py [--rounds 4] [--steps 4] [--config configs/bench_cpu.py]

Prints tokens/s for both, the ratio, achieved GFLOP/s (OLMo-core's FLOPs/token formula),
and the machine's matmul ceiling measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import runpy
import statistics
import subprocess
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from olmo_jax import config as config_lib
from olmo_jax import host_memory, metrics
from olmo_jax.optim import build_optimizer
from olmo_jax.trainer.state import init_state
from olmo_jax.trainer.step import make_train_step

ROOT = Path(__file__).resolve().parents[2]


def benchmark_step(cfg):
    """(model_cfg, jitted train step with donated state, initial state, a fixed random
    batch) for config `cfg`, one device."""
    model_cfg = config_lib.model_config(cfg)
    tx, schedule = build_optimizer(cfg.optim, 1000)
    graphdef, state = init_state(model_cfg, tx, 0)
    step = jax.jit(make_train_step(graphdef, model_cfg, tx, schedule), donate_argnums=0)
    t = cfg.trainer
    batch = jnp.asarray(
        np.random.default_rng(0).integers(0, model_cfg.vocab_size, (t.global_batch_size, t.seq_len + 1)),
        jnp.int32,
    )
    return model_cfg, step, state, batch


def jax_runner(cfg):
    model_cfg, step, state, batch = benchmark_step(cfg)
    holder = {"state": state}

    def run(n):
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            holder["state"], m = step(holder["state"], batch)
            jax.block_until_ready(m)
            times.append(time.perf_counter() - t0)
        return times, float(m["loss"])

    return model_cfg, run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=str(ROOT / "configs/bench_cpu.py"))
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--steps", type=int, default=4, help="steps per side per round")
    ap.add_argument("--oracle-python", default=str(ROOT / ".venv-oracle/bin/python"))
    ap.add_argument("--torch-malloc", choices=("system", "retain"), default="system",
                    help="the torch process's glibc malloc: system (as it is run) | retain "
                         "(olmo_jax/host_memory.py's policy, via GLIBC_TUNABLES)")
    args = ap.parse_args()

    cfg = runpy.run_path(args.config)["get_config"]()
    jax_malloc = host_memory.configure(cfg.trainer.host_malloc)  # as the trainer does
    model_cfg, run_jax = jax_runner(cfg)
    t = cfg.trainer
    shape = dict(vocab_size=model_cfg.vocab_size, d_model=model_cfg.d_model,
                 expert_hidden=model_cfg.moe.expert_hidden, n_layers=model_cfg.n_layers,
                 n_heads=model_cfg.n_heads, num_experts=model_cfg.moe.num_experts,
                 top_k=model_cfg.moe.top_k, seq_len=t.seq_len, batch=t.global_batch_size)
    torch_proc = subprocess.Popen(
        [args.oracle_python, str(ROOT / "tools/testing/oracle/torch_olmoe_worker.py")],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        env=dict(os.environ, GLIBC_TUNABLES=host_memory.retain_tunables())
        if args.torch_malloc == "retain" else None,
    )
    torch_proc.stdin.write(json.dumps(shape) + "\n")
    torch_proc.stdin.flush()
    info = json.loads(torch_proc.stdout.readline())

    def run_torch(n):
        torch_proc.stdin.write(f"steps {n}\n")
        torch_proc.stdin.flush()
        r = json.loads(torch_proc.stdout.readline())
        return r["times"], r["loss"]

    run_jax(2)  # compile + warm up
    run_torch(2)
    jax_times, torch_times = [], []
    for r in range(args.rounds):
        order = (run_jax, run_torch) if r % 2 == 0 else (run_torch, run_jax)
        for fn in order:
            times, _ = fn(args.steps)
            (jax_times if fn is run_jax else torch_times).extend(times)
    torch_proc.stdin.write("quit\n")
    torch_proc.stdin.flush()
    torch_proc.wait()
    peak = metrics.measured_cpu_peak.__wrapped__()

    tokens = t.global_batch_size * t.seq_len
    flops = metrics.flops_per_token(model_cfg, t.seq_len) * tokens
    jt, tt = statistics.median(jax_times), statistics.median(torch_times)
    rows = [
        ("olmo_jax", tokens / jt, flops / jt / 1e9),
        (f"transformers OLMoE (torch {info['threads']} threads, {info['attn']})", tokens / tt, flops / tt / 1e9),
    ]
    print(f"\nshape: {shape}; {flops / tokens / 1e6:.1f} MFLOP/token; "
          f"{args.rounds} rounds x {args.steps} steps each, interleaved; medians")
    print(f"machine: dense f32 matmul ceiling {peak / 1e9:.0f} GFLOP/s (measured now, 1024^3); "
          f"host malloc (olmo_jax/host_memory.py): olmo_jax {jax_malloc}, torch {args.torch_malloc}")
    print("| implementation | tokens/s | GFLOP/s | of ceiling |")
    print("|---|---|---|---|")
    for name, tps, gf in rows:
        print(f"| {name} | {tps:,.0f} | {gf:.0f} | {gf * 1e9 / peak:.0%} |")
    print(f"\nratio olmo_jax / torch: {tt / jt:.2f}x")


if __name__ == "__main__":
    main()
