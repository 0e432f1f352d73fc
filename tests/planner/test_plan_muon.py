"""The planner on a Muon step (the small config of test_plan_compiled.py, data=2 x
expert=4, ZeRO-1): the optimizer section's collectives are exactly those of the
ownership plan (olmo_jax/parallel/muon_owners.py), its matmul FLOPs are exactly the plan's
Newton-Schulz FLOPs per device, and the plan prints the optimizer's time and bytes."""

import jax
import pytest

from olmo_jax import config as config_lib
from olmo_jax.planner import hardware, plan_build, plan_text
from olmo_jax.planner.compile import compile_train_step
from tests.planner.test_plan_compiled import small_config


@pytest.fixture(scope="module")
def plan():
    cfg = small_config()
    cfg.optim.name = "muon"
    return plan_build.build(compile_train_step(config_lib.validate(cfg), jax.devices()), hardware.device_spec("h200"))


def test_optimizer_collectives_and_flops_are_the_ownership_plans(plan):
    text = plan_text.format_plan(plan)
    print(text)
    oc, own = plan.optimizer, plan.step.plan.muon
    got = sorted((c.kind, c.purpose, c.bytes) for c in oc.colls)
    assert got and got == own.expected_collectives()
    assert all(c.count == 1 for c in oc.colls)  # once per step, outside the layer loops
    assert oc.dot_flops == pytest.approx(own.ns_flops_per_device(5), rel=1e-12)
    assert oc.collective_bytes == sum(b for _, _, b in own.expected_collectives())
    assert oc.compute_s > 0 and oc.link_s > 0 and oc.state_bytes > 0
    assert "Optimizer per device (muon" in text and "matrices per rank" in text
    # The matrices are dealt evenly: no rank orthogonalizes much more than its share.
    for counts in oc.matrices_per_rank.values():
        assert max(counts) - min(counts) <= 1
