"""Auxiliary-loss-free load balancing (DeepSeek-V3, OLMo-core): the update of the
per-expert `RouterBias` after each optimizer step.

    bias_i += rate * sign(mean_j count_j - count_i)

Under-loaded experts get a larger bias (chosen more often), over-loaded ones a smaller.
`counts_LE` are the step's routed assignments per MoE layer and expert, summed over the
whole global batch (every data and expert rank, every micro-batch): inside the jitted
train step the arrays are global, so a plain sum is the all-reduced count. The bias
shifts only which experts are selected (router.py), never the combine weights, and is
not an `nnx.Param`, so it has no gradient and no optimizer state; it lives in
TrainState.model_state and is checkpointed with it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from olmo_jax.model.moe.router import RouterBias


def bias_update(bias_LE: jax.Array, counts_LE: jax.Array, rate: float) -> jax.Array:
    mean_L1 = jnp.mean(counts_LE, axis=-1, keepdims=True)
    return bias_LE + rate * jnp.sign(mean_L1 - counts_LE).astype(bias_LE.dtype)


def update_router_bias(model_state: nnx.State, counts_LE: jax.Array, rate: float) -> nnx.State:
    """Applies `bias_update` to the model's stacked [L, E] RouterBias (MoE blocks in model
    order, as counts_LE). A model without a RouterBias is returned unchanged."""

    def update(v):
        if not isinstance(v, RouterBias):
            return v
        if v.shape != counts_LE.shape:
            raise ValueError(f"RouterBias {v.shape} does not match the counts {counts_LE.shape}")
        return v.replace(bias_update(v[...], counts_LE, rate))

    return jax.tree.map(update, model_state, is_leaf=lambda x: isinstance(x, nnx.Variable))
