"""The routing metrics of one train step, per MoE block and aggregated (worst block).

From the step's per-layer routing parts (summed over micro-batches):
  expert_imbalance        max/mean routed assignments per expert over the global batch
  expert_imbalance_local  the same within each data-parallel shard of the batch; worst shard
  rank_imbalance          max/mean assignments per expert-parallel rank (rank r owns experts
                          [r*E/R, (r+1)*E/R)): what sets the step time. It can rise while
                          the LB loss falls ("token gerrymandering"), so both are reported
  lb_loss, z_loss         per block: OLMo-core's per-layer LB loss and the z-loss
  dropped_frac            assignments dropped at capacity / routed assignments
Per-block keys are `<name>/block<i>` with i the block's index in the model (dense blocks
first). `expert_counts` ([L, E], not a scalar) is for the optional counts file.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from olmo_jax.model.moe.losses import imbalance, rank_counts

PER_BLOCK = ("expert_imbalance", "expert_imbalance_local", "rank_imbalance", "lb_loss",
             "z_loss", "dropped_frac")


def routing_metrics(parts, *, expert_ranks: int = 1, first_block: int = 0) -> dict[str, jax.Array]:
    """`parts`: the step's LossParts (lb_loss, z_loss, lb_L, z_L, counts_LPE, dropped_L)."""
    counts_LPE = parts.counts_LPE
    L, _, E = counts_LPE.shape
    out = {"lb_loss": parts.lb_loss, "z_loss": parts.z_loss}
    if L == 0:
        one, zero = jnp.ones((), jnp.float32), jnp.zeros((), jnp.float32)
        out |= {"expert_imbalance": one, "expert_imbalance_local": one, "rank_imbalance": one,
                "dropped_frac": zero, "expert_counts": jnp.zeros((0, E), jnp.float32)}
        return out
    counts_LE = jnp.sum(counts_LPE, axis=1)
    routed_L = jnp.maximum(jnp.sum(counts_LE, axis=-1), 1.0)
    block = {
        "expert_imbalance": imbalance(counts_LE),
        "expert_imbalance_local": jnp.max(imbalance(counts_LPE), axis=-1),
        "rank_imbalance": imbalance(rank_counts(counts_LE, expert_ranks)),
        "lb_loss": parts.lb_L,
        "z_loss": parts.z_L,
        "dropped_frac": parts.dropped_L / routed_L,
    }
    for name in PER_BLOCK:
        for l in range(L):
            out[f"{name}/block{first_block + l}"] = block[name][l]
    for name in ("expert_imbalance", "expert_imbalance_local", "rank_imbalance"):
        out[name] = jnp.max(block[name])
    out["dropped_frac"] = jnp.sum(parts.dropped_L) / jnp.sum(routed_L)
    out["expert_counts"] = counts_LE
    return out
