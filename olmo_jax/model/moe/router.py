"""Token-choice top-k routing, computed in float32.

`route` is a pure function from router logits to (weights, expert ids, probabilities);
`Router` holds the [D, E] projection (and, with auxiliary-loss-free balancing, the
per-expert `RouterBias`), applies router jitter and calls `route`.

Gating (`gating`) turns logits into gate scores g and combine weights w:
  softmax       g = softmax(logits);  w = g at the chosen experts (renormalized over the
                k when norm_topk_prob)
  sigmoid       g = sigmoid(logits) + sigmoid_eps;  w = g at the chosen experts,
                renormalized over the k when sigmoid_renorm (OLMo-core: only with
                normalize_expert_weights=1)
  topk_softmax  g = logits;           w = softmax over the k chosen logits only
`probs_SE` (what the load-balancing loss sees) is softmax(logits), or for sigmoid the
sigmoid scores normalized to sum to 1.

Selection (`routing_mode`):
  learned        the k largest of g + bias (bias: aux-loss-free balancing, selection
                 only: it never changes w and never receives a gradient);
  random         OLMo-core's random_expert_assignment: U(0, 1) noise drawn from the key
                 replaces the gate scores g everywhere: the k largest of noise + bias are
                 chosen, w is the noise there (renormalized as above), and the LB loss sees
                 the noise (normalized to sum to 1 for sigmoid). No gradient reaches the
                 router through w or the LB loss; the z-loss still sees the logits.
  random_choice  the k largest of uniform random scores drawn from the key, but w is the
                 gate computed from the router logits at those experts (gradients flow);
  uniform        balanced round-robin: assignment a = s * k + j goes to expert a mod E,
                 so every expert receives exactly S * k / E assignments when E divides
                 S * k (OLMo-core's uniform_expert_assignment).
In the random_choice and uniform modes w is the gate computed from the router logits at
the assigned experts (same formulas as above), so the router weight receives gradients
through w (and through the LB and z losses); only the choice of experts is not learned.

Group-limited routing (n_group > 1, DeepSeek-V3): the experts form n_group contiguous
groups; a group's score is the sum of its two best selection scores (its best one when a
group has a single expert); only the topk_group best groups stay eligible, the others are
masked to -inf before the top-k. It applies to the learned and both random modes, not to
topk_softmax gating (refused, as OLMo-core refuses it).
Ties resolve to the lower expert (or group) id, as jax.lax.top_k does.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from olmo_jax import shapes
from olmo_jax.model.config import MoEConfig
from olmo_jax.model.params import normal_param


class Routing(NamedTuple):
    logits_SE: jax.Array  # float32 router logits
    probs_SE: jax.Array  # float32 per-expert probabilities (sum to 1), used by the LB loss
    weights_Sk: jax.Array  # float32 combine weights of the chosen experts
    idx_Sk: jax.Array  # int32 chosen expert ids, best first


class RouterBias(nnx.Variable):
    """Per-expert selection bias of auxiliary-loss-free balancing. Not an `nnx.Param`:
    it lands in TrainState.model_state, so the optimizer never sees it and no gradient
    is taken with respect to it; the train step updates it from the routed counts
    (olmo_jax/model/moe/bias_balancing.py)."""


@shapes.check("-> S E, S E")
def gate_scores(logits_SE: jax.Array, gating: str, sigmoid_eps: float = 0.0
                ) -> tuple[jax.Array, jax.Array]:
    """(scores_SE, probs_SE): the scores experts are chosen by, and the probabilities the
    load-balancing loss uses."""
    if gating == "softmax":
        probs_SE = jax.nn.softmax(logits_SE, axis=-1)
        return probs_SE, probs_SE
    if gating == "sigmoid":
        scores_SE = jax.nn.sigmoid(logits_SE) + sigmoid_eps
        return scores_SE, scores_SE / jnp.sum(scores_SE, axis=-1, keepdims=True)
    if gating == "topk_softmax":
        return logits_SE, jax.nn.softmax(logits_SE, axis=-1)
    raise ValueError(f"unknown gating {gating!r}")


@shapes.check("-> S k")
def combine_weights(scores_SE, idx_Sk, gating: str, norm_topk_prob: bool,
                    sigmoid_renorm: bool = True) -> jax.Array:
    """The combine weights of the chosen experts from their gate scores."""
    top_Sk = jnp.take_along_axis(scores_SE, idx_Sk, axis=-1)
    if gating == "topk_softmax":
        return jax.nn.softmax(top_Sk, axis=-1)
    if norm_topk_prob if gating == "softmax" else sigmoid_renorm:
        return top_Sk / jnp.sum(top_Sk, axis=-1, keepdims=True)
    return top_Sk


@shapes.check("-> S E")
def group_limit(sel_SE: jax.Array, n_group: int, topk_group: int) -> jax.Array:
    """Masks (to -inf) the experts outside each token's topk_group best groups."""
    if n_group == 1:
        return sel_SE
    S, E = sel_SE.shape
    sel_SZe = sel_SE.reshape(S, n_group, E // n_group)
    best_SZ2, _ = jax.lax.top_k(sel_SZe, min(2, E // n_group))
    _, groups_Sz = jax.lax.top_k(jnp.sum(best_SZ2, axis=-1), topk_group)
    keep_SZ = jnp.zeros((S, n_group), bool).at[jnp.arange(S)[:, None], groups_Sz].set(True)
    return jnp.where(keep_SZ[:, :, None], sel_SZe, -jnp.inf).reshape(S, E)


def round_robin(n_tokens: int, top_k: int, num_experts: int) -> jax.Array:
    """idx_Sk of the uniform mode: assignment s * k + j goes to expert (s * k + j) mod E
    (the k experts of a token are distinct because k <= E)."""
    return (jnp.arange(n_tokens * top_k, dtype=jnp.int32) % num_experts).reshape(n_tokens, top_k)


@shapes.check("-> *")
def route(
    logits_SE: jax.Array,
    *,
    top_k: int,
    gating: str = "softmax",
    norm_topk_prob: bool = False,
    sigmoid_renorm: bool = True,
    sigmoid_eps: float = 0.0,
    weight_scale: float = 1.0,
    bias_E: jax.Array | None = None,
    n_group: int = 1,
    topk_group: int = 1,
    mode: str = "learned",
    key: jax.Array | None = None,
) -> Routing:
    logits_SE = logits_SE.astype(jnp.float32)
    S, E = logits_SE.shape
    scores_SE, probs_SE = gate_scores(logits_SE, gating, sigmoid_eps)
    if mode == "random":  # OLMo-core: the noise is the gate (weights and LB loss)
        if key is None:
            raise ValueError("routing_mode='random' needs a PRNG key")
        if gating == "topk_softmax":
            raise ValueError("routing_mode='random' needs softmax or sigmoid gating")
        scores_SE = jax.random.uniform(key, (S, E), jnp.float32)
        probs_SE = scores_SE if gating == "softmax" else \
            scores_SE / jnp.sum(scores_SE, axis=-1, keepdims=True)
    if mode == "uniform":
        idx_Sk = round_robin(S, top_k, E)
    else:
        if mode in ("learned", "random"):
            sel_SE = scores_SE
            if bias_E is not None:
                sel_SE = sel_SE + bias_E.astype(jnp.float32)
        elif mode == "random_choice":
            if key is None:
                raise ValueError("routing_mode='random_choice' needs a PRNG key")
            sel_SE = jax.random.uniform(key, (S, E), jnp.float32)
        else:
            raise ValueError(f"unknown routing mode {mode!r}")
        sel_SE = group_limit(jax.lax.stop_gradient(sel_SE), n_group, topk_group)
        _, idx_Sk = jax.lax.top_k(sel_SE, top_k)
    idx_Sk = idx_Sk.astype(jnp.int32)
    weights_Sk = combine_weights(scores_SE, idx_Sk, gating, norm_topk_prob, sigmoid_renorm)
    return Routing(logits_SE, probs_SE, weights_Sk * weight_scale, idx_Sk)


def jitter(x_SD: jax.Array, eps: float, key: jax.Array) -> jax.Array:
    """Switch/OLMo-core router jitter: x * U(1 - eps, 1 + eps), elementwise, float32."""
    noise_SD = jax.random.uniform(key, x_SD.shape, jnp.float32, 1.0 - eps, 1.0 + eps)
    return x_SD.astype(jnp.float32) * noise_SD


class Router(nnx.Module):
    def __init__(self, d_model: int, cfg: MoEConfig, init_std: float, *, rngs: nnx.Rngs):
        self.cfg = cfg
        # The expert axis of the router is replicated: every rank routes its own tokens.
        self.weight = normal_param(
            rngs.params(), (d_model, cfg.num_experts), ("embed", "router_expert"), init_std
        )
        self.bias = (
            RouterBias(jnp.zeros((cfg.num_experts,), jnp.float32),
                       out_sharding=("router_expert",), eager_sharding=False)
            if cfg.bias_rate > 0
            else None
        )

    def logits(self, x_SD: jax.Array) -> jax.Array:
        return jnp.einsum(
            "sd,de->se",
            x_SD.astype(jnp.float32),
            self.weight[...],
            precision=jax.lax.Precision.HIGHEST,
        )

    @shapes.check("-> *")
    def __call__(self, x_SD: jax.Array, rng: jax.Array | None = None) -> Routing:
        """Routes the tokens. `rng` is given in training only: it drives the router jitter
        and the random mode; without it (evaluation, sampling) there is no jitter and the
        random mode uses a fixed key."""
        m = self.cfg
        if rng is not None:
            jitter_key, route_key = jax.random.split(rng)
            if m.router_jitter > 0:
                x_SD = jitter(x_SD, m.router_jitter, jitter_key)
        else:
            route_key = jax.random.key(0)
        bias_E = None if self.bias is None else jax.lax.stop_gradient(self.bias[...])
        return route(
            self.logits(x_SD),
            top_k=m.top_k,
            gating=m.gating,
            norm_topk_prob=m.norm_topk_prob,
            sigmoid_renorm=m.sigmoid_renorm,
            sigmoid_eps=m.sigmoid_eps,
            weight_scale=m.router_weight_scale,
            bias_E=bias_E,
            n_group=m.n_group,
            topk_group=m.topk_group,
            mode=m.routing_mode,
            key=route_key,
        )
