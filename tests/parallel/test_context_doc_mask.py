"""Document masking (data.doc_mask) under context parallelism and pipelines gives the
single-device results. The batches pack documents into every row (harness.batches
docs=True: three or four EOS-ended documents a row, their ends straddling the zig-zag
chunks of context 2 and 4, so documents cross the shards' boundaries; every fourth row is
one document); one device masks them (model.doc_mask_eos) with the plain causal core.
Against it: context 4 alone (ring), data 2 x context 2 x expert 2 (ring), context 4 x
expert 2 (all-gather, ragged dispatch), pipe 2 x data 2 x context 2 (all-gather) and pipe
2 x context 2 x expert 2 (the ring, by pair exchanges) (interleaved 1F1B, 2
microbatches, virtual stages 2, a dense-first block): loss,
router losses and every gradient within 1e-5 relative, five steps' losses within 1e-4
(test_parallel_invariance.py's tolerances). The masked reference differs from the
unmasked one by far more, so the cases prove the shards mask. The compiled steps hold the
design's collectives (the ring: collective-permutes only; all-gather: K/V all-gathers and
dK/dV reduce-scatters) and the ring makes no whole-sequence score buffer while the
all-gather's [2L, T] block is found by the same check. Under a pipeline the plan sets the
ring's pair exchanges, and refuses a context they cannot cover naming the fields."""

import jax
import pytest

from olmo_jax.errors import ConfigError
from olmo_jax.model.abstract import abstract_model
from olmo_jax.planner import comms, hlo_cost
from olmo_jax.trainer.step import make_eval_step
from tests.parallel.harness import (
    DOC_EOS,
    FAST_COMPILE,
    SEQ,
    Pipe,
    batches,
    host_state,
    make_cfg,
    plan_run,
    reference_run,
    rel_err,
    with_capacity,
    with_docs,
)
from tests.parallel.test_context_parallel import ring_pair_exchanges
from tests.parallel.test_parallel_invariance import assert_matches_reference
from tests.sections import plan_for

DOCS = dict(docs=True, doc_mask=True)
WIDTH = 64  # head size 32: no q / k / v array is shaped like a [.., T = 16] score block

# (data, context, expert, dispatch, context_attention)
CASES = [
    (1, 4, 1, "rowwise", "ring"),
    (2, 2, 2, "rowwise", "ring"),
    (1, 4, 2, "ragged", "allgather"),
]


def _attention_collectives(run):
    return {c.kind for c in comms.collectives(run.hlo)
            if "attention" in c.op_name and c.group_size > 1}


@pytest.mark.parametrize("case", CASES, ids=lambda c: "data{}xcontext{}xexpert{}-{}-{}".format(*c))
def test_doc_masked_context_parallel_matches_single_device(case):
    data, context, expert, dispatch, how = case
    run = plan_run(data, expert, dispatch, context=context, context_attention=how, width=WIDTH,
                   **DOCS)
    ref = reference_run(width=WIDTH, **DOCS)
    assert_matches_reference(run, ref)
    unmasked = reference_run(width=WIDTH, docs=True)  # the same batches without the masks
    assert rel_err(ref.curve, unmasked.curve) > 1e-3, "the masks must matter"
    assert hlo_cost.document_masks(run.hlo)  # the blocks' q-segment == k-segment masks
    whole = hlo_cost.key_span_buffers(run.hlo, SEQ)
    if how == "ring":  # K/V (forward), K/V and dK/dV (backward) hop; [L, L] blocks only
        assert _attention_collectives(run) == {"collective-permute"}
        assert not whole, whole
    else:  # K/V gathered (forward), dK/dV reduce-scattered (backward); [2L, T] blocks
        assert _attention_collectives(run) == {"all-gather", "reduce-scatter"}
        assert whole, "the check no longer sees the all-gather's [2L, T] score block"


@pytest.mark.parametrize("data, expert, how", [(2, 1, "allgather"), (1, 2, "ring")],
                         ids=["data2-allgather", "expert2-ring"])
