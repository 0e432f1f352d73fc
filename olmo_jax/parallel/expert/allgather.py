"""All-gather expert-parallel dispatch (dropless): every rank gathers all tokens of its
`expert` group, applies its local experts to the assignments routed to them, and the
partial outputs are reduce-scattered back to the tokens' owners.

Each rank lays the gathered assignments out for its El local experts, the assignments of
other ranks' experts going to a trailing group that is computed but weighted zero (a
static buffer sized for the worst case: every assignment routed here). Combine applies
the router weights in float32 before the reduce-scatter.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from olmo_jax.model.moe import dispatch, payload
from olmo_jax.model.moe.experts import resolve_gmm_impl
from olmo_jax.model.moe.layer import block_size
from olmo_jax.model.moe.mxfp8_experts import expert_ffns
from olmo_jax.model.moe.tiled import TILE_MULTIPLE


def allgather_dispatch(x_SD, routing, experts, cfg, dtype, *, axis: str):
    ep = jax.lax.axis_size(axis)
    El = cfg.num_experts // ep
    me = jax.lax.axis_index(axis)
    gather = lambda a: jax.lax.all_gather(a, axis, axis=0, tiled=True)  # noqa: E731
    x_GD = payload.transfer(x_SD.astype(dtype), gather, cfg.precision)
    idx_Gk, weights_Gk = gather(routing.idx_Sk), gather(routing.weights_Sk)
    local_Gk = idx_Gk // El == me
    lidx_Gk = jnp.where(local_Gk, idx_Gk - me * El, El)  # El = not mine
    w = experts.weights(dtype)
    impl = resolve_gmm_impl(cfg.gmm_impl, dtype, cfg.precision, (x_SD.shape[-1], cfg.expert_hidden))
    ffn = expert_ffns(cfg, impl)
    if impl == "tiled":  # the trailing group (not mine) is never computed: rows stay zero
        plan = dispatch.padded_plan(lidx_Gk, El + 1, TILE_MULTIPLE)
        y_PD = ffn.tiled(dispatch.gather_rows(x_GD, plan), plan.group_sizes_E[:El], *w)
    elif impl == "einsum":
        plan, owner_B = dispatch.blocked_plan(lidx_Gk, El + 1, block_size(lidx_Gk.size, El + 1))
        y_PD = ffn.blocked(dispatch.gather_rows(x_GD, plan), jnp.minimum(owner_B, El - 1), *w)
    else:
        plan = dispatch.sorted_plan(lidx_Gk, El + 1)
        y_PD = ffn.ragged(dispatch.gather_rows(x_GD, plan), plan.group_sizes_E[:El], *w)
    y_GD = dispatch.combine_rows(y_PD, plan._replace(keep_Sk=local_Gk), weights_Gk)
    y_SD = jax.lax.psum_scatter(y_GD, axis, scatter_dimension=0, tiled=True)
    return y_SD, jnp.zeros((), jnp.float32)

