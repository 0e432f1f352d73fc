"""Parallel strategies side by side on 8 fake CPU devices: tokens/s and per-step
collective bytes for ddp + rowwise, ddp + allgather, ddp + ragged (on CPU through the
dense emulation of ragged_all_to_all, labelled so) and fsdp, as ratios measured in ONE
run (timings are interleaved round by round, so machine noise hits all alike).

    .venv/bin/python tools/bench/bench_parallel.py [--steps 5 --rounds 3 --d-model 128 ...]

Bytes come from each compiled step's HLO (olmo_jax.planner.comms: loop bodies x trip
counts), per device per step, and do not depend on timing. CPU tokens/s say little
about GPUs (no real interconnect; the fake devices share the same cores), which is why
the table reports ratios next to the bytes.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402
import numpy as np  # noqa: E402

from olmo_jax import config as config_lib  # noqa: E402
from olmo_jax.config import default_config, model_config  # noqa: E402
from olmo_jax.model.abstract import abstract_model  # noqa: E402
from olmo_jax.optim import build_optimizer  # noqa: E402
from olmo_jax.parallel.expert import rowwise_capacity_factor  # noqa: E402
from olmo_jax.parallel.expert.ragged_a2a import native_ragged_all_to_all_available  # noqa: E402
from olmo_jax.parallel.strategy import build_plan  # noqa: E402
from olmo_jax.planner import comms  # noqa: E402
from olmo_jax.trainer.state import init_state  # noqa: E402
from olmo_jax.trainer.step import make_train_step  # noqa: E402

KINDS = ("all-to-all", "all-gather", "reduce-scatter", "all-reduce")


def bench_config(args):
    c = default_config()
    m = c.model
    m.vocab_size, m.d_model, m.n_layers, m.n_heads = 256, args.d_model, args.layers, 4
    m.moe.num_experts, m.moe.top_k, m.moe.expert_hidden = args.experts, 2, 2 * args.d_model
    c.trainer.global_batch_size, c.trainer.seq_len = args.batch, args.seq
    c.trainer.grad_accum = args.grad_accum
    c.parallel.data, c.parallel.expert = args.data, args.expert
    return c


def variants():
    """(name, strategy, dispatch, model.moe.capacity_factor: 0 = dropless, rowwise 1.25)."""
    ragged = "ddp+ragged" + ("" if native_ragged_all_to_all_available() else " (cpu emulation)")
    return [("ddp+rowwise", "ddp", "rowwise", 0.0), ("ddp+allgather", "ddp", "allgather", 0.0),
            (ragged, "ddp", "ragged", 0.0), ("fsdp", "fsdp", "rowwise", 0.0),
            # The same expert matmul as rowwise (capacity buffers): isolates communication.
            ("fsdp (local capacity 1.25)", "fsdp", "rowwise", 1.25)]


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=5, help="timed steps per round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--data", type=int, default=2)
    ap.add_argument("--expert", type=int, default=4)
    ap.add_argument("--grad-accum", type=int, default=1,
                    help="microbatches per step (fsdp re-gathers weights for each)")
    return ap


def measure(args) -> dict:
    """Compiles every variant, times them interleaved; returns {name: result} with
    tokens_per_s, the step's collectives, compile_s, dropped (and the timing internals)."""
    cfg = bench_config(args)
    model_cfg = model_config(cfg)
    tx, schedule = build_optimizer(cfg.optim, 1000)
    _, host = init_state(model_cfg, tx, 0)
    host = jax.tree.map(np.asarray, host)
    tokens = args.batch * args.seq
    rng = np.random.default_rng(0)
    batch_np = rng.integers(0, 256, (args.batch, args.seq + 1)).astype(np.int32)

    runs = {}
    for name, strategy, dispatch, local_cf in variants():
        cfg.parallel.strategy, cfg.parallel.dispatch = strategy, dispatch
        model_cfg = model_cfg.replace(moe=dataclasses.replace(model_cfg.moe,
                                                              capacity_factor=local_cf))
        run = config_lib.parse(cfg)
        plan = build_plan(run.parallel, run.trainer, model_cfg, optim=run.optim)
        graphdef = abstract_model(model_cfg, plan.dispatcher)[0]
        shardings = plan.state_shardings(host, tx)
        step = plan.jit_train_step(
            make_train_step(graphdef, model_cfg, tx, schedule, args.grad_accum, parallel=plan),
            shardings)
        state, batch = jax.device_put(host, shardings), plan.place_batch(batch_np)
        t0 = time.perf_counter()
        compiled = step.lower(state, batch).compile()
        compile_s = time.perf_counter() - t0
        for _ in range(2):  # warm-up
            state, metrics = compiled(state, batch)
        jax.block_until_ready(metrics)
        colls = comms.collectives(compiled)
        runs[name] = {"step": compiled, "state": state, "batch": batch, "times": [],
                      "colls": colls, "compile_s": compile_s,
                      "dropped": float(metrics["dropped_frac"])}
        print(f"compiled {name} in {compile_s:.1f}s", file=sys.stderr)

    for _ in range(args.rounds):  # interleaved: every variant sees the same machine
        for r in runs.values():
            t0 = time.perf_counter()
            for _ in range(args.steps):
                r["state"], metrics = r["step"](r["state"], r["batch"])
            jax.block_until_ready(metrics)
            r["times"].append((time.perf_counter() - t0) / args.steps)
    for r in runs.values():
        r["tokens_per_s"] = tokens / statistics.median(r["times"])
    return runs


def main():
    args = parser().parse_args()
    runs = measure(args)
    cfg = bench_config(args)
    tokens = args.batch * args.seq
    base = runs["ddp+rowwise"]
    base_tps = base["tokens_per_s"]
    base_bytes = comms.total_bytes(base["colls"])
    print(f"\n{model_config(cfg).n_moe_layers} MoE layers, d_model {args.d_model}, {args.experts} "
          f"experts top-2, {tokens} tokens/step, float32, mesh data={args.data} x expert="
          f"{args.expert} (8 fake CPU devices), {args.grad_accum} microbatch(es)/step; rowwise "
          f"capacity_factor {rowwise_capacity_factor(cfg.model.moe.capacity_factor)}; median of {args.rounds} rounds x "
          f"{args.steps} steps")
    head = (f"{'variant':<30} {'tokens/s':>9} {'x rowwise':>9} {'MB/dev/step':>11} "
            f"{'x rowwise':>9}" + "".join(f" {k:>14}" for k in KINDS) + f" {'dropped':>8}")
    print(head)
    for name, r in runs.items():
        tps = r["tokens_per_s"]
        total = comms.total_bytes(r["colls"])
        per_kind = "".join(f" {comms.total_bytes(r['colls'], k) / 1e6:>14.3f}" for k in KINDS)
        print(f"{name:<30} {tps:>9.0f} {tps / base_tps:>9.2f} {total / 1e6:>11.3f} "
              f"{total / base_bytes:>9.2f}{per_kind} {r['dropped']:>8.3f}")
    print("(per-kind columns: MB per device per step; dropped: fraction of (token, choice) "
          "assignments dropped at capacity in the last warm-up step)")
    for name, r in runs.items():
        print()
        print(comms.format_table(r["colls"], f"{name}: collectives per step", 8))


if __name__ == "__main__":
    main()