def test_doc_masked_context_parallel_pipeline_matches_single_device(data, expert, how):
    # Each microbatch's segment ids and RoPE positions are computed on its whole rows by
    # every stage, then sharded; the stash keeps what each block's backward needs of them.
    layers, batch, M = (5, 1), 8, 2
    run = plan_run(data, expert, "rowwise", batch=batch, layers=layers, width=WIDTH, context=2,
                   pipe=Pipe(2, "interleaved_1f1b", M, 2), context_attention=how, **DOCS)
    assert_matches_reference(run, reference_run(grad_accum=M, batch=batch, layers=layers,
                                                width=WIDTH, **DOCS))
    assert hlo_cost.document_masks(run.hlo)
    if how == "ring":  # K/V, dK/dV swapped inside pairs of context ranks of one stage
        assert ring_pair_exchanges(run)
        assert not hlo_cost.key_span_buffers(run.hlo, SEQ)
    else:
        assert _attention_collectives(run) == {"all-gather", "reduce-scatter"}


def test_doc_masked_pipeline_eval_matches_single_device():
    # pipe 2 x data 2 x expert 2 without context parallelism, 1F1B's forward-only table
    # over 2 microbatches: the evaluation ticks mask each microbatch's documents.
    layers, batch = (3, 1), 8
    model_cfg, _, _, _, state = host_state(layers=layers, width=WIDTH)
    model_cfg = with_docs(model_cfg, True, True)
    cfg = make_cfg(2, 2, batch=batch, layers=layers, pipe=Pipe(2, "1f1b", 2), width=WIDTH)
    plan = plan_for(cfg, with_capacity(model_cfg, cfg))
    pipe_eval = jax.jit(make_eval_step(abstract_model(model_cfg, plan.dispatcher)[0], model_cfg,
                                       parallel=plan))
    one_eval = jax.jit(make_eval_step(abstract_model(model_cfg)[0], model_cfg))
    tokens = batches(1, batch=batch, docs=True)[0]
    params = jax.device_put(state.params, plan.param_shardings())
    placed = plan.place_batch(tokens, grad_accum=1)
    ce, n = pipe_eval.lower(params, state.model_state, placed).compile(FAST_COMPILE)(
        params, state.model_state, placed)
    ref_ce, ref_n = one_eval.lower(state.params, state.model_state, tokens).compile(
        FAST_COMPILE)(state.params, state.model_state, tokens)
    unmasked = jax.jit(make_eval_step(abstract_model(model_cfg.replace(doc_mask_eos=-1))[0],
                                      model_cfg.replace(doc_mask_eos=-1)))
    plain_ce, _ = unmasked(state.params, state.model_state, tokens)
    assert float(n) == float(ref_n) == batch * SEQ
    assert rel_err(ce, ref_ce) <= 1e-6
    assert rel_err(plain_ce, ref_ce) > 1e-3  # the masks matter


def test_the_plan_sets_the_rings_hops_with_a_pipeline():
    from olmo_jax.config import model_config

    cfg = make_cfg(data=2, pipe=Pipe(2), context=2)
    plan = plan_for(cfg, with_docs(model_config(cfg), True, True))
    assert (plan.model_cfg.context_ring_hops, plan.model_cfg.doc_mask_eos) == ("pairs", DOC_EOS)
    cfg = make_cfg(pipe=Pipe(2), context=3)  # pair exchanges cover powers of two
    with pytest.raises(ConfigError, match=r"model.context_attention=ring with parallel.pipe=2 "
                                          r"needs a power-of-two parallel.context, got 3"):
        plan_for(cfg, with_docs(model_config(cfg), True, True), devices=jax.devices()[:6])
    cfg = make_cfg(data=4, context=2)  # no pipeline: the ring's collective-permutes
    assert plan_for(cfg, model_config(cfg)).model_cfg.context_ring_hops == "permute"
