"""The routed SwiGLU as an XLA FFI call into numpy's OpenBLAS (olmo_jax/kernels/cpu_gmm.py)
on its own: routings the MoE-layer tests do not reach (empty experts, one row, a run
longer than the rest, gaps between runs, rows outside every run) against a
loop-over-experts reference, forward and gradients, float32, 1e-5; under jit and
shard_map (varying manual axes: per-device weights and replicated ones); bad input."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from olmo_jax.kernels import cpu_gmm

D, F = 16, 24


def _reference(x_RD, starts, sizes, w_gate, w_up, w_down):
    """Expert e's rows [start, start + size) through its SwiGLU; every other row zero."""
    y = jnp.zeros_like(x_RD)
    for e, (s, n) in enumerate(zip(starts, sizes, strict=True)):
        rows = x_RD[s:s + n]
        y = y.at[s:s + n].set((jax.nn.silu(rows @ w_gate[e]) * (rows @ w_up[e])) @ w_down[e])
    return y


def _weights(key, E):
    ks = jax.random.split(key, 3)
    return (jax.random.normal(ks[0], (E, D, F)) * 0.15, jax.random.normal(ks[1], (E, D, F)) * 0.15,
            jax.random.normal(ks[2], (E, F, D)) * 0.15)


def _runs(sizes, gap):
    """Starts of runs `gap` rows apart, and the buffer's rows (`gap` more at the end)."""
    starts, row = [], gap
    for n in sizes:
        starts.append(row)
        row += n + gap
    return starts, row + gap


@pytest.mark.parametrize("sizes,gap", [([0, 1, 77, 0, 8], 0),
                                       pytest.param([130, 3, 0, 64, 17], 5, marks=pytest.mark.jax011),
                                       ([0, 0, 0], 2), ([300], 0)])
def test_ffn_runs_matches_per_expert_reference(sizes, gap):
    starts, R = _runs(sizes, gap)
    kx, kw, kc = jax.random.split(jax.random.key(1), 3)
    x = jax.random.normal(kx, (R, D))  # rows outside the runs are not zero: ignored
    w = _weights(kw, len(sizes))
    ct = jax.random.normal(kc, (R, D))
    st, gs = jnp.asarray(starts, jnp.int32), jnp.asarray(sizes, jnp.int32)

    def loss(fn):
        return lambda x, w: jnp.sum(jnp.sin(fn(x, w)) * ct)

    fast = jax.jit(jax.value_and_grad(loss(lambda x, w: cpu_gmm.ffn_runs(x, st, gs, *w)), (0, 1)))
    # The reference jitted too: one program, not one compile per eager op and shape.
    reference = jax.jit(lambda x, w: _reference(x, starts, sizes, *w))
    ref = jax.jit(jax.value_and_grad(loss(lambda x, w: _reference(x, starts, sizes, *w)), (0, 1)))
    (v, (gx, gw)), (v_ref, (gx_ref, gw_ref)) = fast(x, w), ref(x, w)
    np.testing.assert_allclose(cpu_gmm.ffn_runs(x, st, gs, *w), reference(x, w),
                               atol=1e-5, rtol=0)
    np.testing.assert_allclose(v, v_ref, atol=1e-4, rtol=1e-6)
    np.testing.assert_allclose(gx, gx_ref, atol=1e-5, rtol=0)
    for a, b in zip(gw, gw_ref, strict=True):  # sums over up to 300 rows: relative too
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.jax011
def test_under_shard_map_gradients_of_replicated_and_sharded_weights():
    """4 devices, each its own rows and runs; w_gate/w_up replicated (their gradient is
    the sum over devices), w_down split over the devices, as expert parallelism has it."""
    n = 4
    mesh = jax.make_mesh((n,), ("expert",), devices=jax.devices()[:n])
    sizes = np.array([[5, 0, 9], [1, 2, 3], [0, 0, 12], [7, 7, 0]], np.int32)
    R = 16
    starts = np.concatenate([np.zeros((n, 1), np.int32), np.cumsum(sizes, 1)[:, :-1]], 1)
    kx, kw, kd = jax.random.split(jax.random.key(2), 3)
    x = jax.random.normal(kx, (n * R, D))
    wg, wu, _ = _weights(kw, 3)
    wd = jax.random.normal(kd, (n * 3, F, D)) * 0.15  # device d owns experts 3d .. 3d + 2

    def per_device(x, st, gs, wg, wu, wd):
        return jnp.sum(jnp.sin(cpu_gmm.ffn_runs(x, st[0], gs[0], wg, wu, wd)))[None]

    def ref_device(x, st, gs, wg, wu, wd):
        return jnp.sum(jnp.sin(_reference(x, list(st), list(gs), wg, wu, wd)))

    specs = (P("expert"), P("expert"), P("expert"), P(), P(), P("expert"))
    sharded = jax.shard_map(per_device, mesh=mesh, in_specs=specs, out_specs=P("expert"))
    args = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in
            zip((x, jnp.asarray(starts), jnp.asarray(sizes), wg, wu, wd), specs, strict=True)]
    loss = lambda x, wg, wu, wd: jnp.sum(sharded(x, args[1], args[2], wg, wu, wd))  # noqa: E731
    g = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(args[0], *args[3:])

    def ref_loss(x, wg, wu, wd):
        return sum(ref_device(x[d * R:(d + 1) * R], starts[d], sizes[d], wg, wu,
                              wd[3 * d:3 * d + 3]) for d in range(n))

    g_ref = jax.jit(jax.grad(ref_loss, argnums=(0, 1, 2, 3)))(x, wg, wu, wd)
    for a, b in zip(g, g_ref, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.jax011
def test_bad_dtype_and_overlapping_runs_are_refused():
    w = _weights(jax.random.key(0), 2)
    x = jnp.zeros((8, D))
    with pytest.raises(ValueError, match="gmm_impl=blas runs float32"):
        cpu_gmm.ffn_runs(x.astype(jnp.bfloat16), jnp.zeros(2, jnp.int32), jnp.ones(2, jnp.int32),
                         *(a.astype(jnp.bfloat16) for a in w))
    with pytest.raises(Exception, match="runs must ascend, be disjoint"):
        jax.block_until_ready(cpu_gmm.ffn_runs(
            x, jnp.asarray([0, 2], jnp.int32), jnp.asarray([4, 4], jnp.int32), *w))
