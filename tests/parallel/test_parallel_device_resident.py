"""A training step never waits on the host: after the first compile it runs under
jax.transfer_guard("disallow") (no implicit host<->device transfer), and its compiled
HLO has no host callbacks, infeed/outfeed or host send/recv (routing, capacity and
dispatch offsets are all computed on the device)."""

import re

import jax
import pytest

from tests.parallel.harness import plan_run

HOST_OPS = re.compile(r"\b(infeed|outfeed|send|recv|send-done|recv-done)\(")
CALLBACK = re.compile(r'custom_call_target="[^"]*(callback|host)[^"]*"', re.IGNORECASE)


@pytest.mark.parametrize("case", [(2, 4, "rowwise"), (4, 2, "ragged"), (1, 8, "allgather")],
                         ids=lambda c: c[2])
def test_step_runs_on_device_only(case):
    run = plan_run(*case[:2], case[2], zero1=case != (1, 8, "allgather"))
    assert not HOST_OPS.search(run.hlo), HOST_OPS.search(run.hlo)
    assert not CALLBACK.search(run.hlo), CALLBACK.search(run.hlo)
    state = jax.tree.map(lambda x: x.copy(), run.state)  # the step donates its input
    with jax.transfer_guard("disallow"):
        for _ in range(2):
            state, metrics = run.step(state, run.batch)
        jax.block_until_ready(metrics)
    assert float(metrics["loss"]) > 0
