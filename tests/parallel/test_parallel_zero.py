"""ZeRO-1: the fp32 params and AdamW moments live split over each parameter's
data-parallel devices (1/dp of the replicated bytes per device), and the compiled step
really reduce-scatters gradients and all-gathers parameters, once per step, instead of
all-reducing them and updating full copies."""

import math

import jax
import pytest

from olmo_jax.parallel import zero
from olmo_jax.planner import comms
from tests.parallel.harness import host_state, make_cfg, plan_run, with_capacity
from tests.sections import plan_for


def _plan(data, expert, zero1=True):
    cfg = make_cfg(data, expert, zero1=zero1)
    return plan_for(cfg, with_capacity(host_state()[0], cfg))


def _adamw(opt_state):
    return opt_state[1]  # [0] is the tests' gradient recorder


def _layouts(plan):
    return jax.tree.leaves(plan.layouts, is_leaf=lambda x: isinstance(x, zero.ParamLayout))


def _split(mesh, entry) -> int:
    axes = entry if isinstance(entry, tuple) else ((entry,) if entry else ())
    return math.prod(mesh.shape[a] for a in axes)


def _compute_bytes(plan, leaf, lay) -> int:
    """Bytes of the parameter's per-device compute copy (experts: this rank's experts)."""
    return leaf.nbytes // math.prod(_split(plan.mesh, e) for e in lay.compute)


def _param_bytes(plan, state, split_only=True) -> int:
    return sum(_compute_bytes(plan, leaf, lay)
               for leaf, lay in zip(jax.tree.leaves(state.params), _layouts(plan), strict=True)
               if lay.axes and (lay.dim is not None or not split_only))


@pytest.mark.parametrize("mesh", [(2, 4), (8, 1), (1, 8)])
def test_optimizer_state_bytes_per_device_are_one_over_dp(mesh):
    _, tx, _, _, state = host_state()
    sharded, replicated = _plan(*mesh), _plan(*mesh, zero1=False)
    got, base = (zero.per_device_bytes(_adamw(state.opt_state),
                                       _adamw(p.state_shardings(state, tx).opt_state))
                 for p in (sharded, replicated))
    # plan.optimizer_bytes (what the trainer prints) gives the same pair.
    assert sharded.optimizer_bytes(state, tx)[1] == replicated.optimizer_bytes(state, tx)[0]
    # Leaf by leaf, the ZeRO shard is the replicated per-device copy divided by dp.
    counters = sum(x.nbytes for x in jax.tree.leaves(_adamw(state.opt_state)) if x.ndim == 0)
    expected = counters  # step counts (Adam's, the schedule's): replicated scalars
    for leaf, lay in zip(jax.tree.leaves(state.params), _layouts(sharded), strict=True):
        assert lay.dim is not None or not lay.axes, lay  # every leaf of this model divides
        dp = math.prod(sharded.mesh.shape[a] for a in lay.axes)
        expected += 2 * _compute_bytes(sharded, leaf, lay) // dp  # mu and nu
    assert got == expected
    print(f"mesh data={mesh[0]} x expert={mesh[1]}: AdamW state {got} B/device with ZeRO-1, "
          f"{base} B without (ratio {got / base:.3f})")
    if mesh == (8, 1):  # pure data parallel: every leaf split 8 ways
        assert (got - counters) * 8 == base - counters


def test_placed_arrays_hold_only_their_shard():
    run = plan_run(2, 4, "rowwise")  # the state after its steps, on the mesh
    for x in jax.tree.leaves(_adamw(run.state.opt_state)):
        if x.ndim:
            shard = x.addressable_shards[0].data
            assert shard.shape == x.sharding.shard_shape(x.shape)
            assert shard.size * 2 <= x.size  # every moment is split at least 2 ways


@pytest.mark.jax011
def test_compiled_step_reduce_scatters_and_all_gathers_once_per_step():
    state = host_state()[4]
    colls = comms.collectives(plan_run(2, 4, "rowwise").hlo)
    print(comms.format_table(colls, "ddp + ZeRO-1, rowwise, data=2 x expert=4", 8))

    def ops(kind, purpose):
        return [c for c in colls if c.kind == kind and c.purpose == purpose]

    param_bytes = _param_bytes(_plan(2, 4), state)  # compute-copy bytes of the split params
    assert param_bytes > 0
    for kind, purpose in (("reduce-scatter", "zero_reduce"), ("all-gather", "zero_gather")):
        found = ops(kind, purpose)
        assert found and all(c.count == 1 for c in found), found  # once per step
        assert sum(c.bytes for c in found) == param_bytes
    assert not ops("all-reduce", "zero_reduce")
    # GSPMD added no gathers for the update: AdamW runs on the local shards.
    assert not ops("all-gather", "other")
    all_reduce = sum(c.bytes_per_run for c in colls if c.kind == "all-reduce")
    assert all_reduce < param_bytes / 20  # only loss/router sums and the gradient norm


def test_without_zero1_gradients_are_all_reduced():
    state = host_state()[4]
    colls = comms.collectives(plan_run(1, 8, "allgather", zero1=False).hlo)
    assert not [c for c in colls if c.kind in ("reduce-scatter", "all-gather")
                and c.purpose.startswith("zero")]
    reduced = sum(c.bytes for c in colls if c.kind == "all-reduce" and c.purpose == "zero_reduce")
    expected = _param_bytes(_plan(1, 8, zero1=False), state, split_only=False)
    # XLA may fold the few router-statistics sums into the same all-reduce.
    assert expected <= reduced <= expected + 1024
