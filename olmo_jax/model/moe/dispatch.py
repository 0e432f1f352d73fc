"""Dispatch and combine as pure functions: (token, choice) assignments -> rows of an
expert-grouped buffer -> back.

Every layout answers one question per assignment: which row of a static-size buffer
does it go to, and is it kept? Rows of the buffer belong to experts in order (expert 0's
rows first). Four layouts:
  sorted    dropless, R = S*k rows, expert e owns a contiguous run of group_sizes[e] rows
            (for jax.lax.ragged_dot / grouped-matmul kernels);
  padded    sorted, each expert's run padded with zero rows to a multiple of 8 (the
            tiled per-expert GEMM loop on CPU, olmo_jax/model/moe/tiled.py);
  capacity  E * C rows, expert e owns rows [e*C, (e+1)*C); an assignment whose rank within
            its expert is >= C is dropped;
  blocked   dropless, each expert's run padded to a multiple of `block` rows, so every
            block of rows belongs to one expert (a batched matmul over blocks; fastest
            dropless layout on CPU).
Priority (who is dropped at capacity): assignments are ranked within their expert in
choice-major order: every token's first choice, in token order, before any token's
second choice, and so on. Deterministic, and the same rule the expert-parallel rowwise
dispatcher uses.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from olmo_jax import shapes
from olmo_jax.kernels.vma import cotangent_like
from olmo_jax.model.moe import sizing


class BufferPlan(NamedTuple):
    row_Sk: jax.Array  # int32 destination row of each assignment (== n_rows when dropped)
    keep_Sk: jax.Array  # bool, False where dropped at capacity
    group_sizes_E: jax.Array  # int32 kept assignments per expert
    n_rows: int  # static buffer size


def rank_within_expert(idx_Sk: jax.Array, num_experts: int) -> tuple[jax.Array, jax.Array]:
    """(rank_Sk, counts_E): the position of each assignment among all assignments to the
    same expert, in choice-major order, and the number of assignments per expert."""
    S, k = idx_Sk.shape
    flat_R = idx_Sk.T.reshape(-1)  # choice-major: a = j * S + s
    order_R = jnp.argsort(flat_R, stable=True)
    counts_E = jnp.bincount(flat_R, length=num_experts).astype(jnp.int32)
    starts_E = jnp.cumsum(counts_E) - counts_E
    rank_sorted_R = jnp.arange(S * k, dtype=jnp.int32) - starts_E[flat_R[order_R]]
    rank_R = jnp.zeros((S * k,), jnp.int32).at[order_R].set(rank_sorted_R)
    return rank_R.reshape(k, S).T, counts_E


@shapes.check("-> *")
def sorted_plan(idx_Sk: jax.Array, num_experts: int) -> BufferPlan:
    rank_Sk, counts_E = rank_within_expert(idx_Sk, num_experts)
    starts_E = jnp.cumsum(counts_E) - counts_E
    row_Sk = starts_E[idx_Sk] + rank_Sk
    return BufferPlan(row_Sk, jnp.ones_like(row_Sk, bool), counts_E, idx_Sk.size)


@shapes.check("-> *")
def capacity_plan(idx_Sk: jax.Array, num_experts: int, capacity: int) -> BufferPlan:
    rank_Sk, counts_E = rank_within_expert(idx_Sk, num_experts)
    keep_Sk = rank_Sk < capacity
    n_rows = num_experts * capacity
    row_Sk = jnp.where(keep_Sk, idx_Sk * capacity + rank_Sk, n_rows)
    return BufferPlan(row_Sk, keep_Sk, jnp.minimum(counts_E, capacity), n_rows)


@shapes.check("-> *")
def padded_plan(idx_Sk: jax.Array, num_experts: int, multiple: int) -> BufferPlan:
    """The sorted layout with each expert's run padded to a multiple of `multiple` rows
    (zero rows; at most multiple - 1 per expert), in a static buffer that fits any
    routing. group_sizes_E are the unpadded counts."""
    rank_Sk, counts_E = rank_within_expert(idx_Sk, num_experts)
    padded_E = (counts_E + multiple - 1) // multiple * multiple
    starts_E = jnp.cumsum(padded_E) - padded_E
    row_Sk = starts_E[idx_Sk] + rank_Sk
    n_rows = sizing.padded_rows(idx_Sk.size, num_experts, multiple)
    return BufferPlan(row_Sk, jnp.ones_like(row_Sk, bool), counts_E, n_rows)


def runs_plan(idx_Sk: jax.Array, num_experts: int, multiple: int) -> BufferPlan:
    """The dropless layout of `buffer.Runs(group_sizes_E, multiple)`: sorted (multiple
    1) or padded."""
    if multiple == 1:
        return sorted_plan(idx_Sk, num_experts)
    return padded_plan(idx_Sk, num_experts, multiple)


@shapes.check("-> U")
def block_owners(sizes_E: jax.Array, n_rows: int, block: int) -> jax.Array:
    """owner_U: the group owning each block of `block` rows of a buffer whose runs of
    sizes_E rows are each padded to a multiple of `block` (blocks past the last run are
    padding owned by the last group)."""
    padded_E = (sizes_E + block - 1) // block * block
    ends_E = jnp.cumsum(padded_E)
    starts_U = jnp.arange(n_rows // block, dtype=jnp.int32) * block
    owner_U = jnp.searchsorted(ends_E, starts_U, side="right").astype(jnp.int32)
    return jnp.minimum(owner_U, sizes_E.shape[0] - 1)


def blocked_plan(idx_Sk: jax.Array, num_experts: int, block: int) -> tuple[BufferPlan, jax.Array]:
    """The plan (padded_plan with multiple = block) and the expert owning each block."""
    plan = padded_plan(idx_Sk, num_experts, block)
    return plan, block_owners(plan.group_sizes_E, plan.n_rows, block)


def source_assignments(plan: BufferPlan) -> jax.Array:
    """a_R: for each buffer row, the assignment a = s * k + j that fills it (S * k = empty)."""
    S, k = plan.row_Sk.shape
    a_R = jnp.full((plan.n_rows,), S * k, jnp.int32)
    return a_R.at[plan.row_Sk.reshape(-1)].set(jnp.arange(S * k, dtype=jnp.int32), mode="drop")


@shapes.check("plan.*", "-> R D")
def gather_rows(x_SD: jax.Array, plan: BufferPlan) -> jax.Array:
    """x_RD: the buffer, each row a copy of its assignment's token (zeros where empty)."""
    k = plan.row_Sk.shape[1]
    return _gather_rows(x_SD, source_assignments(plan) // k, plan.row_Sk)


@shapes.check("plan.*", "-> S D")
def combine_rows(y_RD: jax.Array, plan: BufferPlan, weights_Sk: jax.Array) -> jax.Array:
    """y_SD = sum_j weights[s, j] * y[row[s, j]], weights applied in float32; dropped
    assignments contribute zero. Returns float32."""
    w_Sk = jnp.where(plan.keep_Sk, weights_Sk.astype(jnp.float32), 0.0)
    return _combine_rows(y_RD, w_Sk, plan.row_Sk, source_assignments(plan))


def _with_zero_row(x_RD: jax.Array) -> jax.Array:
    return jnp.concatenate([x_RD, jnp.zeros((1, *x_RD.shape[1:]), x_RD.dtype)], axis=0)


# Both directions are written as gathers: the transpose of a row gather would be a
# scatter-add, which is slow on CPU and needless here, since every buffer row has at
# most one source assignment and every token exactly k destination rows.


@jax.custom_vjp
def _gather_rows(x_SD, src_R, row_Sk):
    return _with_zero_row(x_SD)[src_R]


def _gather_rows_fwd(x_SD, src_R, row_Sk):
    return _with_zero_row(x_SD)[src_R], (row_Sk, x_SD)


def _gather_rows_bwd(res, dx_RD):
    row_Sk, x_SD = res
    dx_SD = jnp.sum(_with_zero_row(dx_RD)[row_Sk], axis=1)
    return cotangent_like(dx_SD, x_SD), None, None


_gather_rows.defvjp(_gather_rows_fwd, _gather_rows_bwd)


@jax.custom_vjp
def _combine_rows(y_RD, w_Sk, row_Sk, a_R):
    y_SkD = _with_zero_row(y_RD)[row_Sk].astype(jnp.float32)
    return jnp.einsum("skd,sk->sd", y_SkD, w_Sk)


def _combine_rows_fwd(y_RD, w_Sk, row_Sk, a_R):
    return _combine_rows(y_RD, w_Sk, row_Sk, a_R), (y_RD, w_Sk, row_Sk, a_R)


def _combine_rows_bwd(res, dy_SD):
    y_RD, w_Sk, row_Sk, a_R = res
    k = row_Sk.shape[1]
    w_a = _with_zero_row(w_Sk.reshape(-1, 1))[a_R]  # [R, 1], 0 for empty rows
    dy_RD = (w_a * _with_zero_row(dy_SD)[a_R // k]).astype(y_RD.dtype)
    y_SkD = _with_zero_row(y_RD)[row_Sk].astype(jnp.float32)
    dw_Sk = jnp.einsum("skd,sd->sk", y_SkD, dy_SD)
    return cotangent_like(dy_RD, y_RD), cotangent_like(dw_Sk, w_Sk), None, None


_combine_rows.defvjp(_combine_rows_fwd, _combine_rows_bwd)
