"""Sliding windows under ring attention skip the blocks their window does not reach
(olmo_jax/kernels/ring_attention.py): `block_in_window` says whether a block of zig-zag
chunks holds any visible (query, key) pair, checked against every pair for every rank,
ring step and chunk; the ring's block matmuls sit inside a `lax.cond` on it, forward and
backward; and a window of 3 over context 4 (chunks of 4 tokens, so most ring steps reach
nothing) gives the naive windowed attention's output and q, k, v gradients within 1e-5,
with packed documents on."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec

from olmo_jax.kernels.ring_attention import block_in_window, context_attention, zigzag_indices
from tests.parallel.harness import FAST_COMPILE, rel_err
from tests.parallel.test_context_attention import naive_segment_attention

B, T, N, K, H = 2, 32, 4, 2, 8
C, WINDOW = 4, 3


def test_block_in_window_is_whether_any_pair_is_visible():
    for c, L in ((2, 4), (4, 3)):
        chunks = [zigzag_indices(2 * c * L, c, r) for r in range(c)]
        halves = [x for idx in chunks for x in (idx[:L], idx[L:])]
        for window in range(1, 2 * c * L + 1):
            for q_pos, k_pos in itertools.product(halves, halves):
                d = q_pos[:, None] - k_pos[None, :]
                want = bool(np.any((d >= 0) & (d < window)))
                got = bool(block_in_window(jnp.asarray(q_pos), jnp.asarray(k_pos), window))
                assert got == want, (c, L, window, q_pos, k_pos)


def _inputs():
    rng = np.random.default_rng(3)
    q, k, v, w = (rng.normal(size=s).astype(np.float32)
                  for s in ((B, T, N, H), (B, T, K, H), (B, T, K, H), (B, T, N, H)))
    seg = np.zeros((B, T), np.int32)
    seg[0] = np.repeat(np.arange(3), [7, 14, 11])  # documents crossing the chunks
    return q, k, v, w, seg


def _sharded(window):
    mesh = Mesh(np.asarray(jax.devices()[:C]), ("context",))
    spec = PartitionSpec(None, "context")

    def local(q, k, v, w, seg):
        def loss(q, k, v):
            o = context_attention("ring", q, k, v, seg, context=C, window=window)
            return jnp.sum(o * w), o
        (_, o), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
        return o, grads

    return jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(spec,) * 5,
                                 out_specs=(spec, (spec,) * 3)))


def _sub_jaxprs(params):
    for value in params.values():
        for x in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(x, jax.extend.core.ClosedJaxpr):
                yield x.jaxpr
            elif isinstance(x, jax.extend.core.Jaxpr):
                yield x


def _count_dots(jaxpr, in_cond=False):
    """(dot_generals outside any cond, inside one) in a jaxpr and its sub-jaxprs."""
    outside = inside = 0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            if in_cond:
                inside += 1
            else:
                outside += 1
        for sub in _sub_jaxprs(eqn.params):
            o, i = _count_dots(sub, in_cond or eqn.primitive.name == "cond")
            outside, inside = outside + o, inside + i
    return outside, inside


def test_the_ring_skips_blocks_outside_the_window_and_matches_naive():
    q, k, v, w, seg = _inputs()
    order = np.concatenate([zigzag_indices(T, C, r) for r in range(C)])
    args = [x[:, order] for x in (q, k, v, w, seg)]

    outside, inside = _count_dots(jax.make_jaxpr(_sharded(WINDOW))(*args).jaxpr)
    assert outside == 0 and inside > 0, (outside, inside)  # every block matmul is skippable
    outside_full, _ = _count_dots(jax.make_jaxpr(_sharded(0))(*args).jaxpr)
    assert outside_full > 0  # causal-only: zig-zag already computes only needed blocks

    run = _sharded(WINDOW)
    o, grads = run.lower(*args).compile(FAST_COMPILE)(*args)
    inverse = np.argsort(order)
    want_o = naive_segment_attention(q, k, v, seg, WINDOW)
    want_grads = jax.grad(
        lambda q, k, v: jnp.sum(naive_segment_attention(q, k, v, seg, WINDOW) * w),
        argnums=(0, 1, 2))(q, k, v)
    errs = [rel_err(np.asarray(o)[:, inverse], want_o)]
    errs += [rel_err(np.asarray(g)[:, inverse], x) for g, x in zip(grads, want_grads, strict=True)]
    assert max(errs) <= 1e-5, errs
    full = naive_segment_attention(q, k, v, seg, T)
    assert rel_err(np.asarray(want_o), full) > 1e-2, "the window must matter"
