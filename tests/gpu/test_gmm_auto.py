"""model.moe.gmm_impl=auto is the fastest grouped matmul the target accepts, by the planner
(olmo_jax/planner/gmm_compare.py), at the smallest shape: one abstract H200 and one B300,
the dropless local dispatch, a 2-layer bf16 model with 16 experts. Every accepted
implementation's real train step is compiled by XLA:GPU (deviceless) and planned; auto's
projection (as scheduled) must be within 3% of the best one's, and no plan of auto may
carry the planner's error for a routed-expert op lowered densely over the groups (the
explicit ragged_dot's plan must: XLA:GPU lowers every ragged_dot so). These are XLA:GPU
rooflines, not measurements. tools/bench/gmm_auto.py runs the same comparison for the
reference configs.

One GPU architecture per test id (the Makefile runs Hopper and Blackwell in separate
processes: ptxas)."""

import pytest

from olmo_jax import config as config_lib
from olmo_jax import targets
from olmo_jax.config import default_config
from olmo_jax.planner import gmm_compare, hardware, plan_build, plan_text
from olmo_jax.planner.compile import compile_train_step

TOLERANCE = 0.03
# What the table must pick at this shape (d_model and expert hidden multiples of 64, bf16).
AUTO = {"h200": "pallas", "b300": "pallas_tcgen05"}


def small_run():
    c = default_config()
    m = c.model
    m.vocab_size, m.d_model, m.n_layers, m.n_heads, m.n_kv_heads = 256, 128, 2, 4, 2
    m.n_dense_layers, m.dense_hidden, m.dtype = 1, 128, "bfloat16"
    m.moe.num_experts, m.moe.top_k, m.moe.expert_hidden = 16, 2, 128
    c.trainer.global_batch_size, c.trainer.seq_len = 4, 128
    return config_lib.validate(c)


TEXTS = {}  # (kind, gmm_impl) -> the rendered plan


def _plan(run, n, kind):  # api.plan_config's plan, in this (CUDA plugin) interpreter
    step = compile_train_step(run, targets.abstract_devices(kind, n), kind=kind)
    plan = plan_build.build(step, hardware.device_spec(kind, n))
    TEXTS[kind, run.model.moe.gmm_impl] = plan_text.format_plan(plan)
    return plan.to_json()


@pytest.mark.parametrize("kind", sorted(AUTO))
def test_auto_is_the_fastest_accepted_gmm(kind):
    cmp = gmm_compare.compare(small_run(), 1, kind, plan=_plan)
    print(cmp.to_json())
    assert cmp.candidates.auto == AUTO[kind]
    assert "ragged_dot" in cmp.plans and "tiled" in cmp.candidates.left_out
    assert ("pallas" in cmp.plans) == (kind == "h200")  # wgmma: refused on Blackwell
    assert ("pallas_tcgen05" in cmp.plans) == (kind == "b300")  # tcgen05: refused on Hopper
    assert cmp.auto_vs_best >= 1 - TOLERANCE, cmp.to_json()
    assert not cmp.plans[cmp.candidates.auto]["errors"]
    (error,) = cmp.plans["ragged_dot"]["errors"]
    assert "dense product over the expert groups" in error and "gmm_impl=auto" in error
    assert f"  ERROR       {error}" in TEXTS[kind, "ragged_dot"]
    assert "ERROR" not in TEXTS[kind, cmp.candidates.auto]
    assert cmp.tokens_per_s("ragged_dot") < cmp.tokens_per_s("auto")
    # The kernels declare their cost over the routed rows, not the dropless buffer's
    # (sized for any routing): the routed experts' compiled FLOPs are the formula's.
    chosen = cmp.plans[cmp.candidates.auto]
    hlo, formula = chosen["flops_per_token_hlo"], chosen["flops_per_token_formula"]
    print("routed experts, HLO / formula:", hlo["routed_experts"] / formula["routed_experts"])
    assert chosen["buffer_factor"] == 1.0
    assert hlo["routed_experts"] == pytest.approx(formula["routed_experts"], rel=1e-6)
