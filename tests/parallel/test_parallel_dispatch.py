"""Each expert-parallel dispatcher, alone inside shard_map over an `expert` axis, against
the naive loop-over-experts reference: rowwise with a low capacity drops exactly the
assignments the documented choice-major rule drops (hand-built routing); the dropless
backends deliver everything even when every token picks experts of one rank (the
worst case their static buffers are sized for); the CPU emulation of
ragged_all_to_all reproduces the primitive's documented semantics."""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec

from olmo_jax.kernels.select import run_padding
from olmo_jax.model.config import MoEConfig
from olmo_jax.model.moe import sizing
from olmo_jax.model.moe.buffer import Runs
from olmo_jax.model.moe.layer import local_dispatch, routed_experts
from olmo_jax.model.moe.router import Routing
from olmo_jax.parallel.expert import buffer_rows, make_dispatcher
from olmo_jax.parallel.expert.ragged_a2a import emulated_ragged_all_to_all
from olmo_jax.parallel.expert.rowwise import rowwise_plan
from tests.reference import naive_keep_mask

D, F = 8, 12


class LocalExperts(NamedTuple):
    """Stand-in for the model's Experts module inside shard_map: this rank's weights."""
    w_gate: jax.Array
    w_up: jax.Array
    w_down: jax.Array

    def weights(self, dtype):
        return tuple(w.astype(dtype) for w in self)


def expert_mesh(ep: int) -> Mesh:
    return Mesh(np.asarray(jax.devices()[:ep]), ("expert",))


@functools.cache
def sharded_dispatch(kind: str, ep: int, E: int, k: int, capacity_factor: float = 1.0,
                     gmm_impl: str = "einsum"):
    """jit(x [ep*S, D], idx, weights, w_gate, w_up, w_down) -> (y [ep*S, D], dropped [ep])
    with each rank dispatching its S tokens."""
    cfg = MoEConfig(num_experts=E, top_k=k, expert_hidden=F, gmm_impl=gmm_impl)
    dispatcher = make_dispatcher(kind, capacity_factor)
    X, W = PartitionSpec("expert"), PartitionSpec("expert")

    def local(x, idx, w, wg, wu, wd):
        routing = Routing(None, None, w, idx)
        y, dropped = routed_experts(x, routing, LocalExperts(wg, wu, wd), cfg, jnp.float32,
                                    dispatcher)
        return y, dropped[None]

    return jax.jit(jax.shard_map(local, mesh=expert_mesh(ep), in_specs=(X, X, X, W, W, W),
                                 out_specs=(X, X)))


def expert_weights(E: int, seed: int = 0):
    keys = jax.random.split(jax.random.key(seed), 3)
    shapes = ((E, D, F), (E, D, F), (E, F, D))
    return tuple(jax.random.normal(k, shape) * 0.3 for k, shape in zip(keys, shapes, strict=True))


def naive_output(x_SD, idx_Sk, w_Sk, weights, keep_Sk):
    """sum over kept (s, j) of w[s, j] * SwiGLU_{idx[s, j]}(x[s]), in float64."""
    wg, wu, wd = (np.asarray(w, np.float64) for w in weights)
    x = np.asarray(x_SD, np.float64)
    y = np.zeros_like(x)
    for s in range(x.shape[0]):
        for j in range(idx_Sk.shape[1]):
            if keep_Sk[s, j]:
                e = idx_Sk[s, j]
                h = x[s] @ wg[e]
                y[s] += w_Sk[s, j] * ((h / (1 + np.exp(-h))) * (x[s] @ wu[e])) @ wd[e]
    return y


def run(kind, idx_RSk, ep, E, capacity_factor=1.0, gmm_impl="einsum", seed=0):
    """Dispatch per rank r the tokens x[r] with routing idx[r]; returns x, w, y, dropped."""
    R, S, k = idx_RSk.shape
    x = jax.random.normal(jax.random.key(seed + 1), (R * S, D))
    w = jax.random.uniform(jax.random.key(seed + 2), (R * S, k), minval=0.1, maxval=1.0)
    fn = sharded_dispatch(kind, ep, E, k, capacity_factor, gmm_impl)
    y, dropped = fn(x, jnp.asarray(idx_RSk.reshape(R * S, k), jnp.int32), w, *expert_weights(E))
    return np.asarray(x), np.asarray(w), np.asarray(y), np.asarray(dropped)


