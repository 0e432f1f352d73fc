"""The Blackwell (tcgen05/TMEM) grouped matmul against jax.lax.ragged_dot and the jnp
references, in Pallas' GPU interpret mode, float32 (the interpreter executes tcgen05_mma
as a float32 matmul into its TMEM buffer, so the kernels' tiling, schedule, barrier
protocol, masks and store ladder are checked to 1e-5 with no bf16 rounding in the way).
The group sizes include an empty group, groups that start and end inside one row tile,
and a tail of rows past sum(group_sizes). The Mosaic GPU lowering and ptxas for sm_100a /
sm_103a are checked by the deviceless compiles of tests/gpu (test_toolchain.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from olmo_jax.kernels import grouped_matmul as gm
from olmo_jax.kernels import grouped_matmul_tcgen05 as bw
from olmo_jax.kernels import platform

# Two row tiles per group boundary, two K steps, two column blocks per product.
CFG = gm.TileConfig(block_m=64, block_n=32, block_k=32, max_concurrent_steps=2, num_programs=2)


@pytest.fixture(scope="module")
def operands():
    M, K, N = 150, 64, 64
    gs = jnp.array([37, 0, 70, 30], jnp.int32)  # 137 routed rows, a tail of 13
    keys = jax.random.split(jax.random.key(3), 3)
    x = jax.random.normal(keys[0], (M, K), jnp.float32)
    w = jax.random.normal(keys[1], (gs.shape[0], K, N), jnp.float32)
    dy = jax.random.normal(keys[2], (M, N), jnp.float32)
    return x, w, dy, gs


def _close(got, want):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


@pytest.mark.jax011
def test_forward_and_vjp_match_ragged_dot_in_float32(operands):
    """y = gmm, dx = gmm against w^T, dw = tgmm, each against ragged_dot's value and
    autodiff and the jnp references; the zero tail and the empty group's gradient are 0."""
    x, w, dy, gs = operands
    with platform.interpret():
        y, vjp = jax.vjp(lambda a, b: bw.grouped_matmul(a, b, gs, CFG), x, w)
        dx, dw = vjp(dy)
    hi = jax.lax.Precision.HIGHEST
    y_ref, vjp_ref = jax.vjp(lambda a, b: jax.lax.ragged_dot(a, b, gs, precision=hi), x, w)
    dx_ref, dw_ref = vjp_ref(dy)
    _close(y, y_ref)
    _close(dx, dx_ref)
    _close(dw, dw_ref)
    _close(y, gm.gmm_reference(x, w, gs))
    _close(dw, gm.tgmm_reference(x, dy, gs))
    assert not np.asarray(y[int(jnp.sum(gs)):]).any()  # the zero tail
    assert not np.asarray(dw[1]).any()  # the empty group


@pytest.mark.jax011
def test_unsupported_inputs_are_refused():
    x = jnp.zeros((64, 64), jnp.float32)
    w = jnp.zeros((2, 64, 64), jnp.float32)
    with pytest.raises(TypeError, match="bfloat16"):
        bw.gmm(x, w, jnp.array([32, 32]))
    with pytest.raises(RuntimeError, match="interpret"):
        bw.tgmm(x.astype(jnp.bfloat16), x.astype(jnp.bfloat16), jnp.array([32, 32]))
    with platform.interpret(), pytest.raises(ValueError, match="block_m 64 or 128"):
        bw.gmm(x, w, jnp.array([32, 32]), config=gm.TileConfig(block_m=192, block_k=64,
                                                                  block_n=64))
