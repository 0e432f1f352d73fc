"""Where a CPU train step's time goes: the trainer's compiled step of a config (default
configs/bench_cpu.py, the tools/bench/bench_vs_torch.py shape) run under `jax.profiler.trace`,
XLA:CPU's per-operation timings summed by model scope (attention, routed experts, ...,
olmo_jax.planner.hlo_cost's scopes) and by kind of operation (GEMM: a dot, a fusion
holding one, or a CPU FFI kernel whose work is GEMMs (the experts, the attention core);
element-wise / reduce fusion, or the element-wise FFI kernels (norms, QK-norm + RoPE);
transpose / copy; gather / scatter / dynamic slice; loop and other plumbing), as shares of
the step's traced operation time.

    .venv/bin/python tools/bench/profile_step.py [--config configs/bench_cpu.py] [--steps 3]

Prints a Markdown table (the one kept in docs/performance.md) and the top operations.
"""

from __future__ import annotations

import argparse
import collections
import glob
import runpy
import sys
import tempfile
from pathlib import Path

import jax
from jax.profiler import ProfileData

from olmo_jax import host_memory
from olmo_jax.planner import gpu_hlo, hlo, hlo_cost

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_vs_torch import benchmark_step  # noqa: E402  (the benchmark's own step and batch)

ROOT = Path(__file__).resolve().parents[2]
CONTAINERS = {"while", "conditional", "call"}  # their bodies' operations are traced too
MOVES = {"transpose", "copy", "concatenate", "pad", "slice", "reshape", "broadcast", "reverse"}
INDEXING = {"gather", "scatter", "dynamic-slice", "dynamic-update-slice", "sort", "iota"}


def kind_of(module: hlo.HloModule, walker: hlo_cost.Walker, ins) -> str:
    ops = {ins.opcode}
    if ins.opcode == "fusion" and (callee := ins.attr("calls")):
        ops = {i.opcode for i in walker.comp[callee.lstrip("%")]}
    if ins.opcode == "custom-call":  # the CPU FFI kernels: GEMMs, or element-wise ones
        gemm = gpu_hlo.call_target(ins) in (*gpu_hlo.CPU_SWIGLU, *gpu_hlo.CPU_ATTENTION)
        return "GEMM" if gemm else "element-wise / reduce"
    if ops & {"dot", "convolution"}:
        return "GEMM"
    if ops & INDEXING:
        return "gather / scatter / dynamic slice"
    if ops - {"parameter", "bitcast", "constant", "tuple", "get-tuple-element"} <= MOVES:
        return "transpose / copy / concat"
    if ops & (hlo_cost.ELEMENTWISE | {"reduce", "reduce-window", "select", "exponential"}):
        return "element-wise / reduce"
    return "other"


def step_runner(cfg):
    _, step, state, batch = benchmark_step(cfg)
    compiled = step.lower(state, batch).compile()
    holder = {"state": state}

    def run():
        holder["state"], m = compiled(holder["state"], batch)
        return m

    return compiled, run


def profile(cfg, steps: int):
    compiled, run = step_runner(cfg)
    module = hlo.parse_module(compiled)
    walker = hlo_cost.Walker(module)
    for _ in range(2):
        jax.block_until_ready(run())
    d = tempfile.mkdtemp(prefix="profile_step_")
    with jax.profiler.trace(d):
        for _ in range(steps):
            jax.block_until_ready(run())
    data = ProfileData.from_file(glob.glob(f"{d}/**/*.xplane.pb", recursive=True)[0])
    per_op = collections.Counter()
    for plane in data.planes:
        for line in plane.lines:
            for ev in line.events:
                stats = dict(ev.stats)
                if "hlo_op" in stats and "jit_" in str(stats.get("hlo_module", "")):
                    per_op[stats["hlo_op"]] += ev.duration_ns / steps
    table = collections.Counter()
    unknown = 0.0
    for name, ns in per_op.items():
        ins = module.by_name.get(name)
        if ins is None:
            unknown += ns
            continue
        if ins.opcode in CONTAINERS:
            continue
        table[(walker.scope(ins), kind_of(module, walker, ins))] += ns
    return table, per_op, unknown, module, walker


def markdown(table, unknown) -> str:
    total = sum(table.values()) + unknown
    scopes = sorted({s for s, _ in table}, key=lambda s: -sum(v for (a, _), v in table.items() if a == s))
    kinds = sorted({k for _, k in table}, key=lambda k: -sum(v for (_, b), v in table.items() if b == k))
    out = ["| scope | " + " | ".join(kinds) + " | all |", "|---|" + "---:|" * (len(kinds) + 1)]
    for s in scopes:
        cells = [table.get((s, k), 0.0) / total for k in kinds]
        out.append(f"| {s} | " + " | ".join(f"{c:.1%}" if c else "" for c in cells)
                   + f" | {sum(cells):.1%} |")
    col = [sum(table.get((s, k), 0.0) for s in scopes) / total for k in kinds]
    out.append("| all | " + " | ".join(f"{c:.1%}" for c in col) + f" | {sum(col):.1%} |")
    out.append(f"\ntraced operation time {total / 1e6:.1f} ms per step"
               + (f" ({unknown / total:.1%} in operations not in the module)" if unknown else ""))
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=str(ROOT / "configs/bench_cpu.py"))
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--top", type=int, default=12)
    args = ap.parse_args()
    cfg = runpy.run_path(args.config)["get_config"]()
    host_memory.configure(cfg.trainer.host_malloc)  # as the trainer does, before JAX starts
    table, per_op, unknown, module, walker = profile(cfg, args.steps)
    print(markdown(table, unknown))
    print("\ntop operations (ms per step, summed over threads):", file=sys.stderr)
    top = [(n, ns) for n, ns in per_op.most_common() if n in module.by_name
           and module.by_name[n].opcode not in CONTAINERS][:args.top]
    for name, ns in top:
        ins = module.by_name[name]
        print(f"  {ns / 1e6:8.2f}  {name:28s} {walker.scope(ins):16s} "
              f"{kind_of(module, walker, ins):20s} {ins.type_str[:40]:40s} "
              f"{walker.origin(ins)[-90:]}", file=sys.stderr)


if __name__ == "__main__":
    main()
