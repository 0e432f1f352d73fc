"""Token-choice top-k routing, computed in float32.

`route` is a pure function from router logits to (weights, expert ids, probabilities);
`Router` holds the [D, E] projection. Gating modes:
  softmax       probs = softmax(logits); weights = top-k probs (optionally renormalized)
  sigmoid       scores = sigmoid(logits); weights = top-k scores renormalized over the k
  topk_softmax  weights = softmax over the k selected logits only
Ties in top-k resolve to the lower expert id (jax.lax.top_k).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from olmo_jax.model.params import normal_param


class Routing(NamedTuple):
    logits_SE: jax.Array  # float32 router logits
    probs_SE: jax.Array  # float32 per-expert probabilities (sum to 1), used by the LB loss
    weights_Sk: jax.Array  # float32 combine weights of the chosen experts
    idx_Sk: jax.Array  # int32 chosen expert ids, best first


def route(
    logits_SE: jax.Array,
    *,
    top_k: int,
    gating: str = "softmax",
    norm_topk_prob: bool = False,
    weight_scale: float = 1.0,
) -> Routing:
    logits_SE = logits_SE.astype(jnp.float32)
    if gating == "softmax":
        probs_SE = jax.nn.softmax(logits_SE, axis=-1)
        weights_Sk, idx_Sk = jax.lax.top_k(probs_SE, top_k)
        if norm_topk_prob:
            weights_Sk = weights_Sk / jnp.sum(weights_Sk, axis=-1, keepdims=True)
    elif gating == "sigmoid":
        scores_SE = jax.nn.sigmoid(logits_SE)
        probs_SE = scores_SE / jnp.sum(scores_SE, axis=-1, keepdims=True)
        top_Sk, idx_Sk = jax.lax.top_k(scores_SE, top_k)
        weights_Sk = top_Sk / jnp.sum(top_Sk, axis=-1, keepdims=True)
    elif gating == "topk_softmax":
        probs_SE = jax.nn.softmax(logits_SE, axis=-1)
        top_logits_Sk, idx_Sk = jax.lax.top_k(logits_SE, top_k)
        weights_Sk = jax.nn.softmax(top_logits_Sk, axis=-1)
    else:
        raise ValueError(f"unknown gating {gating!r}")
    return Routing(logits_SE, probs_SE, weights_Sk * weight_scale, idx_Sk.astype(jnp.int32))


class Router(nnx.Module):
    def __init__(self, d_model: int, num_experts: int, init_std: float, *, rngs: nnx.Rngs):
        # The expert axis of the router is replicated: every rank routes its own tokens.
        self.weight = normal_param(
            rngs.params(), (d_model, num_experts), ("embed", "router_expert"), init_std
        )

    def logits(self, x_SD: jax.Array) -> jax.Array:
        return jnp.einsum(
            "sd,de->se",
            x_SD.astype(jnp.float32),
            self.weight[...],
            precision=jax.lax.Precision.HIGHEST,
        )
