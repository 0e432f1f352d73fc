"""Rowwise expert-parallel dispatch: fixed receive slots and one dense all_to_all each way.

Every sender computes, on the device, where each (token, choice) assignment goes: the
destination rank r = e // El of its expert e and the row inside r's receive buffer. The
receive buffer of a rank is [El, ep, C, D]: grouped by local expert j, then by sender s,
C slots per (sender, local expert), so the row of an assignment is
    (j * ep + s) * C + rank,
`rank` being its position among the sender's assignments to expert e in choice-major
order (`dispatch.rank_within_expert`: every token's first choice, in token order, before
any second choice). Assignments with rank >= C are dropped and counted. The sender
scatters its tokens into a [El, ep, C, D] send buffer in exactly that order, so a single
`all_to_all` over `expert` delivers each rank a buffer already grouped by local expert
(`buffer.Slots(El, ep * C)`); the MoE layer runs the experts on it (one batched matmul),
with no permutation on the receiver. The combine is the mirror image (all_to_all back,
then the sender gathers each assignment's row and applies the router weight in float32).
With `model.moe.precision = "mxfp8"` the dispatch payload travels as packed MXFP8 rows
(`olmo_jax.model.moe.payload`); the combine travels in the compute dtype.

Capacity: C = sizing.capacity(S, k, E, capacity_factor) = ceil(capacity_factor * S * k /
E) slots per (sender, expert), i.e. a rank
accepts El * C = ceil(capacity_factor * S * k / ep) rows from each sender (exactly when
E divides capacity_factor * S * k); S is the sender's token count. capacity_factor >=
E / k can never drop (an expert gets at most one assignment per token).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from olmo_jax import shapes
from olmo_jax.model.moe import dispatch, payload, sizing
from olmo_jax.model.moe.buffer import Dispatched, Slots


def buffer_rows(n_tokens: int, cfg, padding: str, ep: int, capacity_factor: float) -> int:
    """Receive rows of a rank: El local experts x ep senders x C slots (fixed slots:
    `padding`, the dropless runs' requirement, does not apply)."""
    return cfg.num_experts * sizing.capacity(n_tokens, cfg.top_k, cfg.num_experts, capacity_factor)


def destination_expert(idx_Sk: jax.Array, num_experts: int, ep: int) -> jax.Array:
    """Relabel global expert e = r * El + j as j * ep + r, so that a capacity plan over the
    relabelled ids lays rows out as [local expert j, destination rank r, slot]. Ranks
    within an expert do not depend on the labels."""
    El = num_experts // ep
    return (idx_Sk % El) * ep + idx_Sk // El


def rowwise_plan(idx_Sk: jax.Array, num_experts: int, ep: int, capacity: int):
    """Send-buffer plan (a dispatch.BufferPlan): row (j * ep + r) * C + rank, kept iff
    rank < C (choice-major)."""
    relabelled_Sk = destination_expert(idx_Sk, num_experts, ep)
    return dispatch.capacity_plan(relabelled_Sk, num_experts, capacity)


@shapes.check("routing.*", "-> *")
def rowwise_dispatch(x_SD, routing, cfg, padding: str, *, capacity_factor: float,
                     axis: str) -> Dispatched:
    """Receive buffer [El * ep * C, D], grouped by local expert: Slots(El, ep * C)."""
    ep = jax.lax.axis_size(axis)
    E, k = cfg.num_experts, cfg.top_k
    El = E // ep
    S, D = x_SD.shape
    C = sizing.capacity(S, k, E, capacity_factor)
    plan = rowwise_plan(routing.idx_Sk, E, ep, C)
    send_RD = dispatch.gather_rows(x_SD, plan)  # rows [El, ep, C]

    def exchange(a_YJ):  # [El, dest rank, C, X] -> [El, sender, C, X], any payload width X
        return jax.lax.all_to_all(a_YJ.reshape(El, ep, C, -1), axis, 1, 1).reshape(El * ep * C, -1)

    # The payload travels in model.moe.precision (MXFP8: 33/64 of bf16's bytes).
    recv_RD = payload.transfer(send_RD, exchange, cfg.precision)

    def combine(y_RD):
        back = jax.lax.all_to_all(y_RD.reshape(El, ep, C, D), axis, 1, 1)  # [El, expert rank, C, D]
        return dispatch.combine_rows(back.reshape(E * C, D), plan, routing.weights_Sk)

    return Dispatched(recv_RD, Slots(El, ep * C), combine,
                      jnp.sum(~plan.keep_Sk).astype(jnp.float32))
