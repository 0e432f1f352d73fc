"""Router auxiliary losses and load metrics from per-layer routing statistics.

Each MoE layer reports `RouterStats` per sequence row of its batch ([B, ...]); the model
stacks them over layers ([L, B, ...]). Keeping rows apart lets the trainer group them into
the data-parallel shards of the batch (`shards`: the rows split into that many contiguous
groups, as the batch is split over devices) without the model knowing the mesh.
  load balancing (OLMo-core, per layer, summed over layers):
      E * sum_i f_i * P_i,  f_i = count_i / (tokens * k),  P_i = mean router prob of expert i
      (1.0 per layer when perfectly balanced)
  load balancing (Hugging Face, pooled over all layers):
      E * sum_i (sum_l count_li / (L * tokens)) * (sum_l prob_li / (L * tokens))
  granularity: `global` computes f and P over the whole batch; `local` computes the loss
      per shard and averages the shards (each data-parallel rank balances its own tokens);
      `instance` per sequence row, averaged (OLMo-core's `instance` granularity).
  z-loss: mean over tokens of logsumexp(logits)^2, summed over layers.
Counts carry no gradient; the gradient flows through the probabilities.
Load metrics: max/mean routed assignments per expert (`imbalance`) and per expert-parallel
rank (ranks own contiguous ranges of E / ranks experts).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class RouterStats(NamedTuple):
    """Fields as the model returns them, stacked over its MoE layers ([L, ...]); one
    layer's own stats (`router_stats`) have no L axis."""

    counts_LBE: jax.Array  # float32 routed assignments per row and expert (before any drop)
    prob_sum_LBE: jax.Array  # float32 sum over the row's tokens of router probabilities
    z_sum_LB: jax.Array  # float32 sum over the row's tokens of logsumexp(logits)^2
    dropped: jax.Array  # float32 assignments dropped at capacity
    tokens_per_row: jax.Array  # float32 tokens in each row

    @property
    def counts_E(self) -> jax.Array:
        """Routed assignments per expert over the whole batch ([L, E] when stacked)."""
        return jnp.sum(self.counts_LBE, axis=-2)


def router_stats(probs_SE, logits_SE, idx_Sk, num_experts: int, dropped=0.0,
                 rows: int = 1) -> RouterStats:
    """Statistics of S = rows * tokens_per_row routed tokens (row-major)."""
    S, k = idx_Sk.shape
    row_Sk = jnp.broadcast_to((jnp.arange(S) // (S // rows))[:, None], (S, k))
    counts_BE = jnp.zeros((rows, num_experts), jnp.float32).at[row_Sk, idx_Sk].add(1.0)
    z_S = jnp.square(jax.nn.logsumexp(logits_SE.astype(jnp.float32), axis=-1))
    return RouterStats(
        counts_LBE=jax.lax.stop_gradient(counts_BE),
        prob_sum_LBE=jnp.sum(probs_SE.astype(jnp.float32).reshape(rows, S // rows, -1), axis=1),
        z_sum_LB=jnp.sum(z_S.reshape(rows, S // rows), axis=1),
        dropped=jax.lax.stop_gradient(jnp.asarray(dropped, jnp.float32)),
        tokens_per_row=jnp.asarray(S // rows, jnp.float32),
    )


def shard_sums(x_LBE: jax.Array, shards: int) -> jax.Array:
    """[L, B, E] per-row sums -> [L, shards, E] per-shard sums (contiguous row groups)."""
    L, B, E = x_LBE.shape
    if B % shards:
        raise ValueError(f"{B} batch rows cannot be split into {shards} equal shards")
    return jnp.sum(x_LBE.reshape(L, shards, B // shards, E), axis=2)


def _shard_tokens(stats: RouterStats, shards: int) -> jax.Array:
    """Tokens per shard, broadcastable against [L, shards, E]."""
    rows = stats.counts_LBE.shape[-2] // shards
    return (stats.tokens_per_row * rows)[..., None, None]


def load_balancing_per_layer(stats: RouterStats, top_k: int, shards: int = 1) -> jax.Array:
    """[L]: OLMo-core's per-layer LB loss, averaged over the shards (shards=1: global)."""
    E = stats.counts_LBE.shape[-1]
    n = _shard_tokens(stats, shards)
    f_LPE = shard_sums(stats.counts_LBE, shards) / (n * top_k)
    p_LPE = shard_sums(stats.prob_sum_LBE, shards) / n
    return E * jnp.mean(jnp.sum(f_LPE * p_LPE, axis=-1), axis=-1)


# model.moe.lb_loss_type: per_layer (OLMo-core) | pooled (Hugging Face), see load_balancing_loss.
LB_LOSS_TYPES = ("per_layer", "pooled")
# model.moe.lb_granularity: the counts the LB loss sees, global (every device's tokens) | local
# (each data-parallel shard's own, the losses averaged: load_balancing_loss's `shards`).
LB_GRANULARITIES = ("global", "local", "instance")


def load_balancing_loss(stats: RouterStats, top_k: int, kind: str = "per_layer",
                        shards: int = 1) -> jax.Array:
    """stats fields have a leading layer axis [L, ...]; `shards` > 1 = local granularity."""
    if kind == "per_layer":
        return jnp.sum(load_balancing_per_layer(stats, top_k, shards))
    if kind == "pooled":  # Hugging Face: f not divided by k (balanced value: k)
        E = stats.counts_LBE.shape[-1]
        total_P = jnp.sum(_shard_tokens(stats, shards)[..., 0], axis=0)  # [P], over layers
        f_PE = jnp.sum(shard_sums(stats.counts_LBE, shards), axis=0) / total_P[:, None]
        p_PE = jnp.sum(shard_sums(stats.prob_sum_LBE, shards), axis=0) / total_P[:, None]
        return E * jnp.mean(jnp.sum(f_PE * p_PE, axis=-1))
    raise ValueError(f"unknown load-balancing loss {kind!r}")


def z_loss_per_layer(stats: RouterStats) -> jax.Array:
    """[L]: mean over tokens of logsumexp(logits)^2."""
    n_L = stats.tokens_per_row * stats.z_sum_LB.shape[-1]
    return jnp.sum(stats.z_sum_LB, axis=-1) / n_L


def z_loss(stats: RouterStats) -> jax.Array:
    return jnp.sum(z_loss_per_layer(stats))


def imbalance(counts_xE: jax.Array) -> jax.Array:
    """max/mean over the last axis (1.0 = perfectly balanced; empty = 1.0)."""
    mean_x = jnp.mean(counts_xE, axis=-1)
    return jnp.max(counts_xE, axis=-1) / jnp.maximum(mean_x, 1e-9)


def rank_counts(counts_xE: jax.Array, expert_ranks: int) -> jax.Array:
    """Assignments per expert-parallel rank: rank r owns experts [r*E/R, (r+1)*E/R)."""
    E = counts_xE.shape[-1]
    if E % expert_ranks:
        raise ValueError(f"{E} experts cannot be split over {expert_ranks} expert-parallel ranks")
    return jnp.sum(counts_xE.reshape(*counts_xE.shape[:-1], expert_ranks, E // expert_ranks), -1)


def expert_imbalance(counts_LE: jax.Array) -> jax.Array:
    """Worst block's max/mean routed tokens per expert (1.0 = perfectly balanced)."""
    return jnp.max(imbalance(counts_LE))
