"""Sliding-window attention in the CPU cores (`window` W: query t attends keys
[t - W + 1, t], OLMo-core's window_size): the xla core and the blas kernel against a naive
masked softmax, alone and with document masking, forward and gradients, float32; the
keys left of a query chunk's window are not read (the xla chunks' key slices)."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from olmo_jax.kernels import cpu_attention
from olmo_jax.model.attention import causal_attention

CORES = {"xla": causal_attention, "blas": cpu_attention.causal_attention}


def naive_window_attention(q_BTNH, k_BTKH, v_BTKH, window, seg_BT=None):
    B, T, N, H = q_BTNH.shape
    G = N // k_BTKH.shape[2]
    k, v = jnp.repeat(k_BTKH, G, axis=2), jnp.repeat(v_BTKH, G, axis=2)
    s = jnp.einsum("btnh,bsnh->bnts", q_BTNH, k) / np.sqrt(H)
    t, a = jnp.arange(T)[:, None], jnp.arange(T)[None, :]
    mask = jnp.broadcast_to((a <= t) & (t - a < window), (B, T, T))
    if seg_BT is not None:
        mask = mask & (seg_BT[:, :, None] == seg_BT[:, None, :])
    p = jax.nn.softmax(jnp.where(mask[:, None], s, -jnp.inf), axis=-1)
    return jnp.einsum("bnts,bsnh->btnh", p, v)


@pytest.mark.parametrize("docs", [False, True], ids=["window", "window+docs"])
@pytest.mark.parametrize("impl", sorted(CORES))
def test_each_core_applies_the_window_like_the_naive_softmax(impl, docs):
    """T = 512: four query chunks of 128 in the xla core (a 100-key window skips the keys
    left of chunks 1-3), eight 64-row blocks in the blas kernel."""
    B, T, N, K, H, W = 2, 512, 4, 2, 16, 100
    rng = np.random.default_rng(3)
    q, k, v, probe = (jnp.asarray(rng.standard_normal(s), jnp.float32)
                      for s in [(B, T, N, H), (B, T, K, H), (B, T, K, H), (B, T, N, H)])
    seg = None
    if docs:
        starts = [[0, 5, 170, 171, 300], [0, 64, 400, 511]]
        seg = jnp.asarray(np.stack([np.searchsorted(s, np.arange(T), side="right") - 1
                                    for s in starts]), jnp.int32)

    def loss(f):
        return lambda q, k, v: jnp.sum(jnp.sin(f(q, k, v)) * probe)

    core = lambda q, k, v: CORES[impl](q, k, v, seg, window=W)  # noqa: E731
    ref = lambda q, k, v: naive_window_attention(q, k, v, W, seg)  # noqa: E731
    np.testing.assert_allclose(jax.jit(core)(q, k, v), ref(q, k, v), atol=1e-5, rtol=0)
    grads = jax.jit(jax.grad(loss(core), argnums=(0, 1, 2)))(q, k, v)
    for g, r in zip(grads, jax.grad(loss(ref), argnums=(0, 1, 2))(q, k, v), strict=True):
        np.testing.assert_allclose(g, r, atol=1e-5, rtol=0)
    full = CORES[impl](q, k, v, seg)  # the window matters
    assert float(jnp.max(jnp.abs(full - jax.jit(core)(q, k, v)))) > 0.1


def test_the_xla_core_reads_only_the_keys_of_each_chunks_window():
    """Chunk i's scores are [.., 2 * 128, 128 + W - 1] (keys from i * 128 - W + 1), not
    [.., 2 * 128, (i + 1) * 128]: the blocks left of the window are skipped."""
    B, T, N, K, H, W = 1, 512, 4, 2, 16, 100
    q = jnp.zeros((B, T, N, H))
    k = v = jnp.zeros((B, T, K, H))
    hlo = jax.jit(lambda q, k, v: causal_attention(q, k, v, window=W)).lower(q, k, v).as_text()
    widths = {int(w) for w in re.findall(r"tensor<1x2x256x(\d+)xf32>", hlo)} - {1, H}
    assert widths == {128, 128 + W - 1}, widths  # chunk 0's 128 keys, the others' window
