"""Ring attention vs all-gather KV for context parallelism, measured on the compiled
programs (olmo_jax/kernels/ring_attention.py): one attention layer's forward and backward
over a `context` axis of fake CPU devices, per device: the collectives' bytes (from the
HLO, olmo_jax.planner.comms, at the program's dtypes: XLA:CPU widens bf16
collectives to f32), and XLA's temporary buffers (memory_analysis: the peak
working set beyond arguments and outputs).

    .venv/bin/python tools/bench/bench_context.py [--seq 16384 --context 4 8 --heads 8 ...]
    .venv-gpu/bin/python tools/bench/bench_context.py --target h200   # deviceless XLA:GPU
    .venv-gpu/bin/python tools/bench/bench_context.py --target h200 --blocks cudnn

Nothing runs: the numbers are the compiler's (each compiler's: XLA:CPU and XLA:GPU differ
in what they widen and merge, so quote the --target ones for GPUs).
With --target (a GPU kind of olmo_jax.targets) the layer is compiled by XLA:GPU for
abstract GPUs and its schedule replayed (olmo_jax.planner.overlap): how much of each
collective's link time the latency-hiding scheduler hides behind the attention's matmuls.
--blocks cudnn (with --target): the ring's blocks on cuDNN's fused attention
(olmo_jax/kernels/ring_blocks.py) instead of XLA's einsums; the all-gather is unchanged.
"""

from __future__ import annotations

import argparse
import os

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec  # noqa: E402

from olmo_jax.kernels.ring_attention import CONTEXT_ATTENTIONS, context_attention  # noqa: E402
from olmo_jax.planner import comms  # noqa: E402


def compile_layer(impl: str, C: int, T: int, B: int, N: int, K: int, H: int, segments: bool,
                  dtype=jnp.bfloat16, target: str | None = None, blocks: str = "xla"):
    """The compiled forward + backward of one context-parallel attention call."""
    import contextlib

    scope = contextlib.nullcontext()
    if target:
        from olmo_jax import targets
        from olmo_jax.kernels import platform

        mesh = targets.make_mesh(target, (C,), ("context",))
        scope = platform.targeting(platform.target_of(mesh))  # cuDNN's capability checks
    else:
        mesh = Mesh(np.asarray(jax.devices()[:C]), ("context",))
    spec = PartitionSpec(None, "context")

    def local(q, k, v, seg, do):
        def f(q, k, v):
            return context_attention(impl, q, k, v, seg if segments else None, context=C,
                                     blocks=blocks)
        o, vjp = jax.vjp(f, q, k, v)
        return o, vjp(do)

    fn = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(spec,) * 5,
                               out_specs=(spec, (spec,) * 3)))
    sh = NamedSharding(mesh, spec)
    args = [jax.ShapeDtypeStruct(s, d, sharding=sh) for s, d in (
        ((B, T, N, H), dtype), ((B, T, K, H), dtype), ((B, T, K, H), dtype),
        ((B, T), jnp.int32), ((B, T, N, H), dtype))]
    with scope:
        return fn.lower(*args).compile()


def measure(impl, C, T, B, N, K, H, segments=True, target=None, blocks="xla") -> dict:
    compiled = compile_layer(impl, C, T, B, N, K, H, segments, target=target, blocks=blocks)
    colls = comms.collectives(compiled.as_text())
    mem = compiled.memory_analysis()
    by_kind: dict[str, int] = {}
    for c in colls:
        by_kind[c.kind] = by_kind.get(c.kind, 0) + int(c.jax_bytes_per_run)  # at the program dtype
    out = {"impl": impl, "context": C, "bytes": sum(by_kind.values()), "by_kind": by_kind,
           "temp": int(mem.temp_size_in_bytes)}
    if target:
        from olmo_jax.planner import hardware, hlo, hlo_cost, overlap, roofline

        module = hlo.parse_module(compiled.as_text())
        ops = hlo_cost.program_cost(module).ops
        s = overlap.simulate(module, ops, hardware.DEVICES[target], "bfloat16", {"context": C},
                             roofline.Accounting.for_program(True, True))
        out["schedule"] = {"step_us": s.step_s * 1e6, "compute_us": s.compute_s * 1e6,
                           "link_us": s.link_s * 1e6, "hidden_us": sum(r.hidden_s for r in s.rows) * 1e6,
                           "async": sum(r.async_runs for r in s.rows),
                           "runs": sum(r.runs for r in s.rows)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=16384)
    ap.add_argument("--context", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--target", default=None, help="a GPU kind (olmo_jax.targets): XLA:GPU")
    ap.add_argument("--blocks", default="xla", choices=["xla", "cudnn"],
                    help="the ring's blocks (cudnn: with --target)")
    ap.add_argument("--impl", nargs="+", default=list(CONTEXT_ATTENTIONS))
    a = ap.parse_args()
    print(f"seq {a.seq}, batch {a.batch}, heads {a.heads}/{a.kv_heads} x {a.head_dim}, bf16, "
          f"document segments on, ring blocks {a.blocks}; per device, forward + backward of "
          "one layer")
    print(f"{'impl':10s} {'context':>7s} {'coll MiB':>9s} {'temp MiB':>9s}  collectives (MiB)")
    for C in a.context:
        for impl in a.impl:
            m = measure(impl, C, a.seq, a.batch, a.heads, a.kv_heads, a.head_dim, target=a.target,
                        blocks=a.blocks)
            kinds = ", ".join(f"{k} {v / 2**20:.1f}" for k, v in sorted(m["by_kind"].items()))
            print(f"{impl:10s} {C:7d} {m['bytes'] / 2**20:9.1f} {m['temp'] / 2**20:9.1f}  {kinds}")
            if "schedule" in m:
                sc = m["schedule"]
                print(f"{'':18s} schedule: step {sc['step_us']:.0f} us, compute {sc['compute_us']:.0f}"
                      f" us, links {sc['link_us']:.0f} us of which hidden {sc['hidden_us']:.0f} us;"
                      f" {sc['async']:.0f} of {sc['runs']:.0f} collective runs async")


if __name__ == "__main__":
    main()
