"""Ragged (dropless) expert-parallel dispatch: every assignment is delivered, through
`ragged_all_to_all` with offsets computed on the device.

Sender: its assignments sorted by global expert (`dispatch.sorted_plan`), so the rows for
expert e form one slice, and slice e goes to rank e // El. The per-(sender, expert)
counts are all-gathered over `expert` (ep x E integers), from which every rank computes
the same layout of every receive buffer: grouped by local expert j, then by sender s,

    output_offset(s, e) = base(e) + sum_{s' < s} count(s', e),
    base(e) = sum over the owner's earlier local experts j' < j of total(j')
    (each total rounded up to `sizing.run_multiple` rows: the blocked matmul's blocks,
    the tiled loop's 8 rows, or 1 for a grouped GEMM).

So a rank receives its experts' rows contiguous and grouped (`buffer.Runs`), and the MoE
layer runs the experts on them with no permutation; the combine is the exact reverse
ragged_all_to_all. The receive buffer (`buffer_rows`) is sized for the worst case (every
assignment of the ep senders to one rank): static shapes, never a host sync.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from olmo_jax import shapes
from olmo_jax.kernels import vma
from olmo_jax.model.moe import dispatch, payload, sizing
from olmo_jax.model.moe.buffer import Dispatched, Runs
from olmo_jax.parallel.expert.ragged_a2a import ragged_all_to_all


class RaggedLayout(NamedTuple):
    """Arguments of the two ragged_all_to_alls (dispatch `fwd_*`, combine `bwd_*`) and the
    receiver's per-local-expert row counts."""
    fwd_input_offsets: jax.Array  # [E] slice e = my rows for expert e
    fwd_send_sizes: jax.Array
    fwd_output_offsets: jax.Array
    fwd_recv_sizes: jax.Array  # [ep * El] slice s * El + j = rows from sender s for my expert j
    bwd_input_offsets: jax.Array  # [ep * El] the same slices, sent back
    bwd_send_sizes: jax.Array
    bwd_output_offsets: jax.Array
    bwd_recv_sizes: jax.Array  # [E]
    group_sizes_E: jax.Array  # rows per local expert (before padding its run)


def ragged_layout(counts_E: jax.Array, ep: int, block: int, axis: str) -> RaggedLayout:
    E = counts_E.shape[0]
    El = E // ep
    me = jax.lax.axis_index(axis)
    counts_PE = jax.lax.all_gather(counts_E, axis)  # [sender, E]
    totals_E = jnp.sum(counts_PE, axis=0)
    padded_PE = ((totals_E + block - 1) // block * block).reshape(ep, El)
    base_E = (jnp.cumsum(padded_PE, axis=1) - padded_PE).reshape(E)
    before_PE = jnp.cumsum(counts_PE, axis=0) - counts_PE  # rows from lower-ranked senders
    starts_PE = jnp.cumsum(counts_PE, axis=1) - counts_PE  # each sender's sorted-buffer starts
    mine = lambda a: jax.lax.dynamic_slice_in_dim(a, me * El, El, axis=a.ndim - 1)  # noqa: E731
    in_recv_PE = mine(base_E)[None, :] + mine(before_PE)
    return RaggedLayout(
        fwd_input_offsets=starts_PE[me],
        fwd_send_sizes=counts_E,
        fwd_output_offsets=base_E + before_PE[me],
        fwd_recv_sizes=mine(counts_PE).reshape(-1),
        bwd_input_offsets=in_recv_PE.reshape(-1),
        bwd_send_sizes=mine(counts_PE).reshape(-1),
        bwd_output_offsets=mine(starts_PE).reshape(-1),
        bwd_recv_sizes=counts_E,
        group_sizes_E=mine(totals_E),
    )


def buffer_rows(n_tokens: int, cfg, padding: str, ep: int) -> int:
    """Receive rows of a rank, for the worst case: every assignment of the ep senders
    routed to its El experts, each local expert's run padded as `padding` says."""
    El, n = cfg.num_experts // ep, ep * n_tokens * cfg.top_k
    return sizing.runs_rows(n, El, sizing.run_multiple(padding, n, El))


@shapes.check("routing.*", "-> *")
def ragged_dispatch(x_SD, routing, cfg, padding: str, *, axis: str,
                    emulate: bool | None = None) -> Dispatched:
    """Receive buffer grouped by local expert: Runs(rows per local expert, multiple)."""
    ep = jax.lax.axis_size(axis)
    E = cfg.num_experts
    El = E // ep
    N = x_SD.shape[0] * cfg.top_k
    multiple = sizing.run_multiple(padding, ep * N, El)
    rows = buffer_rows(x_SD.shape[0], cfg, padding, ep)

    plan = dispatch.sorted_plan(routing.idx_Sk, E)
    send_YD = dispatch.gather_rows(x_SD, plan)
    lay = ragged_layout(plan.group_sizes_E, ep, multiple, axis)
    a2a = lambda *args: ragged_all_to_all(*args, axis_name=axis, emulate=emulate)  # noqa: E731

    def buffer(n_rows, like_J):
        """The receive buffer, typed varying like the rows sent into it: ragged_all_to_all
        types its result like this operand, and an invariant one would make the backward
        pass psum the receive buffer's cotangent over the devices (different tokens)."""
        return vma.like(jnp.zeros((n_rows, like_J.shape[-1]), like_J.dtype), like_J)

    def exchange(a_YJ, *offsets):  # any payload width X (the MXFP8 payload: packed uint8 rows)
        return a2a(a_YJ, buffer(rows, a_YJ), *offsets)

    recv_RD = payload.transfer(send_YD, exchange, cfg.precision, lay.fwd_input_offsets,
                               lay.fwd_send_sizes, lay.fwd_output_offsets, lay.fwd_recv_sizes)

    def combine(y_RD):
        back_YD = a2a(y_RD, buffer(N, y_RD), lay.bwd_input_offsets,
                      lay.bwd_send_sizes, lay.bwd_output_offsets, lay.bwd_recv_sizes)
        return dispatch.combine_rows(back_YD, plan, routing.weights_Sk)

    return Dispatched(recv_RD, Runs(lay.group_sizes_E, multiple, balanced_rows=N), combine,
                      jnp.zeros((), jnp.float32))
