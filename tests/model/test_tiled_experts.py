"""The tiled per-expert GEMM loop (olmo_jax/model/moe/tiled.py) on its own: routings the
MoE-layer tests do not reach (empty experts, one row, runs of several full tiles, rows
outside every run) against a loop-over-experts reference, forward and gradients, float32."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from olmo_jax.model.moe import dispatch, sizing, tiled

D, F = 16, 24


def _reference(x_PD, sizes_E, w_gate, w_up, w_down, multiple):
    """Expert e's rows [start, start + size) through its SwiGLU; every other row zero."""
    y = jnp.zeros_like(x_PD)
    start = 0
    for e, n in enumerate(sizes_E):
        rows = x_PD[start:start + n]
        h = jax.nn.silu(rows @ w_gate[e]) * (rows @ w_up[e])
        y = y.at[start:start + n].set(h @ w_down[e])
        start += -(-n // multiple) * multiple
    return y


@pytest.mark.parametrize("sizes_E", [[0, 1, 77, 0, 8], [130, 3, 0, 64, 17], [0, 0, 0, 0, 0]])
def test_tiled_ffn_matches_per_expert_reference(sizes_E):
    E, m, tiles = len(sizes_E), 8, (32, 16, 8)  # small tiles: full-tile loops and remainders
    P = sizing.padded_rows(sum(sizes_E), E, m) + 16  # buffer larger than the runs
    ks = jax.random.split(jax.random.key(1), 5)
    x = jax.random.normal(ks[0], (P, D))
    w = (jax.random.normal(ks[1], (E, D, F)) * 0.15, jax.random.normal(ks[2], (E, D, F)) * 0.15,
         jax.random.normal(ks[3], (E, F, D)) * 0.15)
    ct = jax.random.normal(ks[4], (P, D))
    # zero the padding rows, as dispatch does, so the reference's outputs there are zero too
    keep = np.zeros(P, bool)
    start = 0
    for n in sizes_E:
        keep[start:start + n] = True
        start += -(-n // m) * m
    x = jnp.where(keep[:, None], x, 0.0)
    gs = jnp.asarray(sizes_E, jnp.int32)

    def loss(fn):
        return lambda x, w: jnp.sum(jnp.sin(fn(x, w)) * ct)

    fast = loss(lambda x, w: tiled.ffn_tiled(x, gs, *w, sizes=tiles))
    ref = loss(lambda x, w: _reference(x, sizes_E, *w, m))
    (v, (gx, gw)), (v_ref, (gx_ref, gw_ref)) = (  # jitted: one compile, not one per eager op
        jax.jit(jax.value_and_grad(f, argnums=(0, 1)))(x, w) for f in (fast, ref))
    np.testing.assert_allclose(v, v_ref, atol=1e-4, rtol=1e-6)
    np.testing.assert_allclose(tiled.ffn_tiled(x, gs, *w, sizes=tiles),
                               jax.jit(lambda x, w: _reference(x, sizes_E, *w, m))(x, w),
                               atol=1e-5, rtol=0)
    np.testing.assert_allclose(gx, gx_ref, atol=1e-5, rtol=0)
    for a, b in zip(gw, gw_ref, strict=True):  # sums over up to 130 rows: relative too
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)


def test_padded_plan_runs_start_on_multiples_and_pad_at_most_seven_rows():
    idx = jax.random.randint(jax.random.key(0), (50, 2), 0, 6)
    plan = dispatch.padded_plan(idx, 6, 8)
    starts, padded = tiled.padded_runs(plan.group_sizes_E, 8)
    assert int(jnp.sum(plan.group_sizes_E)) == 100
    assert np.all(np.asarray(padded) - np.asarray(plan.group_sizes_E) < 8)
    assert np.all(np.asarray(starts) % 8 == 0)
    row = np.asarray(plan.row_Sk)
    e = np.asarray(idx)
    assert np.all(row >= np.asarray(starts)[e]) and np.all(
        row < np.asarray(starts)[e] + np.asarray(plan.group_sizes_E)[e])
    assert len(set(row.ravel())) == row.size and row.max() < plan.n_rows


def test_tile_sizes_are_powers_of_two_down_to_the_multiple():
    assert tiled.tile_sizes(64, 8) == (64, 32, 16, 8)
    with pytest.raises(ValueError, match="powers of two"):
        tiled.tile_sizes(48, 8)
