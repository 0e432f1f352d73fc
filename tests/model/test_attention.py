"""The attention core (hand-written VJP) against a head-by-head reference, forward and
gradients, with grouped-query heads."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from olmo_jax.model.attention import causal_attention
from tests.reference import naive_attention


@pytest.mark.parametrize("n_heads,kv_heads,T", [(4, 4, 12), (4, 2, 12), (6, 1, 12), (4, 2, 256), (2, 1, 512)])
def test_attention_matches_reference_fwd_and_grads(n_heads, kv_heads, T):
    B, H = 2, 8
    ks = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(ks[0], (B, T, n_heads, H))
    k = jax.random.normal(ks[1], (B, T, kv_heads, H))
    v = jax.random.normal(ks[2], (B, T, kv_heads, H))
    probe = jax.random.normal(ks[3], (B, T, n_heads, H))

    def loss(f):
        return lambda q, k, v: jnp.sum(jnp.sin(f(q, k, v)) * probe)

    out, ref = causal_attention(q, k, v), naive_attention(q, k, v)
    np.testing.assert_allclose(out, ref, atol=1e-5, rtol=0)
    grads = jax.grad(loss(causal_attention), argnums=(0, 1, 2))(q, k, v)
    ref_grads = jax.grad(loss(naive_attention), argnums=(0, 1, 2))(q, k, v)
    for g, r in zip(grads, ref_grads, strict=True):
        np.testing.assert_allclose(g, r, atol=1e-5, rtol=0)
        assert float(jnp.max(jnp.abs(r))) > 1e-2
