"""The MoE feed-forward block: route in float32, dispatch to an expert-grouped buffer,
run the experts, combine with the router weights in float32, add shared experts.

Dispatch is pluggable: `local_dispatch` (single device, or any GSPMD sharding) is the
default; `olmo_jax.parallel.expert` supplies expert-parallel dispatchers with the same
signature: dispatcher(x_SD, routing, experts, moe_cfg, dtype) -> (y_SD float32, dropped).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from olmo_jax.model.config import MoEConfig, TransformerConfig
from olmo_jax.model.mlp import MLP
from olmo_jax.model.moe import dispatch
from olmo_jax.model.moe.experts import Experts, resolve_gmm_impl
from olmo_jax.model.moe.losses import RouterStats, router_stats
from olmo_jax.model.moe.mxfp8_experts import expert_ffns
from olmo_jax.model.moe.router import Router, Routing
from olmo_jax.model.moe.tiled import TILE_MULTIPLE

Dispatcher = Callable[..., tuple[jax.Array, jax.Array]]


def expert_capacity(n_tokens: int, top_k: int, num_experts: int, capacity_factor: float) -> int:
    """Rows per expert buffer: ceil(capacity_factor * tokens * k / E)."""
    return max(1, math.ceil(capacity_factor * n_tokens * top_k / num_experts))


def block_size(n_assignments: int, num_experts: int) -> int:
    """Rows per block of the blocked dropless layout: large enough for efficient matmuls,
    small enough that padding (at most one block per expert) stays a small fraction."""
    target = max(8, n_assignments // (4 * num_experts))
    return min(256, 1 << (target.bit_length() - 1))


def local_dispatch(x_SD, routing: Routing, experts: Experts, cfg: MoEConfig, dtype):
    """All experts on this device (or GSPMD-sharded arrays). Returns (y_SD f32, dropped)."""
    S = x_SD.shape[0]
    E = cfg.num_experts
    w = experts.weights(dtype)
    x_SD = x_SD.astype(dtype)
    impl = resolve_gmm_impl(cfg.gmm_impl, dtype, cfg.precision, (x_SD.shape[-1], cfg.expert_hidden))
    ffn = expert_ffns(cfg, impl)  # per layout, in cfg.precision
    if cfg.capacity_factor > 0:
        C = expert_capacity(S, cfg.top_k, E, cfg.capacity_factor)
        plan = dispatch.capacity_plan(routing.idx_Sk, E, C)
        x_PD = dispatch.gather_rows(x_SD, plan)
        if impl in ("ragged_dot", "pallas"):  # capacity buffers: tiled runs the batched einsum
            y_PD = ffn.ragged(x_PD, jnp.full((E,), C, jnp.int32), *w)
        else:
            y_PD = ffn.batched(x_PD.reshape(E, C, -1), *w).reshape(E * C, -1)
        dropped = jnp.sum(~plan.keep_Sk).astype(jnp.float32)
    elif impl in ("ragged_dot", "pallas"):
        plan = dispatch.sorted_plan(routing.idx_Sk, E)
        y_PD = ffn.ragged(dispatch.gather_rows(x_SD, plan), plan.group_sizes_E, *w)
        dropped = jnp.zeros((), jnp.float32)
    elif impl == "tiled":
        plan = dispatch.padded_plan(routing.idx_Sk, E, TILE_MULTIPLE)
        y_PD = ffn.tiled(dispatch.gather_rows(x_SD, plan), plan.group_sizes_E, *w)
        dropped = jnp.zeros((), jnp.float32)
    elif impl == "einsum":
        b = block_size(routing.idx_Sk.size, E)
        plan, block_expert_B = dispatch.blocked_plan(routing.idx_Sk, E, b)
        y_PD = ffn.blocked(dispatch.gather_rows(x_SD, plan), block_expert_B, *w)
        dropped = jnp.zeros((), jnp.float32)
    else:
        raise ValueError(f"unknown gmm_impl {cfg.gmm_impl!r}")
    return dispatch.combine_rows(y_PD, plan, routing.weights_Sk), dropped


class MoELayer(nnx.Module):
    def __init__(self, cfg: TransformerConfig, *, rngs: nnx.Rngs, dispatcher: Dispatcher | None = None):
        m = cfg.moe
        self.cfg = m
        self.dtype = cfg.compute_dtype
        self.router = Router(cfg.d_model, m, cfg.init_std, rngs=rngs)
        self.experts = Experts(m.num_experts, cfg.d_model, m.expert_hidden, cfg.init_std, rngs=rngs)
        # n shared SwiGLU experts of hidden h, summed, are exactly one SwiGLU of hidden n*h.
        self.shared = (
            MLP(cfg.d_model, m.n_shared_experts * m.shared_hidden, cfg.init_std, self.dtype, rngs=rngs)
            if m.n_shared_experts
            else None
        )
        self.dispatcher = dispatcher or local_dispatch

    def __call__(self, x_BTD: jax.Array, rng: jax.Array | None = None
                 ) -> tuple[jax.Array, RouterStats]:
        """`rng`: a key in training (router jitter, random routing), None otherwise."""
        B, T, D = x_BTD.shape
        m = self.cfg
        x_SD = x_BTD.reshape(B * T, D)
        with jax.named_scope("router"):  # scopes name the HLO ops (olmo_jax/planner)
            routing = self.router(x_SD, rng)
        with jax.named_scope("routed_experts"):
            y_SD, dropped = self.dispatcher(x_SD, routing, self.experts, m, self.dtype)
        y_SD = y_SD.astype(self.dtype)
        if self.shared is not None:
            with jax.named_scope("shared_experts"):
                y_SD = y_SD + self.shared(x_SD)
        stats = router_stats(routing.probs_SE, routing.logits_SE, routing.idx_Sk, m.num_experts,
                             dropped, rows=B)
        return y_SD.reshape(B, T, D), stats
