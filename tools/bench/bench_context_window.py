"""Sliding-window context-parallel attention against causal, run side by side on fake CPU
devices: one layer's forward + backward (olmo_jax/kernels/ring_attention.py) over a
`context` axis, ring and all-gather, timed (median of --repeats after a warm-up), with the
share of the ring's [L, L] blocks the window reaches (`block_in_window` over every rank and
ring step). A windowed ring skips the blocks its window does not reach (a `lax.cond` per
block); a windowed all-gather meets each chunk of L queries with the L + W - 1 keys that
reach it. Causal attention computes every block the zig-zag layout assigns (the ring) or
the whole [2L, T] block (the all-gather), as the windowed kernels did before they skipped
anything, so each time ratio is what the skipping saves on this machine.

    .venv/bin/python tools/bench/bench_context_window.py [--seq 8192 --context 4 --window 512]

The fake devices share this machine's cores, so only the ratio means anything.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec  # noqa: E402

from olmo_jax.kernels.ring_attention import (  # noqa: E402
    CONTEXT_ATTENTIONS,
    block_in_window,
    context_attention,
    zigzag_indices,
)


def blocks_reached(T: int, C: int, window: int) -> tuple[int, int]:
    """(blocks the window reaches, blocks the causal ring computes), over all ranks."""
    L = T // (2 * C)
    reached = total = 0
    for r in range(C):
        q = zigzag_indices(T, C, r)
        q_halves = (q[:L], q[L:])
        for j in range(C):
            k = zigzag_indices(T, C, j)
            for qh in q_halves:
                for kh in (k[:L], k[L:]):
                    if qh.max() < kh.min():  # above the diagonal: the causal ring skips it
                        continue
                    total += 1
                    reached += bool(block_in_window(jnp.asarray(qh), jnp.asarray(kh), window))
    return reached, total


def layer(impl: str, C: int, T: int, B: int, N: int, K: int, H: int, window: int):
    mesh = Mesh(np.asarray(jax.devices()[:C]), ("context",))
    spec = PartitionSpec(None, "context")

    def local(q, k, v, seg, do):
        def f(q, k, v):
            return context_attention(impl, q, k, v, seg, context=C, window=window)
        o, vjp = jax.vjp(f, q, k, v)
        return o, vjp(do)

    fn = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(spec,) * 5,
                               out_specs=(spec, (spec,) * 3)))
    sh = NamedSharding(mesh, spec)
    rng = np.random.default_rng(0)
    args = [jax.device_put(x, sh) for x in (
        rng.normal(size=(B, T, N, H)).astype(np.float32),
        rng.normal(size=(B, T, K, H)).astype(np.float32),
        rng.normal(size=(B, T, K, H)).astype(np.float32),
        np.zeros((B, T), np.int32),
        rng.normal(size=(B, T, N, H)).astype(np.float32))]
    return fn.lower(*args).compile(), args


def seconds(compiled, args, repeats: int) -> float:
    jax.block_until_ready(compiled(*args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--context", type=int, default=4)
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()
    C, T = a.context, a.seq
    reached, total = blocks_reached(T, C, a.window)
    print(f"seq {T}, context {C} (blocks of {T // (2 * C)} tokens), window {a.window}, batch "
          f"{a.batch}, heads {a.heads}/{a.kv_heads} x {a.head_dim}, float32, fwd + bwd")
    print(f"blocks the window reaches: {reached} of the causal ring's {total} "
          f"({reached / total:.1%})")
    shapes = (C, T, a.batch, a.heads, a.kv_heads, a.head_dim)
    for impl in CONTEXT_ATTENTIONS:
        causal = seconds(*layer(impl, *shapes, window=0), a.repeats)
        windowed = seconds(*layer(impl, *shapes, window=a.window), a.repeats)
        print(f"{impl:10s} causal {causal * 1e3:9.1f} ms   windowed {windowed * 1e3:9.1f} ms   "
              f"windowed / causal {windowed / causal:.2f}x")


if __name__ == "__main__":
    main()
