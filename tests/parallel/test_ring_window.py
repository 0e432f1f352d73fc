"""Sliding windows under context parallelism skip the keys their window does not reach
(olmo_jax/kernels/ring_attention.py): `block_in_window` says whether a block of zig-zag
chunks holds any visible (query, key) pair, checked against every pair for every rank,
ring step and chunk; the ring's block matmuls sit inside a `lax.cond` on it, forward and
backward; the all-gather kernel's matmuls meet only the L + W - 1 keys that reach each
chunk of L queries, never all T; and with a window of 3 over context 4 (chunks of 4
tokens, so most ring steps reach nothing) both give the naive windowed attention's output
and q, k, v gradients within 1e-5, with packed documents on."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec

from olmo_jax.kernels.ring_attention import block_in_window, context_attention, zigzag_indices
from tests.parallel.harness import FAST_COMPILE, rel_err
from tests.parallel.test_context_attention import naive_segment_attention

B, T, N, K, H = 2, 32, 4, 2, 8
C, WINDOW = 4, 3
# A lax.cond with a per-device predicate inside shard_map (vma typing, pcast) and the ring's
# ppermute: run on jax 0.11.2 too.
pytestmark = pytest.mark.jax011


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


def _sharded(window, impl="ring"):
    mesh = Mesh(np.asarray(jax.devices()[:C]), ("context",))
    spec = PartitionSpec(None, "context")

    def local(q, k, v, w, seg):
        def loss(q, k, v):
            o = context_attention(impl, q, k, v, seg, context=C, window=window)
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


def _args():
    q, k, v, w, seg = _inputs()
    order = np.concatenate([zigzag_indices(T, C, r) for r in range(C)])
    return (q, k, v, w, seg), [x[:, order] for x in (q, k, v, w, seg)], np.argsort(order)


def _dot_shapes(jaxpr):
    """The operand and result shapes of every dot_general in a jaxpr and its sub-jaxprs."""
    shapes = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            shapes += [tuple(x.aval.shape) for x in (*eqn.invars, *eqn.outvars)]
        for sub in _sub_jaxprs(eqn.params):
            shapes += _dot_shapes(sub)
    return shapes


def test_the_ring_computes_its_blocks_under_a_cond():
    _, args, _ = _args()
    outside, inside = _count_dots(jax.make_jaxpr(_sharded(WINDOW))(*args).jaxpr)
    assert outside == 0 and inside > 0, (outside, inside)  # every block matmul is skippable
    outside_full, _ = _count_dots(jax.make_jaxpr(_sharded(0))(*args).jaxpr)
    assert outside_full > 0  # causal-only: zig-zag already computes only needed blocks


def test_allgather_attends_to_the_keys_the_window_reaches():
    """Each chunk of L = 4 queries meets the L + W - 1 = 6 keys that reach it, not all T."""
    _, args, _ = _args()
    L = T // (2 * C)
    windowed = _dot_shapes(jax.make_jaxpr(_sharded(WINDOW, "allgather"))(*args).jaxpr)
    assert windowed and all(T not in shape for shape in windowed), windowed
    assert any(L + WINDOW - 1 in shape for shape in windowed), windowed
    full = _dot_shapes(jax.make_jaxpr(_sharded(0, "allgather"))(*args).jaxpr)
    assert any(T in shape for shape in full), full


@pytest.mark.parametrize("impl", ["ring", "allgather"])
def test_windowed_context_attention_matches_naive(impl):
    (q, k, v, w, seg), args, inverse = _args()
    run = _sharded(WINDOW, impl)
    o, grads = run.lower(*args).compile(FAST_COMPILE)(*args)
    want_o = naive_segment_attention(q, k, v, seg, WINDOW)
    want_grads = jax.grad(
        lambda q, k, v: jnp.sum(naive_segment_attention(q, k, v, seg, WINDOW) * w),
        argnums=(0, 1, 2))(q, k, v)
    errs = [rel_err(np.asarray(o)[:, inverse], want_o)]
    errs += [rel_err(np.asarray(g)[:, inverse], x) for g, x in zip(grads, want_grads, strict=True)]
    assert all(e <= 1e-5 for e in errs), errs  # a NaN fails (max() can skip it)
    full = naive_segment_attention(q, k, v, seg, T)
    assert rel_err(np.asarray(want_o), full) > 1e-2, "the window must matter"
