"""Router auxiliary losses from per-layer routing statistics.

Each MoE layer reports `RouterStats`; the model stacks them over layers ([L, ...]) and
these functions turn them into losses:
  load balancing (OLMo-core, per layer, summed over layers):
      E * sum_i f_i * P_i,  f_i = count_i / (tokens * k),  P_i = mean router prob of expert i
      (1.0 per layer when perfectly balanced)
  load balancing (Hugging Face, pooled over all layers):
      E * sum_i (sum_l count_li / (L * tokens)) * (sum_l prob_li / (L * tokens))
  z-loss: mean over tokens of logsumexp(logits)^2, summed over layers.
Counts carry no gradient; the gradient flows through the probabilities.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class RouterStats(NamedTuple):
    counts_E: jax.Array  # float32 routed assignments per expert (before any drop)
    prob_sum_E: jax.Array  # float32 sum over tokens of router probabilities
    z_sum: jax.Array  # float32 sum over tokens of logsumexp(logits)^2
    dropped: jax.Array  # float32 assignments dropped at capacity
    n_tokens: jax.Array  # float32 tokens routed


def router_stats(probs_SE, logits_SE, idx_Sk, num_experts: int, dropped=0.0) -> RouterStats:
    counts_E = jnp.zeros((num_experts,), jnp.float32).at[idx_Sk.reshape(-1)].add(1.0)
    z_S = jax.nn.logsumexp(logits_SE.astype(jnp.float32), axis=-1)
    return RouterStats(
        counts_E=jax.lax.stop_gradient(counts_E),
        prob_sum_E=jnp.sum(probs_SE.astype(jnp.float32), axis=0),
        z_sum=jnp.sum(jnp.square(z_S)),
        dropped=jax.lax.stop_gradient(jnp.asarray(dropped, jnp.float32)),
        n_tokens=jnp.asarray(probs_SE.shape[0], jnp.float32),
    )


def load_balancing_loss(stats: RouterStats, top_k: int, kind: str = "per_layer") -> jax.Array:
    """stats fields have a leading layer axis [L, ...]."""
    E = stats.counts_E.shape[-1]
    n = stats.n_tokens[..., None]
    if kind == "per_layer":
        f_LE = stats.counts_E / (n * top_k)
        p_LE = stats.prob_sum_E / n
        return E * jnp.sum(f_LE * p_LE)
    if kind == "pooled":
        total = jnp.sum(stats.n_tokens)
        f_E = jnp.sum(stats.counts_E, axis=0) / total
        p_E = jnp.sum(stats.prob_sum_E, axis=0) / total
        return E * jnp.sum(f_E * p_E)
    raise ValueError(f"unknown load-balancing loss {kind!r}")


def z_loss(stats: RouterStats) -> jax.Array:
    return jnp.sum(stats.z_sum / stats.n_tokens)


def expert_imbalance(counts_LE: jax.Array) -> jax.Array:
    """Worst block's max/mean routed tokens per expert (1.0 = perfectly balanced)."""
    mean_L = jnp.mean(counts_LE, axis=-1)
    return jnp.max(jnp.max(counts_LE, axis=-1) / jnp.maximum(mean_L, 1e-9))
