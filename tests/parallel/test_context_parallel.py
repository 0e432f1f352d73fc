"""Context parallelism (parallel.context) gives the single-device results: the harness's
one-device reference against the trainer's step with each sequence split over the
`context` axis (zig-zag, ring or all-gather attention), alone on 4 devices, with
data 2 / expert 2 (MoE dispatch over the tokens of data x context x expert, ZeRO-1
sharding over them; AdamW and Muon) on 8, and as pipe 2 x data 2 x context 2 (all-gather
attention, and the ring hopping by pair exchanges): loss, router losses and every gradient
within 1e-5 relative, five steps' losses within 1e-4 (test_parallel_invariance.py's
tolerances). The compiled step holds the design's collectives: ring attention moves K/V
by collective-permute and gathers no K/V, under a pipeline by all-gathers over pairs of
context ranks only; all-gather attention permutes nothing; and, without data.doc_mask, no
segment mask (test_context_doc_mask.py has the masked cases). Bad settings are refused
naming the field."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from olmo_jax.errors import ConfigError
from olmo_jax.kernels.ring_attention import zigzag_shard
from olmo_jax.labels import FILTERED, NO_LABEL
from olmo_jax.model.config import TransformerConfig
from olmo_jax.objective import labelled
from olmo_jax.planner import comms, hlo_cost
from olmo_jax.trainer.checkpoints import architecture_difference
from tests.parallel.harness import Pipe, make_cfg, plan_run, reference_run
from tests.parallel.test_parallel_invariance import assert_matches_reference
from tests.sections import plan_for

# (data, context, expert, dispatch, context_attention, optim.name)
# (ring on context 2 alone is (2, 2, 2)'s program less the data and expert axes: the same
# two-step ring without the scan, so it is not compiled on its own.)
CASES = [
    (1, 4, 1, "rowwise", "ring", "adamw"),
    (2, 2, 2, "rowwise", "ring", "adamw"),
    (1, 4, 2, "ragged", "allgather", "adamw"),
    (2, 2, 2, "rowwise", "ring", "muon"),
]


def _attention_collectives(run):
    """The attention's collectives between devices (a mesh axis of size 1 leaves trivial
    all-reduces of the QK-norm weights' gradients)."""
    return [c for c in comms.collectives(run.hlo) if "attention" in c.op_name and c.group_size > 1]


@pytest.mark.parametrize("case", CASES,
                         ids=lambda c: "data{}xcontext{}xexpert{}-{}-{}-{}".format(*c))
def test_context_parallel_matches_single_device(case):
    data, context, expert, dispatch, how, optim = case
    run = plan_run(data, expert, dispatch, context=context, context_attention=how, optim=optim)
    assert_matches_reference(run, reference_run(optim=optim))
    assert not hlo_cost.document_masks(run.hlo)  # no segment compares without data.doc_mask
    kinds = {c.kind for c in _attention_collectives(run)}
    if how == "ring":  # K/V (forward), K/V and dK/dV (backward) hop around the ring
        assert kinds == {"collective-permute"}, kinds
    else:  # K/V gathered (forward), dK/dV reduce-scattered (backward)
        assert kinds == {"all-gather", "reduce-scatter"}, kinds


def ring_pair_exchanges(run):
    """Whether the attention's collectives are the ring's pair exchanges: all-gathers over
    groups of 2 context ranks inside one pipeline stage, and nothing else (no
    collective-permute, whose rendezvous spans every device of the mesh: a stage's ops run
    in conds the other stages skip)."""
    colls = _attention_collectives(run)
    return bool(colls) and all(c.kind == "all-gather" and c.group_size == 2 for c in colls)


@pytest.mark.parametrize("how", ["allgather", "ring"])
def test_context_parallel_pipeline_matches_single_device(how):
    # pipe 2 x data 2 x context 2 (GPipe): each stage's blocks run on the zig-zag shards
    # (the ring's K/V hop by pair exchanges), the last stage's loss on the sharded targets.
    layers, batch = (4, 0), 8
    run = plan_run(2, 1, "rowwise", batch=batch, layers=layers, pipe=Pipe(2, "gpipe", 1),
                   context=2, context_attention=how)
    assert_matches_reference(run, reference_run(batch=batch, layers=layers))
    if how == "ring":
        assert ring_pair_exchanges(run), _attention_collectives(run)
    else:
        assert {c.kind for c in _attention_collectives(run)} == {"all-gather", "reduce-scatter"}


def _cfg(**parallel):
    cfg = make_cfg(data=1)
    for k, v in parallel.items():
        setattr(cfg.parallel, k, v)
    return cfg


def test_bad_context_settings_are_refused_by_name():
    from olmo_jax.config import model_config

    with pytest.raises(ConfigError, match=r"parallel.context=0 must be a positive size"):
        plan_for(_cfg(context=0), model_config(make_cfg()))
    cfg = _cfg(context=4, data=2)
    cfg.trainer.seq_len = 12
    with pytest.raises(ConfigError, match=r"trainer.seq_len=12 must be divisible by 2 x "
                                          r"parallel.context = 8"):
        plan_for(cfg, model_config(cfg))
    cfg = _cfg(context=3, pipe=2)
    with pytest.raises(ConfigError, match=r"model.context_attention=ring with parallel.pipe=2 "
                                          r"needs a power-of-two parallel.context, got 3"):
        plan_for(cfg, model_config(cfg), devices=jax.devices()[:6])
    cfg = _cfg(context=2, data=4)
    cfg.model.moe.lb_granularity = "instance"
    with pytest.raises(ConfigError, match=r"model.moe.lb_granularity=instance needs each row's"):
        plan_for(cfg, model_config(cfg))
    with pytest.raises(ConfigError, match=r"model.context_attention='nonsense': choose"):
        TransformerConfig(context_attention="nonsense").validate()


def test_a_checkpoint_resumes_onto_another_context_size():
    # The parameters do not depend on the context axis (replicated over it, ZeRO-1 shards
    # are resharded on restore): the run's context fields are not architecture.
    saved = TransformerConfig()
    run = saved.replace(context_parallel=4, context_attention="allgather")
    assert architecture_difference(saved, run) is None


def test_a_context_shard_keeps_its_rows_filtered_flag():
    # A filtered instance's labels add no loss on every context rank, though only rank 0
    # holds the row's last target (objective.labelled's row_end_B1).
    targets = jnp.asarray([[1, 2, 3, 4, 5, 6, 7, NO_LABEL], [1, 2, 3, 4, 5, 6, 7, FILTERED]])
    want_loss, want_counted = labelled(targets)
    assert not bool(want_loss[1].any()) and bool(want_loss[0, :-1].all())
    for C in (2, 4):
        for r in range(C):
            loss, counted = labelled(zigzag_shard(targets, C, r), targets[:, -1:])
            np.testing.assert_array_equal(loss, zigzag_shard(want_loss, C, r))
            np.testing.assert_array_equal(counted, zigzag_shard(want_counted, C, r))
