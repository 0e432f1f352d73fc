"""All-gather expert-parallel dispatch (dropless): every rank gathers all tokens of its
`expert` group and lays out the assignments routed to its local experts (`buffer.Runs`;
the MoE layer runs the experts on them); the combine reduce-scatters the partial outputs
back to the tokens' owners.

Each rank lays the gathered assignments out for its El local experts, the assignments of
other ranks' experts going to a trailing run outside every group (the FFN leaves its rows
zero, or the combine weights them zero; a static buffer sized for the worst case,
`buffer_rows`: every assignment routed here). Combine applies the router weights in
float32 before the reduce-scatter.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from olmo_jax import shapes
from olmo_jax.model.moe import dispatch, payload, sizing
from olmo_jax.model.moe.buffer import Dispatched, Runs


def buffer_rows(n_tokens: int, cfg, padding: str, ep: int) -> int:
    """Rows of a rank's buffer: the ep ranks' assignments in El + 1 runs, sized for the
    worst case (every one of them routed here), each run padded as `padding` says."""
    groups, n = cfg.num_experts // ep + 1, ep * n_tokens * cfg.top_k
    return sizing.runs_rows(n, groups, sizing.run_multiple(padding, n, groups))


@shapes.check("routing.*", "-> *")
def allgather_dispatch(x_SD, routing, cfg, padding: str, *, axis: str) -> Dispatched:
    """Buffer: Runs over the El local experts; the trailing run (other ranks' experts)
    is outside every group, so the FFN leaves it zero or its rows are weighted zero."""
    ep = jax.lax.axis_size(axis)
    El = cfg.num_experts // ep
    me = jax.lax.axis_index(axis)
    gather = lambda a: jax.lax.all_gather(a, axis, axis=0, tiled=True)  # noqa: E731
    x_YD = payload.transfer(x_SD, gather, cfg.precision)
    idx_Yk, weights_Yk = gather(routing.idx_Sk), gather(routing.weights_Sk)
    local_Yk = idx_Yk // El == me
    lidx_Yk = jnp.where(local_Yk, idx_Yk - me * El, El)  # El = not mine
    multiple = sizing.run_multiple(padding, lidx_Yk.size, El + 1)
    plan = dispatch.runs_plan(lidx_Yk, El + 1, multiple)

    def combine(y_RD):
        y_YD = dispatch.combine_rows(y_RD, plan._replace(keep_Sk=local_Yk), weights_Yk)
        return jax.lax.psum_scatter(y_YD, axis, scatter_dimension=0, tiled=True)

    # Balanced routing: 1/ep of the gathered ep x S x k rows are this rank's experts'.
    runs = Runs(plan.group_sizes_E[:El], multiple, balanced_rows=routing.idx_Sk.size)
    return Dispatched(dispatch.gather_rows(x_YD, plan), runs, combine, jnp.zeros((), jnp.float32))
