"""QK-norm + RoPE + head-major transpose (one hand-written VJP) and the qkv column split
against autodiff of the plain composition."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from olmo_jax.model.attention import split_columns
from olmo_jax.model.qk_rope import norm_rope_heads
from olmo_jax.model.rope import rope_tables


def plain_rms_norm(x, w, eps):
    axes = tuple(range(x.ndim - w.ndim, x.ndim))
    return w * x / jnp.sqrt(jnp.mean(x * x, axis=axes, keepdims=True) + eps)


def plain_rope(x_BTNH, cos_TH, sin_TH):
    half = x_BTNH.shape[-1] // 2
    rotated = jnp.concatenate([-x_BTNH[..., half:], x_BTNH[..., :half]], axis=-1)
    return x_BTNH * cos_TH[None, :, None] + rotated * sin_TH[None, :, None]


@pytest.mark.parametrize("wshape", [(3, 8), (8,)])  # across heads (HF OLMoE), per head
def test_norm_rope_heads_matches_autodiff_of_the_composition(wshape):
    B, T, N, H = 2, 5, 3, 8
    ks = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(ks[0], (B, T, N, H))
    w = 1 + 0.3 * jax.random.normal(ks[1], wshape)
    probe = jax.random.normal(ks[2], (B, N, T, H))
    cos, sin = rope_tables(jnp.arange(T) + 3, H, 100.0)

    def plain(x, w):
        return plain_rope(plain_rms_norm(x, w, 1e-5), cos, sin).transpose(0, 2, 1, 3)

    def fused(x, w):
        return norm_rope_heads(x, w, 1e-5, cos, sin)

    np.testing.assert_allclose(fused(x, w), plain(x, w), atol=1e-6)
    grads = jax.grad(lambda x, w: jnp.sum(fused(x, w) * probe), (0, 1))(x, w)
    ref = jax.grad(lambda x, w: jnp.sum(plain(x, w) * probe), (0, 1))(x, w)
    for g, r in zip(grads, ref, strict=True):
        np.testing.assert_allclose(g, r, atol=1e-5)


def test_split_columns_matches_slicing_fwd_and_grads():
    x = jax.random.normal(jax.random.key(0), (6, 10))
    probes = [jax.random.normal(jax.random.key(i), (6, w)) for i, w in enumerate((4, 2, 4))]

    def loss(split):
        return lambda x: sum(jnp.sum(b * p) for b, p in zip(split(x), probes, strict=True))

    blocks = split_columns(x, (4, 2, 4))
    for b, r in zip(blocks, (x[:, :4], x[:, 4:6], x[:, 6:]), strict=True):
        np.testing.assert_array_equal(b, r)
    g = jax.grad(loss(lambda x: split_columns(x, (4, 2, 4))))(x)
    ref = jax.grad(loss(lambda x: (x[:, :4], x[:, 4:6], x[:, 6:])))(x)
    np.testing.assert_allclose(g, ref, atol=0)