# Two ranks, 4 experts (2 per rank), top-2, 6 tokens per rank, capacity 2 per expert.
HAND_IDX = np.array([
    [[0, 1], [0, 2], [0, 1], [1, 0], [2, 0], [1, 2]],  # rank 0
    [[3, 2], [3, 0], [2, 3], [3, 1], [0, 3], [3, 2]],  # rank 1
])
# By hand, choice-major per sender: all first choices in token order claim slots first.
# rank 0: first choices 0,0,0,1,2,1 -> token 2's (third for expert 0) dropped; second
#   choices 1,2,1,0,0,2 -> expert 1 and 0 are full (tokens 0, 2, 3, 4 dropped), expert 2
#   has one slot left: token 1 keeps it, token 5 is dropped.
# rank 1: first choices 3,3,2,3,0,3 -> tokens 3 and 5 dropped (expert 3 full); second
#   choices 2,0,3,1,3,2 -> token 0 (expert 2), 1 (expert 0), 3 (expert 1) kept; tokens
#   2 and 4 (expert 3 full) and 5 (expert 2 full) dropped.
HAND_KEEP = np.array([
    [[1, 0], [1, 1], [0, 0], [1, 0], [1, 0], [1, 0]],
    [[1, 1], [1, 1], [1, 0], [0, 1], [1, 0], [0, 0]],
], bool)


def test_rowwise_low_capacity_drops_exactly_the_documented_assignments():
    cf = 2 / 3  # C = ceil(2/3 * 6 tokens * 2 / 4 experts) = 2
    assert sizing.capacity(6, 2, 4, cf) == 2
    for r in range(2):
        np.testing.assert_array_equal(naive_keep_mask(HAND_IDX[r], 4, 2), HAND_KEEP[r])
        plan = rowwise_plan(jnp.asarray(HAND_IDX[r]), 4, 2)
        np.testing.assert_array_equal(np.asarray(plan.keep_Sk), HAND_KEEP[r])
    x, w, y, dropped = run("rowwise", HAND_IDX, ep=2, E=4, capacity_factor=cf)
    np.testing.assert_array_equal(dropped, (~HAND_KEEP).reshape(2, -1).sum(1))  # [6, 5]
    expected = naive_output(x, HAND_IDX.reshape(12, 2), w, expert_weights(4),
                            HAND_KEEP.reshape(12, 2))
    np.testing.assert_allclose(y, expected, atol=1e-5, rtol=0)
    assert np.abs(y[5]).max() > 0  # rank 0, token 5 kept its first choice


def test_rowwise_rows_are_grouped_by_destination_rank_then_local_expert():
    # Rank 0's send buffer is [destination rank r, local expert j, slot c]: the row of
    # (token, choice) is (r * El + j) * C + rank-within-expert = e * C + rank.
    plan = rowwise_plan(jnp.asarray(HAND_IDX[0]), num_experts=4, capacity=2)
    rows = np.asarray(plan.row_Sk)
    # expert 0 = (r0, j0): tokens 0, 1 -> rows 0, 1; expert 1 = (r0, j1): tokens 3, 5 ->
    # rows (0*2+1)*2 = 2, 3; expert 2 = (r1, j0): tokens 4, 1 (second choice) -> rows 4, 5.
    assert rows[0, 0] == 0 and rows[1, 0] == 1
    assert rows[3, 0] == 2 and rows[5, 0] == 3
    assert rows[4, 0] == 4 and rows[1, 1] == 5
    assert (rows[~HAND_KEEP[0]] == plan.n_rows).all()


