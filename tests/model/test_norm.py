"""RMSNorm (hand-written VJP; on CPU in float32 with a [D] weight the FFI kernel,
kernels/cpu_norm.cc) against autodiff of the plain formula; both paths."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from olmo_jax.model import norm
from olmo_jax.model.norm import rms_norm


def plain_rms_norm(x, w, eps):
    axes = tuple(range(x.ndim - w.ndim, x.ndim))
    return w * x / jnp.sqrt(jnp.mean(x * x, axis=axes, keepdims=True) + eps)


@pytest.mark.parametrize("shape,wshape", [((3, 5, 16), (16,)), ((2, 4, 3, 8), (3, 8)),
                                         ((3, 50, 64), (64,))])
def test_rms_norm_matches_autodiff_of_the_formula(shape, wshape):
    ks = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(ks[0], shape)
    w = 1 + 0.3 * jax.random.normal(ks[1], wshape)
    probe = jax.random.normal(ks[2], shape)
    np.testing.assert_allclose(rms_norm(x, w, 1e-5), plain_rms_norm(x, w, 1e-5), atol=1e-6)
    grads = jax.grad(lambda x, w: jnp.sum(rms_norm(x, w, 1e-5) * probe), (0, 1))(x, w)
    ref = jax.grad(lambda x, w: jnp.sum(plain_rms_norm(x, w, 1e-5) * probe), (0, 1))(x, w)
    for g, r in zip(grads, ref, strict=True):
        np.testing.assert_allclose(g, r, atol=1e-5)


def test_the_cpu_kernel_is_the_float32_cpu_path_and_equals_the_jnp_one():
    ks = jax.random.split(jax.random.key(1), 3)
    x = jax.random.normal(ks[0], (7, 33, 48))  # 231 rows: items of 64 and a partial one
    w = 1 + 0.3 * jax.random.normal(ks[1], (48,))
    probe = jax.random.normal(ks[2], x.shape)
    assert "ffi_call" in str(jax.make_jaxpr(rms_norm, static_argnums=2)(x, w, 1e-6))
    assert "ffi_call" not in str(jax.make_jaxpr(rms_norm, static_argnums=2)(
        x.astype(jnp.bfloat16), w, 1e-6))

    def loss(f):
        return lambda x, w: jnp.sum(f(x, w, 1e-6) * probe)

    for kernel, jnp_path in zip(jax.value_and_grad(loss(rms_norm), (0, 1))(x, w),
                                jax.value_and_grad(loss(norm._rms_norm), (0, 1))(x, w), strict=True):
        for a, b in zip(jax.tree.leaves(kernel), jax.tree.leaves(jnp_path), strict=True):
            np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)


def test_the_norm_runs_the_kernel_its_impl_names():
    """model.norm_impl picks the norm: xla is the jnp path even on this CPU in float32,
    blas the FFI kernel; auto (no plan) is the default device's choice, which the platform
    context (a GPU target here) does not change."""
    from olmo_jax.kernels import platform
    from olmo_jax.model.norm import RMSNorm

    x = jnp.ones((2, 8, 16))
    w = jnp.ones((16,))

    def jaxpr(impl):
        return str(jax.make_jaxpr(lambda x, w: rms_norm(x, w, 1e-6, impl))(x, w))

    assert "ffi_call" in jaxpr("blas")
    assert "ffi_call" not in jaxpr("xla")
    with platform.targeting(platform.Target("gpu", (9, 0), 132, abstract=True)):
        assert "ffi_call" in jaxpr("auto")
    layer = RMSNorm((16,), ("embed",), 1e-6, "xla")
    assert "ffi_call" not in str(jax.make_jaxpr(layer)(x))
