"""The CPU attention FFI kernels (olmo_jax/kernels/cpu_attention.py, attention_impl=blas)
on their own, against plain jnp references, forward and gradients, float32: the causal
core (grouped-query heads, sequences shorter than, equal to and not a multiple of the
64-row query block), the QK-norm / clipping / RoPE kernel (no norm, per-head norm, all-heads
norm; with and without clipping); under shard_map (activations split over devices,
norm weights replicated: their gradient is the sum over devices); bad input."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from olmo_jax.kernels import cpu_attention
from olmo_jax.model.norm import rms_norm
from olmo_jax.model.rope import apply_rope, rope_tables


def _reference_core(q_BTNH, k_BTKH, v_BTKH):
    """softmax(q k^T / sqrt(H)) v with a causal mask, the kv heads repeated, highest precision."""
    B, T, N, H = q_BTNH.shape
    G = N // k_BTKH.shape[2]
    k_BTNH, v_BTNH = (jnp.repeat(a, G, axis=2) for a in (k_BTKH, v_BTKH))
    s_BNTS = jnp.einsum("btnh,bsnh->bnts", q_BTNH, k_BTNH, precision="highest") / np.sqrt(H)
    s_BNTS = jnp.where(jnp.tril(jnp.ones((T, T), bool)), s_BNTS, -jnp.inf)
    return jnp.einsum("bnts,bsnh->btnh", jax.nn.softmax(s_BNTS, -1), v_BTNH, precision="highest")


def _reference_prep(qkv_BTJ, N, K, cos_TH, sin_TH, norm, q_w, k_w, eps, clip):
    B, T, J = qkv_BTJ.shape
    H = J // (N + 2 * K)
    q = qkv_BTJ[..., :N * H].reshape(B, T, N, H)
    k = qkv_BTJ[..., N * H:(N + K) * H].reshape(B, T, K, H)
    v = qkv_BTJ[..., (N + K) * H:].reshape(B, T, K, H)
    if norm:
        q, k = rms_norm(q, q_w, eps), rms_norm(k, k_w, eps)
    if clip:
        q, k, v = (jnp.clip(a, -clip, clip) for a in (q, k, v))
    return apply_rope(q, cos_TH, sin_TH), apply_rope(k, cos_TH, sin_TH), v


def _loss(fn, cts):
    return lambda *a: sum(jnp.sum(jnp.sin(o) * c) for o, c in zip(fn(*a), cts, strict=True))


@pytest.mark.parametrize("B,T,N,K,H", [pytest.param(2, 100, 4, 2, 16, marks=pytest.mark.jax011),
                                       (1, 64, 2, 2, 8), (3, 37, 6, 1, 32),
                                       (1, 130, 3, 3, 8)])
def test_core_matches_the_reference(B, T, N, K, H):
    ks = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(ks[0], (B, T, N, H))
    k, v = (jax.random.normal(kk, (B, T, K, H)) for kk in ks[1:3])
    ct = jax.random.normal(ks[3], (B, T, N, H))
    fast = jax.jit(jax.value_and_grad(_loss(lambda *a: [cpu_attention.causal_attention(*a)], [ct]),
                                      (0, 1, 2)))
    # The references jitted too: one compile each, not one per eager op and shape.
    ref = jax.jit(jax.value_and_grad(_loss(lambda *a: [_reference_core(*a)], [ct]), (0, 1, 2)))
    (val, grads), (val_ref, grads_ref) = fast(q, k, v), ref(q, k, v)
    np.testing.assert_allclose(cpu_attention.causal_attention(q, k, v),
                               jax.jit(_reference_core)(q, k, v), atol=1e-5, rtol=0)
    np.testing.assert_allclose(val, val_ref, atol=1e-4, rtol=1e-6)
    for a, b in zip(grads, grads_ref, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)


def _prep_case(norm, key=1, B=2, T=70, N=4, K=2, H=16):
    ks = jax.random.split(jax.random.key(key), 6)
    qkv = jax.random.normal(ks[0], (B, T, (N + 2 * K) * H))
    shape_q, shape_k = ((H,), (H,)) if norm == "head" else ((N, H), (K, H))
    q_w = 1 + 0.1 * jax.random.normal(ks[1], shape_q)
    k_w = 1 + 0.1 * jax.random.normal(ks[2], shape_k)
    cos, sin = rope_tables(jnp.arange(T) + 3, H, 10000.0)
    cts = [jax.random.normal(ks[3 + i], s) for i, s in
           enumerate([(B, T, N, H), (B, T, K, H), (B, T, K, H)])]
    return qkv, q_w, k_w, cos, sin, cts, N, K


@pytest.mark.parametrize("norm", [None, pytest.param("head", marks=pytest.mark.jax011), "all"])
@pytest.mark.parametrize("clip", [None, 0.8])
def test_qk_prep_matches_norm_clip_and_rope(norm, clip):
    qkv, q_w, k_w, cos, sin, cts, N, K = _prep_case(norm)

    def fast(qkv, q_w, k_w):
        return cpu_attention.qk_prep(qkv, N, K, cos, sin, norm=norm, q_norm=q_w, k_norm=k_w,
                                     eps=1e-6, clip=clip)

    def slow(qkv, q_w, k_w):
        return _reference_prep(qkv, N, K, cos, sin, norm, q_w, k_w, 1e-6, clip)

    for a, b in zip(jax.jit(fast)(qkv, q_w, k_w), jax.jit(slow)(qkv, q_w, k_w), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)
    (val, g), (val_ref, g_ref) = (jax.jit(jax.value_and_grad(_loss(f, cts), (0, 1, 2)))(qkv, q_w, k_w)
                                  for f in (fast, slow))
    np.testing.assert_allclose(val, val_ref, atol=1e-4, rtol=1e-6)
    np.testing.assert_allclose(g[0], g_ref[0], atol=1e-5, rtol=0)
    if norm:  # sums over 140 rows (x heads): relative too
        for a, b in zip(g[1:], g_ref[1:], strict=True):
            np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)
    else:  # the dummy weights get no gradient
        assert not np.any(g[1]) and not np.any(g[2])


@pytest.mark.jax011
def test_under_shard_map_the_replicated_norm_weights_gradient_is_the_sum_over_devices():
    n = 4
    mesh = jax.make_mesh((n,), ("data",), devices=jax.devices()[:n])
    qkv, q_w, k_w, cos, sin, cts, N, K = _prep_case("head", key=2, B=n, T=40)
    ct = cts[0]

    def block(qkv, q_w, k_w, ct):
        q, k, v = cpu_attention.qk_prep(qkv, N, K, cos, sin, norm="head", q_norm=q_w,
                                        k_norm=k_w, eps=1e-6)
        return jnp.sum(jnp.sin(cpu_attention.causal_attention(q, k, v)) * ct)

    specs = (P("data"), P(), P(), P("data"))
    sharded = jax.shard_map(lambda *a: block(*a)[None], mesh=mesh, in_specs=specs,
                            out_specs=P("data"))
    args = [jax.device_put(a, NamedSharding(mesh, s))
            for a, s in zip((qkv, q_w, k_w, ct), specs, strict=True)]
    g = jax.jit(jax.grad(lambda *a: jnp.sum(sharded(*a)), (0, 1, 2)))(*args)

    def ref(qkv, q_w, k_w, ct):
        q, k, v = _reference_prep(qkv, N, K, cos, sin, "head", q_w, k_w, 1e-6, None)
        return jnp.sum(jnp.sin(_reference_core(q, k, v)) * ct)

    g_ref = jax.jit(jax.grad(ref, (0, 1, 2)))(qkv, q_w, k_w, ct)
    for a, b in zip(g, g_ref, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)


def test_bad_input_is_refused():
    q = jnp.zeros((1, 8, 4, 8))
    with pytest.raises(ValueError, match="attention_impl=blas runs float32"):
        cpu_attention.causal_attention(*(a.astype(jnp.bfloat16) for a in (q, q, q)))
    with pytest.raises(ValueError, match=r"N % K == 0"):
        cpu_attention.causal_attention(q, jnp.zeros((1, 8, 3, 8)), jnp.zeros((1, 8, 3, 8)))
    with pytest.raises(ValueError, match="attention_impl=blas runs float32"):
        cpu_attention.qk_prep(jnp.zeros((1, 8, 48), jnp.bfloat16), 4, 1, q[0, :, 0], q[0, :, 0])


def test_computed_fraction_counts_the_query_blocks():
    assert cpu_attention.computed_fraction(64) == 1.0
    assert cpu_attention.computed_fraction(256) == 10 / 16  # blocks 1 + 2 + 3 + 4 of 16
    assert cpu_attention.computed_fraction(100) == (64 * 64 + 36 * 100) / 100 ** 2


def test_the_planner_knows_every_cpu_ffi_target():
    """Every FFI target the CPU library registers is one the planner's HLO walk treats as
    opaque to XLA's cost analysis (gpu_hlo.CPU_FFI), and the GEMM ones have FLOPs."""
    from olmo_jax.kernels import cpu_ffi
    from olmo_jax.planner import gpu_hlo

    assert set(cpu_ffi.TARGETS) == set(gpu_hlo.CPU_FFI)
    assert set(gpu_hlo.CPU_SWIGLU) | set(gpu_hlo.CPU_ATTENTION) < set(gpu_hlo.CPU_FFI)
