"""The Pallas grouped matmul against jax.lax.ragged_dot and the jnp reference.

The kernels run in Pallas' GPU interpret mode (wgmma executed as a matmul, TMA copies as
copies; out-of-bounds reads raise and uninitialized memory reads NaN, so a wrong tile
index, mask or store fails). Sizes are random and include empty groups, groups that are
not multiples of the row tile, groups that start and end inside one tile, and rows past
sum(group_sizes). Tolerance: the kernel rounds its float32 accumulator to bfloat16 once,
so |kernel - ref_f32| <= 2^-8 |ref_f32| + 1e-6 (half a bf16 ulp, plus slack for
accumulation order); NaN never passes (assert_allclose treats it as a mismatch).
Separately, each kernel is lowered for CUDA on this CPU host, which runs the whole
Pallas -> Mosaic GPU lowering (layout inference, transforms, primitive support).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from olmo_jax.kernels import grouped_matmul as gm
from olmo_jax.kernels import platform

CFG = gm.TileConfig(block_m=64, block_n=32, block_k=32, max_concurrent_steps=2, num_programs=3)


def _sizes(rng, n_groups, n_rows, fill):
    """Random group sizes summing to about fill * n_rows, with zeros among them."""
    cuts = np.sort(rng.integers(0, int(fill * n_rows) + 1, n_groups - 1))
    sizes = np.diff(np.concatenate([[0], cuts, [int(fill * n_rows)]]))
    sizes[rng.integers(0, n_groups)] = 0
    return jnp.asarray(sizes, jnp.int32)


def _close(got, want):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    np.testing.assert_allclose(got, want, rtol=2.0**-8, atol=1e-6)


@pytest.mark.parametrize("G,M,bm", [(1, 37, 8), (5, 200, 64), (8, 130, 16)])
def test_tile_schedule_covers_every_row_once(G, M, bm):
    rng = np.random.default_rng(G)
    schedule = jax.jit(gm.tile_schedule, static_argnums=(1, 2))
    for trial in range(12):
        gs = _sizes(rng, G, M, fill=float(rng.choice([1.0, 0.7])))
        s = jax.tree.map(np.asarray, schedule(gs, M, bm))
        assert s.group_T.shape == (gm.num_row_tiles(M, G, bm),)
        ends = np.cumsum(np.asarray(gs))
        owner = np.full(M, G)  # rows past the total belong to the tail "group" G
        for g in range(G):
            owner[ends[g] - gs[g]:ends[g]] = g
        covered = np.zeros(M, int)
        for g, b, lo, hi in zip(s.group_T, s.block_T, s.lo_T, s.hi_T, strict=True):
            if lo == hi:
                continue
            assert b * bm <= lo < hi <= (b + 1) * bm, (trial, b, lo, hi)
            assert (owner[lo:hi] == g).all(), (trial, g, lo, hi)
            covered[lo:hi] += 1
        assert (covered == 1).all(), trial


@pytest.fixture(scope="module")
def operands():
    """136 rows, 4 groups, one empty, 126 rows routed (a tail of 10 zero rows), K = 64
    (two K steps), N = 64 (two column blocks); the cotangent is bf16-representable so the
    only rounding left is the kernels' output cast."""
    rng = np.random.default_rng(1)
    M, K, N, G = 136, 64, 64, 4
    keys = jax.random.split(jax.random.key(1), 3)
    x = jax.random.normal(keys[0], (M, K), jnp.bfloat16)
    w = jax.random.normal(keys[1], (G, K, N), jnp.bfloat16)
    dy = jax.random.normal(keys[2], (M, N), jnp.bfloat16)
    gs = _sizes(rng, G, M, fill=0.93)
    assert int(jnp.sum(gs)) < M
    assert (np.asarray(gs) == 0).any() and (np.asarray(gs) % CFG.block_m != 0).any()
    return x, w, dy, gs


@pytest.mark.jax011
def test_grouped_matmul_forward_and_vjp_match_ragged_dot(operands):
    """One pass through all three kernels: y = gmm (forward), dx = gmm against w^T (input
    gradient), dw = tgmm (weight gradient), each against ragged_dot and its autodiff in
    float32; the empty group's weight gradient is exactly zero."""
    x, w, dy, gs = operands
    with platform.interpret():
        y, vjp = jax.vjp(lambda a, b: gm.grouped_matmul(a, b, gs, CFG), x, w)
        dx, dw = vjp(dy)
    f32 = jnp.float32
    y_ref, vjp_ref = jax.vjp(
        lambda a, b: jax.lax.ragged_dot(a, b, gs), x.astype(f32), w.astype(f32)
    )
    dx_ref, dw_ref = vjp_ref(dy.astype(f32))
    _close(y, y_ref)
    _close(dx, dx_ref)
    _close(dw, dw_ref)
    _close(y, gm.gmm_reference(x.astype(f32), w.astype(f32), gs))
    _close(dw, gm.tgmm_reference(x.astype(f32), dy.astype(f32), gs))
    assert not np.asarray(y[int(jnp.sum(gs)):], np.float32).any()  # the zero tail
    assert not np.asarray(dw[np.flatnonzero(np.asarray(gs) == 0)], np.float32).any()


@pytest.mark.jax011
@pytest.mark.parametrize("which", ["gmm", "gmm_t", "tgmm"])
def test_kernels_lower_for_cuda(which, operands):
    x, w, dy, gs = operands
    fns = {
        "gmm": (lambda: gm.gmm(x, w, gs, config=gm.TileConfig.for_shapes(64, 64))),
        "gmm_t": (lambda: gm.gmm(dy, w, gs, transpose_rhs=True)),
        "tgmm": (lambda: gm.tgmm(x, dy, gs)),
    }
    with platform.cross_lowering():
        text = jax.jit(fns[which]).trace().lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text


@pytest.mark.jax011
def test_unsupported_inputs_are_refused():
    x = jnp.zeros((64, 32), jnp.float32)
    w = jnp.zeros((2, 32, 64), jnp.float32)
    with pytest.raises(TypeError, match="bfloat16"):
        gm.gmm(x, w, jnp.array([32, 32]))
    with pytest.raises(RuntimeError, match="interpret"):
        gm.gmm(x.astype(jnp.bfloat16), w.astype(jnp.bfloat16), jnp.array([32, 32]))
    with pytest.raises(ValueError, match="ragged_dot"):
        gm.TileConfig.for_shapes(36, 64)
