"""The MoE feed-forward block: route in float32, dispatch to an expert-grouped buffer,
run the experts, combine with the router weights in float32, add shared experts.

Dispatch only moves tokens, and is pluggable: a backend
    backend(x_SD, routing, moe_cfg, padding) -> buffer.Dispatched
returns the buffer the experts run on, its group layout and the combine (see
olmo_jax/model/moe/buffer.py); `routed_experts` runs the expert FFN once over whatever
buffer it produced (olmo_jax/model/moe/ffn.py). `local_dispatch` (single device, or any
GSPMD sharding) is the default; `olmo_jax.parallel.expert` supplies the expert-parallel
backends; `padding` is how the expert FFN wants each dropless run padded
(kernels.select.run_padding of the grouped matmul).

The grouped matmul is `model.moe.gmm_impl` as given: a model built from a parallel plan's
`plan.model_cfg` has it resolved for the mesh's target (olmo_jax/kernels/select.py). A
model used without a plan (research code, tests) may leave it "auto": it is then resolved
by the same table for the default device, where such a model's arrays live.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from olmo_jax import shapes
from olmo_jax.kernels import select
from olmo_jax.model.config import MoEConfig, TransformerConfig
from olmo_jax.model.mlp import MLP
from olmo_jax.model.moe import dispatch, sizing
from olmo_jax.model.moe.buffer import Dispatched, Runs, Slots
from olmo_jax.model.moe.experts import Experts
from olmo_jax.model.moe.ffn import expert_ffn
from olmo_jax.model.moe.losses import RouterStats, router_stats
from olmo_jax.model.moe.router import Router, Routing

Dispatcher = Callable[..., Dispatched]


@shapes.check("routing.*", "-> *")
def local_dispatch(x_SD, routing: Routing, cfg: MoEConfig, padding: str) -> Dispatched:
    """All experts on this device (or GSPMD-sharded arrays): capacity buffers when
    cfg.capacity_factor > 0, else dropless runs padded as `padding` says."""
    S = x_SD.shape[0]
    E = cfg.num_experts
    if cfg.capacity_factor > 0:
        C = sizing.capacity(S, cfg.top_k, E, cfg.capacity_factor)
        plan = dispatch.capacity_plan(routing.idx_Sk, E, C)
        layout = Slots(E, C)
        dropped = jnp.sum(~plan.keep_Sk).astype(jnp.float32)
    else:
        multiple = sizing.run_multiple(padding, routing.idx_Sk.size, E)
        plan = dispatch.runs_plan(routing.idx_Sk, E, multiple)
        layout = Runs(plan.group_sizes_E, multiple, balanced_rows=routing.idx_Sk.size)  # all of them
        dropped = jnp.zeros((), jnp.float32)
    return Dispatched(dispatch.gather_rows(x_SD, plan), layout,
                      lambda y_RD: dispatch.combine_rows(y_RD, plan, routing.weights_Sk), dropped)


def gmm_impl(cfg: MoEConfig, dtype, d_model: int) -> str:
    """The grouped matmul the layer runs: cfg.gmm_impl, or for "auto" (no plan resolved it)
    the table's choice for the default device (module docstring)."""
    if cfg.gmm_impl != "auto":
        return cfg.gmm_impl
    return select.resolve_gmm_impl("auto", select.local_target(), dtype, cfg.precision,
                                   (d_model, cfg.expert_hidden))


@shapes.check("routing.*", "-> S D, _")
def routed_experts(x_SD, routing: Routing, experts, cfg: MoEConfig, dtype,
                   dispatcher: Dispatcher | None = None, mxfp8_impl: str = "auto"
                   ) -> tuple[jax.Array, jax.Array]:
    """(y_SD float32, dropped): dispatch x_SD (in `dtype`), the expert FFN over the
    buffer, combine. `experts`: weights(dtype) -> (w_gate, w_up, w_down) of the experts
    the buffer's groups are (all E, or inside shard_map this rank's); `mxfp8_impl`:
    model.mxfp8_gemm_impl (olmo_jax/model/mxfp8_gemm.py)."""
    impl = gmm_impl(cfg, dtype, x_SD.shape[-1])
    d = (dispatcher or local_dispatch)(x_SD.astype(dtype), routing, cfg, select.run_padding(impl))
    y_RD = expert_ffn(d.x_RD, d.layout, experts.weights(dtype), cfg, impl, mxfp8_impl)
    return d.combine(y_RD), d.dropped


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
        self.dispatcher = dispatcher
        self.mxfp8_impl = cfg.mxfp8_gemm_impl  # resolved by the plan (model/mxfp8_gemm.py)

    @shapes.check("-> B T D, _")
    def __call__(self, x_BTD: jax.Array, rng: jax.Array | None = None
                 ) -> tuple[jax.Array, RouterStats]:
        """`rng`: a key in training (router jitter, random routing), None otherwise."""
        B, T, D = x_BTD.shape
        m = self.cfg
        x_SD = x_BTD.reshape(B * T, D)
        with jax.named_scope("router"):  # scopes name the HLO ops (olmo_jax/planner)
            routing = self.router(x_SD, rng)
        with jax.named_scope("routed_experts"):
            y_SD, dropped = routed_experts(x_SD, routing, self.experts, m, self.dtype,
                                           self.dispatcher, self.mxfp8_impl)
        y_SD = y_SD.astype(self.dtype)
        if self.shared is not None:
            with jax.named_scope("shared_experts"):
                y_SD = y_SD + self.shared(x_SD)
        stats = router_stats(routing.probs_SE, routing.logits_SE, routing.idx_Sk, m.num_experts,
                             dropped, rows=B)
        return y_SD.reshape(B, T, D), stats
