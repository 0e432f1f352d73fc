"""Muon on a mesh: the same step as on one device (float32, the AdamW tolerances of
test_parallel_invariance.py), whatever owns which matrix, and the compiled step's
Muon collectives are exactly those of the ownership plan (olmo_jax/parallel/muon_owners.py)."""

import jax
import numpy as np
import pytest

from olmo_jax.errors import ConfigError
from olmo_jax.model.params import path_name
from olmo_jax.planner import comms
from tests.parallel.harness import (
    Pipe,
    host_state,
    make_cfg,
    plan_run,
    reference_run,
    rel_err,
    to_numpy,
    with_capacity,
)
from tests.parallel.test_parallel_invariance import assert_matches_reference
from tests.sections import plan_for


def _plan(data, expert, zero1=True):
    cfg = make_cfg(data, expert, zero1=zero1, optim="muon")
    return plan_for(cfg, with_capacity(host_state(optim="muon")[0], cfg))


@pytest.mark.parametrize("data,expert,zero1", [(2, 4, True), (8, 1, True), (4, 2, False)])
def test_muon_step_matches_single_device(data, expert, zero1):
    ref = reference_run(optim="muon")
    run = plan_run(data, expert, zero1=zero1, optim="muon")
    assert_matches_reference(run, ref)
    # The parameters after the steps (every Muon update applied), leaf by leaf.
    got, want = jax.tree.leaves(to_numpy(run.state.params)), jax.tree.leaves(to_numpy(ref.state.params))
    errs = [rel_err(g - w0, w - w0) for g, w, w0 in
            zip(got, want, jax.tree.leaves(host_state(optim="muon")[4].params), strict=True)]
    print("param update rel err", max(errs))
    assert all(e <= 1e-4 for e in errs), errs  # a NaN fails (max() can skip it)
    adamw = reference_run()
    assert not np.allclose(ref.curve[1:], adamw.curve[1:])  # Muon really ran


def test_ownership_is_round_robin_by_size_and_covers_every_matrix():
    plan = _plan(2, 4)
    own = plan.muon
    kinds = {g.kind for g in own.groups}
    assert "split" in kinds  # ZeRO-1: momentum stored split
    for axes, counts in own.matrices_per_rank().items():
        assert max(counts) - min(counts) <= 1, (axes, counts)  # balanced
    sizes = [np.prod(g.full_shape) for g in own.groups if g.kind != "local"]
    assert sizes == sorted(sizes, reverse=True)  # dealt largest first
    names = {lf.name for g in own.groups for lf in g.leaves}
    assert "moe_blocks/ffn/experts/w_gate" in names and "moe_blocks/attn/q_proj" in names
    assert not {n for n in names if "router" in n or "norm" in n or "embedding" in n
                or "lm_head" in n}
    for g in own.groups:  # every rank orthogonalizes only its slots, not the whole model
        total = sum(lf.units for lf in g.leaves)
        assert g.kind == "local" or g.slots == -(-total // g.dp)
    # Pure expert parallelism: each rank's experts are whole and its own (no collective);
    # the replicated weights are owned round-robin over the 8 expert ranks.
    pure_ep = _plan(1, 8).muon
    for g in pure_ep.groups:
        experts = any("experts" in lf.name for lf in g.leaves)
        assert (g.kind == "local") == experts, g.label
    assert ("all-to-all", "muon_gather", 0) not in pure_ep.expected_collectives()


def test_muon_momentum_is_stored_split():
    run = plan_run(2, 4, zero1=True, optim="muon")
    plan = _plan(2, 4)
    split = {lf.name for g in plan.muon.groups if g.kind == "split" for lf in g.leaves}
    # recording: (grads, tx); tx: (clip, partition); muon: masked chain (MuonState, ...)
    muon_state = run.state.opt_state[1][1].inner_states["muon"].inner_state[0]
    seen = 0
    for path, mu in jax.tree_util.tree_leaves_with_path(muon_state.mu):
        name = path_name(path)
        if name in split:
            shard = mu.addressable_shards[0].data
            assert shard.size * 8 == mu.size, (name, shard.shape, mu.shape)  # data x expert
            seen += 1
    assert seen == len(split) > 0


def test_compiled_muon_collectives_are_the_ownership_plans():
    plan = _plan(2, 4)
    colls = comms.collectives(plan_run(2, 4, zero1=True, optim="muon").hlo)
    print(comms.format_table(colls, "muon + ZeRO-1, data=2 x expert=4", 8))
    got = sorted((c.kind, c.purpose, c.bytes) for c in colls
                 if c.purpose in ("muon_gather", "muon_return"))
    assert got == plan.muon.expected_collectives()
    assert all(c.count == 1 for c in colls if c.purpose.startswith("muon"))
    # GSPMD added no gathers of its own for the update: Muon ran on its owners.
    assert not [c for c in colls if c.kind in ("all-gather", "all-to-all") and c.purpose == "other"]


def test_muon_with_a_pipeline_is_refused():
    cfg = make_cfg(2, 2, pipe=Pipe(2), layers=(2, 0), optim="muon")
    with pytest.raises(ConfigError, match="optim.name=muon.*parallel.pipe=2"):
        plan_for(cfg, host_state(optim="muon")[0])
