"""RMSNorm (hand-written VJP) against autodiff of the plain formula."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from olmo_jax.model.norm import rms_norm


def plain_rms_norm(x, w, eps):
    axes = tuple(range(x.ndim - w.ndim, x.ndim))
    return w * x / jnp.sqrt(jnp.mean(x * x, axis=axes, keepdims=True) + eps)


@pytest.mark.parametrize("shape,wshape", [((3, 5, 16), (16,)), ((2, 4, 3, 8), (3, 8))])
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
