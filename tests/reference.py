"""Naive references the fast paths are compared against. Written for clarity, not speed:
loops over experts and (for capacity) over assignments in Python."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def naive_routing(x_SD, router_DE, top_k, norm_topk_prob=False):
    logits = x_SD.astype(jnp.float32) @ router_DE
    probs = jax.nn.softmax(logits, axis=-1)
    w, idx = jax.lax.top_k(probs, top_k)
    if norm_topk_prob:
        w = w / w.sum(-1, keepdims=True)
    return w, idx


def naive_keep_mask(idx_Sk: np.ndarray, num_experts: int, capacity: int | None) -> np.ndarray:
    """Which assignments survive capacity: first choices of all tokens (in token order)
    claim slots before any second choice, and so on."""
    S, k = idx_Sk.shape
    keep = np.ones((S, k), bool)
    if capacity is None:
        return keep
    used = [0] * num_experts
    for j in range(k):
        for s in range(S):
            e = int(idx_Sk[s, j])
            keep[s, j] = used[e] < capacity
            used[e] += 1
    return keep


def naive_moe(x_SD, router_DE, w_gate, w_up, w_down, top_k, norm_topk_prob=False, capacity=None):
    """y[s] = sum over kept (s, j) of weight[s, j] * SwiGLU_{expert[s, j]}(x[s])."""
    w_Sk, idx_Sk = naive_routing(x_SD, router_DE, top_k, norm_topk_prob)
    keep = jnp.asarray(naive_keep_mask(np.asarray(idx_Sk), w_gate.shape[0], capacity))
    y = jnp.zeros(x_SD.shape, jnp.float32)
    for e in range(w_gate.shape[0]):
        h = jax.nn.silu(x_SD @ w_gate[e]) * (x_SD @ w_up[e])
        out_e = h @ w_down[e]
        gate_S = jnp.sum(jnp.where((idx_Sk == e) & keep, w_Sk, 0.0), axis=-1)
        y = y + gate_S[:, None] * out_e
    return y


def naive_attention(q_BTNH, k_BTKH, v_BTKH):
    """Causal attention one head at a time, kv heads repeated for grouped queries."""
    B, T, N, H = q_BTNH.shape
    G = N // k_BTKH.shape[2]
    mask = jnp.tril(jnp.ones((T, T), bool))
    outs = []
    for n in range(N):
        q, k, v = q_BTNH[:, :, n], k_BTKH[:, :, n // G], v_BTKH[:, :, n // G]
        s = jnp.einsum("bth,bsh->bts", q, k) / np.sqrt(H)
        p = jax.nn.softmax(jnp.where(mask, s, -jnp.inf), axis=-1)
        outs.append(jnp.einsum("bts,bsh->bth", p, v))
    return jnp.stack(outs, axis=2)
