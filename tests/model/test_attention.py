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

    # Both jitted (as the model runs them): one compile each, not one per eager op.
    out, ref = jax.jit(causal_attention)(q, k, v), jax.jit(naive_attention)(q, k, v)
    np.testing.assert_allclose(out, ref, atol=1e-5, rtol=0)
    grads = jax.jit(jax.grad(loss(causal_attention), argnums=(0, 1, 2)))(q, k, v)
    ref_grads = jax.jit(jax.grad(loss(naive_attention), argnums=(0, 1, 2)))(q, k, v)
    for g, r in zip(grads, ref_grads, strict=True):
        np.testing.assert_allclose(g, r, atol=1e-5, rtol=0)
        assert float(jnp.max(jnp.abs(r))) > 1e-2


@pytest.mark.parametrize("layout", [
    {"qk_norm": True, "head_qk_norm": True}, {"qk_norm": True, "head_qk_norm": False},
    {"qk_norm": False}, {"qk_norm": True, "head_qk_norm": False, "clip_qkv": 0.5}])
def test_the_attention_block_is_the_same_function_with_each_cpu_core(layout):
    """The whole Attention module (projections, QK-norm, clipping, RoPE, core, output)
    with attention_impl=blas (the CPU FFI kernels) against xla (the jnp path): output and
    the gradient of every parameter and of the input, float32."""
    from flax import nnx

    from olmo_jax.model.attention import Attention
    from olmo_jax.model.config import TransformerConfig
    from olmo_jax.model.rope import rope_tables

    B, T = 2, 80
    outs = {}
    for impl in ("xla", "blas"):
        cfg = TransformerConfig(d_model=32, n_heads=4, n_kv_heads=2, attention_impl=impl,
                                dtype="float32", norm_eps=1e-5, **layout)
        attn = Attention(cfg, rngs=nnx.Rngs(3))
        graphdef, params = nnx.split(attn)
        params = jax.tree.map(lambda p: p + 0.05 * jnp.cos(jnp.arange(p.size).reshape(p.shape)),
                              params)  # norm weights away from 1
        x = jax.random.normal(jax.random.key(1), (B, T, 32))
        probe = jax.random.normal(jax.random.key(2), (B, T, 32))
        cos, sin = rope_tables(jnp.arange(T), cfg.head_size, cfg.rope_theta)

        def loss(params, x):  # used within this iteration only
            return jnp.sum(jnp.sin(nnx.merge(graphdef, params)(x, cos, sin)) * probe)  # noqa: B023

        outs[impl] = jax.jit(jax.value_and_grad(loss, (0, 1)))(params, x)
        ffi = "olmo_cpu_attention_fwd" in str(jax.make_jaxpr(loss)(params, x))
        assert ffi == (impl == "blas"), impl  # the CPU kernels run, and only with blas
    (v_x, (gp_x, gx_x)), (v_b, (gp_b, gx_b)) = outs["xla"], outs["blas"]
    np.testing.assert_allclose(v_b, v_x, rtol=1e-6, atol=1e-4)
    np.testing.assert_allclose(gx_b, gx_x, atol=1e-5, rtol=1e-5)
    flat_x, flat_b = jax.tree.leaves(gp_x), jax.tree.leaves(gp_b)
    assert len(flat_x) == len(flat_b) >= 4
    for a, b in zip(flat_b, flat_x, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)