@pytest.mark.parametrize("kind,gmm_impl", [("rowwise", "einsum"),
                                           pytest.param("ragged", "einsum", marks=pytest.mark.jax011),
                                           ("ragged", "ragged_dot"), ("allgather", "einsum"),
                                           ("allgather", "ragged_dot"), ("ragged", "tiled"),
                                           ("allgather", "tiled"), ("ragged", "blas"),
                                           ("allgather", "blas"), ("rowwise", "blas")])
def test_backend_matches_naive_on_random_and_worst_case_routing(kind, gmm_impl):
    ep, E, S, k = 4, 8, 6, 2
    cf = E / k  # rowwise: enough slots that nothing can drop
    rng = np.random.default_rng(0)
    random_idx = np.stack([np.stack([rng.choice(E, k, replace=False) for _ in range(S)])
                           for _ in range(ep)])
    skewed_idx = np.broadcast_to(np.array([0, 1]), (ep, S, k))  # everything to rank 0
    for idx in (random_idx, skewed_idx):
        x, w, y, dropped = run(kind, idx, ep, E, cf, gmm_impl)
        expected = naive_output(x, idx.reshape(-1, k), w, expert_weights(E),
                                np.ones((ep * S, k), bool))
        np.testing.assert_allclose(y, expected, atol=1e-5, rtol=0)
        assert dropped.sum() == 0


@functools.cache
def sharded_emulation(ep: int, out_rows: int):
    def local(operand, output, in_off, send, out_off, recv):
        return emulated_ragged_all_to_all(operand[0], output[0], in_off[0], send[0], out_off[0],
                                          recv[0], axis_name="expert")[None]

    spec = PartitionSpec("expert")
    return jax.jit(jax.shard_map(local, mesh=expert_mesh(ep), in_specs=(spec,) * 6,
                                 out_specs=spec))


def test_emulated_ragged_all_to_all_reproduces_the_documented_example():
    # The example of jax.lax.ragged_all_to_all's docstring (axis of size 2).
    args = [np.array(a, np.int32) for a in (
        [[1, 2, 2], [3, 4, 0]],  # operand
        [[0, 0, 0, 0], [0, 0, 0, 0]],  # output
        [[0, 1], [0, 1]],  # input_offsets
        [[1, 2], [1, 1]],  # send_sizes
        [[0, 0], [1, 2]],  # output_offsets
        [[1, 1], [2, 1]],  # recv_sizes
    )]
    args[0] = args[0].astype(np.float32)[..., None]
    args[1] = args[1].astype(np.float32)[..., None]
    out = np.asarray(sharded_emulation(2, 4)(*args))[..., 0]
    np.testing.assert_array_equal(out, [[1, 3, 0, 0], [2, 2, 4, 0]])


def test_emulated_ragged_all_to_all_with_several_slices_per_peer():
    """4 ranks, 2 slices per peer, random sizes and a receiver layout with gaps, against
    a direct numpy transcription of the primitive's semantics."""
    ep, q, N, M = 4, 2, 24, 40
    rng = np.random.default_rng(1)
    sizes = rng.integers(0, 3, (ep, ep, q))  # [sender, receiver, slice]
    operand = rng.normal(size=(ep, N, 1)).astype(np.float32)
    in_off = np.zeros((ep, ep * q), np.int32)
    out_off = np.zeros((ep, ep * q), np.int32)
    expected = np.full((ep, M, 1), -1.0, np.float32)
    cursor = np.zeros(ep, int)  # next free row on each receiver (gaps of one row)
    for s in range(ep):
        in_off[s] = np.concatenate([[0], np.cumsum(sizes[s].reshape(-1))[:-1]])
    for r in range(ep):
        for s in range(ep):
            for j in range(q):
                n = sizes[s, r, j]
                out_off[s, r * q + j] = cursor[r]
                src = in_off[s, r * q + j]
                expected[r, cursor[r]:cursor[r] + n] = operand[s, src:src + n]
                cursor[r] += n + 1
    send = sizes.reshape(ep, ep * q)
    recv = sizes.transpose(1, 0, 2).reshape(ep, ep * q)
    out = sharded_emulation(ep, M)(operand, np.full((ep, M, 1), -1.0, np.float32),
                                   in_off, send.astype(np.int32), out_off, recv.astype(np.int32))
    np.testing.assert_array_equal(np.asarray(out), expected)


