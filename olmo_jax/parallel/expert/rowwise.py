"""Rowwise expert-parallel dispatch: fixed receive slots and one dense all_to_all each way.

Every sender computes, on the device, where each (token, choice) assignment goes: the
destination rank r = e // El of its expert e = r * El + j (j: the rank's local expert)
and its slot. The sender's send buffer is [ep, El, C, D], destination-major: C slots per
(destination rank, local expert), so the row of an assignment is
    e * C + rank = (r * El + j) * C + rank,
`rank` being its position among the sender's assignments to expert e in choice-major
order (`dispatch.rank_within_expert`: every token's first choice, in token order, before
any second choice). Assignments with rank >= C are dropped and counted. One `all_to_all`
over `expert` (split and concatenated on the leading, destination / sender axis: each
rank's rows are one contiguous block, so no transpose is needed on either side) delivers
each rank a [ep, El, C, D] buffer, sender-major: `buffer.Slots(El, ep * C, senders=ep)`,
local expert j owning slot j of every sender. The Pallas grouped matmuls read it in place;
other expert FFNs transpose it to group-major order (olmo_jax/model/moe/ffn.py). The
combine is the mirror image (all_to_all back, then the sender gathers each assignment's
row and applies the router weight in float32).
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


def rowwise_plan(idx_Sk: jax.Array, num_experts: int, capacity: int):
    """Send-buffer plan (a dispatch.BufferPlan): row e * C + rank = (r * El + j) * C + rank,
    destination-major, kept iff rank < C (choice-major)."""
    return dispatch.capacity_plan(idx_Sk, num_experts, capacity)


@shapes.check("routing.*", "-> *")
def rowwise_dispatch(x_SD, routing, cfg, padding: str, *, capacity_factor: float,
                     axis: str) -> Dispatched:
    """Receive buffer [ep * El * C, D], sender-major: Slots(El, ep * C, senders=ep)."""
    ep = jax.lax.axis_size(axis)
    E, k = cfg.num_experts, cfg.top_k
    El = E // ep
    S, D = x_SD.shape
    C = sizing.capacity(S, k, E, capacity_factor)
    plan = rowwise_plan(routing.idx_Sk, E, C)
    send_RD = dispatch.gather_rows(x_SD, plan)  # rows [ep, El, C]

    def exchange(a_RX):  # [dest rank, El * C, X] -> [sender, El * C, X], any payload width X
        return jax.lax.all_to_all(a_RX.reshape(ep, El * C, -1), axis, 0, 0).reshape(E * C, -1)

    # The payload travels in model.moe.precision (MXFP8: 33/64 of bf16's bytes).
    recv_RD = payload.transfer(send_RD, exchange, cfg.precision)

    def combine(y_RD):  # [sender, El * C, D] -> [expert rank, El * C, D]: the send rows
        back = jax.lax.all_to_all(y_RD.reshape(ep, El * C, D), axis, 0, 0)
        return dispatch.combine_rows(back.reshape(E * C, D), plan, routing.weights_Sk)

    return Dispatched(recv_RD, Slots(El, ep * C, senders=ep), combine,
                      jnp.sum(~plan.keep_Sk).astype(jnp.float32))
