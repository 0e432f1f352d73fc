"""Naive references the fast paths are compared against. Written for clarity, not speed:
loops over experts, (for capacity) over assignments, and (for routing options: gating,
bias, group-limited selection) over tokens in Python."""

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
    return naive_expert_sum(x_SD, w_Sk, idx_Sk, keep, w_gate, w_up, w_down)


def naive_expert_sum(x_SD, w_Sk, idx_Sk, keep_Sk, w_gate, w_up, w_down):
    """Loop over experts: y[s] = sum over kept (s, j) of w[s, j] * SwiGLU_{idx[s, j]}(x[s])."""
    y = jnp.zeros(x_SD.shape, jnp.float32)
    for e in range(w_gate.shape[0]):
        h = jax.nn.silu(x_SD @ w_gate[e]) * (x_SD @ w_up[e])
        out_e = h @ w_down[e]
        gate_S = jnp.sum(jnp.where((idx_Sk == e) & keep_Sk, w_Sk, 0.0), axis=-1)
        y = y + gate_S[:, None] * out_e
    return y


def naive_gate_scores(logits_SE: np.ndarray, gating: str) -> np.ndarray:
    """Per-expert scores experts are chosen by, computed token by token in float32."""
    out = np.zeros_like(logits_SE, np.float32)
    for s, row in enumerate(np.asarray(logits_SE, np.float32)):
        if gating == "softmax":
            e = np.exp(row - row.max())
            out[s] = e / e.sum()
        elif gating == "sigmoid":
            out[s] = 1.0 / (1.0 + np.exp(-row))
        else:  # topk_softmax chooses by the logits themselves
            out[s] = row
    return out


def _best(values, candidates, n):
    """The n candidates with the largest values; ties go to the lower id."""
    return sorted(candidates, key=lambda c: (-values[c], c))[:n]


def naive_select(scores_SE: np.ndarray, top_k: int, bias_E=None, n_group: int = 1,
                 topk_group: int = 1) -> np.ndarray:
    """idx_Sk chosen from per-expert selection scores (+ bias), group-limited: a group's
    score is the sum of its two best experts; only the topk_group best groups count."""
    S, E = scores_SE.shape
    per_group = E // n_group
    idx = np.zeros((S, top_k), np.int32)
    for s in range(S):
        sel = [float(scores_SE[s, e]) + (0.0 if bias_E is None else float(bias_E[e]))
               for e in range(E)]
        group_score = []
        for g in range(n_group):
            members = list(range(g * per_group, (g + 1) * per_group))
            group_score.append(sum(sel[e] for e in _best(sel, members, 2)))
        groups = _best(group_score, range(n_group), topk_group)
        eligible = [e for g in groups for e in range(g * per_group, (g + 1) * per_group)]
        idx[s] = _best(sel, eligible, top_k)
    return idx


def naive_weights(logits_SE, idx_Sk, gating: str, norm_topk_prob=False, scale=1.0):
    """Combine weights of the chosen experts, differentiable in the logits."""
    logits_SE = logits_SE.astype(jnp.float32)
    if gating == "topk_softmax":
        return scale * jax.nn.softmax(jnp.take_along_axis(logits_SE, idx_Sk, -1), axis=-1)
    g = jax.nn.softmax(logits_SE, -1) if gating == "softmax" else jax.nn.sigmoid(logits_SE)
    w = jnp.take_along_axis(g, idx_Sk, -1)
    if gating == "sigmoid" or norm_topk_prob:
        w = w / w.sum(-1, keepdims=True)
    return scale * w


def naive_moe_given_choice(x_SD, router_DE, w_gate, w_up, w_down, idx_Sk, gating,
                           norm_topk_prob=False, scale=1.0):
    """naive_moe's loop over experts with the experts already chosen (dropless)."""
    w_Sk = naive_weights(x_SD.astype(jnp.float32) @ router_DE, idx_Sk, gating,
                         norm_topk_prob, scale)
    keep_Sk = jnp.ones(idx_Sk.shape, bool)
    return naive_expert_sum(x_SD, w_Sk, idx_Sk, keep_Sk, w_gate, w_up, w_down)


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