@pytest.mark.parametrize("kind", ["rowwise", "ragged", "allgather", "local"])
@pytest.mark.parametrize("gmm_impl", ["einsum", "tiled", "ragged_dot", "blas"])
def test_buffer_rows_is_the_size_of_the_buffer_the_backend_builds(kind, gmm_impl):
    """The sizing the planner uses (parallel.expert.buffer_rows, from model/moe/sizing.py)
    is the row count of the buffer each backend hands the expert FFN (traced, not run);
    backends take the FFN's run padding (kernels.select.run_padding), not its name."""
    ep, E, S, k, cf = 4, 8, 12, 2, 1.25
    padding = run_padding(gmm_impl)
    cfg = MoEConfig(num_experts=E, top_k=k, expert_hidden=F, gmm_impl=gmm_impl)
    if kind == "local":
        for local_cfg in (cfg, dataclasses.replace(cfg, capacity_factor=cf)):
            d = jax.eval_shape(lambda x, idx, w, c=local_cfg: local_dispatch(
                x, Routing(None, None, w, idx), c, padding).x_RD,
                *_abstract_tokens(S, k))
            assert d.shape == (buffer_rows("local", S, local_cfg, padding), D)
        return
    if kind == "rowwise":  # the dropless backends have no capacity
        cfg = dataclasses.replace(cfg, capacity_factor=cf)
    dispatcher = make_dispatcher(kind, cfg.capacity_factor)

    def local(x, idx, w):
        return dispatcher(x, Routing(None, None, w, idx), cfg, padding).x_RD[None]

    X = PartitionSpec("expert")
    fn = jax.shard_map(local, mesh=expert_mesh(ep), in_specs=(X, X, X), out_specs=X)
    out = jax.eval_shape(fn, *_abstract_tokens(ep * S, k))
    assert out.shape == (ep, buffer_rows(kind, S, cfg, padding, ep), D)


@pytest.mark.parametrize("kind", ["ragged", "allgather", "local"])
def test_dropless_buffers_state_their_rows_at_balanced_routing(kind):
    """Each dropless buffer states the rows its groups hold under balanced routing, the
    S x top_k rows of the rank's own tokens (Runs.balanced_rows: what the grouped-matmul
    kernels declare their cost over), not its worst-case size (traced, not run)."""
    ep, E, S, k = 4, 8, 12, 2
    cfg = MoEConfig(num_experts=E, top_k=k, expert_hidden=F, gmm_impl="ragged_dot")
    padding, layouts = run_padding("ragged_dot"), []

    def local(x, idx, w):
        d = (local_dispatch(x, Routing(None, None, w, idx), cfg, padding) if kind == "local"
             else make_dispatcher(kind, 0.0)(x, Routing(None, None, w, idx), cfg, padding))
        layouts.append(d.layout)
        return d.x_RD[None]

    X = PartitionSpec("expert")
    fn = local if kind == "local" else jax.shard_map(local, mesh=expert_mesh(ep), in_specs=(X,) * 3,
                                                     out_specs=X)
    out = jax.eval_shape(fn, *_abstract_tokens(S if kind == "local" else ep * S, k))
    (layout,) = layouts
    assert isinstance(layout, Runs) and layout.balanced_rows == S * k
    # The expert-parallel buffers themselves are sized for the worst case (local: exact).
    assert out.shape[-2] == S * k if kind == "local" else out.shape[-2] > S * k


def _abstract_tokens(n, k):
    return (jax.ShapeDtypeStruct((n, D), jnp.float32), jax.ShapeDtypeStruct((n, k), jnp.int32),
            jax.ShapeDtypeStruct((n, k), jnp.float32))
