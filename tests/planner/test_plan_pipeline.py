"""The planner on a pipelined config's real train step (pipe=2 x data=2 x expert=2 on the
session's 8 fake devices, interleaved 1F1B over 2 virtual stages, 4 microbatches, 5 MoE
blocks in 4 chunks of 2 slots: 3 padding layers), compiled once: every pipeline branch
is counted as often as the schedule table runs it (the prologue's dense MLP and the
head's LM head exactly as the formula says, the MoE blocks' terms times the padding
layers, the expert all-to-alls once per forward / backward op), the stage-to-stage sends
are in the collectives, and the projected step adds the schedule's bubble. The lockstep
pricing of a table is checked on its own against the table's bubble, also with a
backward slower than a forward."""

import jax
import pytest

from olmo_jax import config as config_lib
from olmo_jax.config import default_config
from olmo_jax.parallel.pipeline import schedule as sched_lib
from olmo_jax.parallel.pipeline import textbook_bubble
from olmo_jax.planner import hardware, pipeline_cost, plan_build, plan_text
from olmo_jax.planner.compile import compile_train_step

P, V, M, BATCH, SEQ = 2, 2, 4, 16, 32


def pipelined_config():
    c = default_config()
    m = c.model
    m.vocab_size, m.d_model, m.n_layers, m.n_heads, m.n_kv_heads = 128, 32, 6, 4, 2
    m.n_dense_layers, m.dense_hidden = 1, 64
    m.moe.num_experts, m.moe.top_k, m.moe.expert_hidden = 8, 2, 48
    m.moe.n_shared_experts, m.moe.shared_hidden = 1, 40
    p = c.parallel
    p.pipe, p.data, p.expert = P, 2, 2
    p.pipeline_schedule, p.virtual_stages, p.microbatches = "interleaved_1f1b", V, M
    c.trainer.global_batch_size, c.trainer.seq_len = BATCH, SEQ
    return c


@pytest.fixture(scope="module")
def plan():
    step = compile_train_step(config_lib.validate(pipelined_config()), jax.devices())
    return plan_build.build(step, hardware.device_spec("h100"))


def test_branches_are_counted_as_the_schedule_runs_them(plan):
    print(plan_text.format_plan(plan))
    f, h = plan.formula, plan.hlo
    # Stage 0's embedding + dense block and the last stage's head run once per microbatch
    # (not at every tick of every stage): exactly the formula.
    for term in ("dense_mlp", "lm_head"):
        assert h[term] == pytest.approx(f[term], rel=1e-6), term
    # 4 chunks x 2 slots for 5 MoE blocks: the padding layers are computed.
    moe = 8 / 5
    assert plan.layer_factor["router"] == pytest.approx(moe)
    for term in ("router", "shared_experts"):
        assert h[term] == pytest.approx(f[term] * moe, rel=1e-6), term
    assert h["attention_proj"] == pytest.approx(f["attention_proj"] * (1 + 8) / 6, rel=1e-6)
    assert abs(plan.matmul_ratio - 1) < 0.05
    # Each forward op dispatches and combines over `expert` in each of its 2 slots; the
    # mean over the stages is the same on every stage: M x V ops.
    a2a = [c for c in plan.colls if c.kind == "all-to-all" and c.purpose == "moe_rowwise"]
    fwd = sum(c.count for c in a2a if not c.backward)
    bwd = sum(c.count for c in a2a if c.backward)
    assert fwd == bwd == M * V * 2 * 2


def test_pipeline_collectives_are_in_the_table(plan):
    purposes = {c.purpose for c in plan.colls}
    assert {"pipe_send", "pipe_gather", "pipe_reduce"} <= purposes
    sends = [c for c in plan.colls if c.purpose == "pipe_send"]
    ticks = plan.step.plan.pipeline.schedule.ticks
    assert all(c.kind == "collective-permute" for c in sends)
    assert all(c.count == ticks for c in sends)  # one send each way per tick
    # Activations [rows, T, d_model] (float32 here) and their cotangents, every tick.
    rows = BATCH // (2 * 2) // M
    x_bytes = rows * SEQ * 32 * 4
    per_tick = sum(c.jax_bytes for c in sends)
    assert 2 * x_bytes <= per_tick < 3 * x_bytes
    text = plan_text.format_plan(plan)
    assert "pipe_send" in text and "bubble" in text


def test_projection_adds_the_schedule_bubble(plan):
    pc, p = plan.pipeline, plan.projection
    sched = plan.step.plan.pipeline.schedule
    assert pc.table_bubble == pytest.approx(sched.bubble)
    assert pc.table_bubble == pytest.approx(textbook_bubble("interleaved_1f1b", P, M, V))
    assert pc.ticks == sched.ticks and pc.passes == 1
    assert pc.bubble_s > 0 and 0 < pc.bubble < 1
    assert p.bubble_s == pc.bubble_s
    assert p.step_s == pytest.approx(p.roofline_s + p.links_s + pc.bubble_s)
    assert p.overlapped_s == pytest.approx(max(p.roofline_s, p.links_s) + pc.bubble_overlapped_s)
    # The busy time the lockstep pricing spreads over the stages is part of the roofline.
    assert pc.busy_s < p.roofline_s + p.links_s
    j = plan.to_json()["pipeline"]
    assert j["bubble_s"] == pc.bubble_s and j["table_bubble"] == pc.table_bubble


def test_as_scheduled_replays_the_branches_as_the_schedule_weights_them(plan):
    """XLA:CPU runs every collective synchronously: the step replayed in its schedule
    (planner/overlap.py, each pipeline conditional's branches weighted by the table) holds
    exactly the roofline's compute and every collective's link time, hides none of it, and
    its bubble is the nothing-overlapped one."""
    p, pc, sc = plan.projection, plan.pipeline, plan.scheduled
    assert sc.compute_s == pytest.approx(p.roofline_s, rel=1e-9)
    assert sc.link_s == pytest.approx(p.links_s, rel=1e-9)
    assert sc.step_s == pytest.approx(p.roofline_s + p.links_s, rel=1e-9)
    assert all(r.async_runs == 0 for r in sc.rows)
    assert pc.bubble_scheduled_s == pytest.approx(pc.bubble_s, rel=1e-9)
    assert p.scheduled_s == pytest.approx(p.step_s, rel=1e-9)
    assert "XLA:CPU runs every collective synchronously" in plan_text.format_plan(plan)


@pytest.mark.parametrize("kind,stages,virtual,micro", [("1f1b", 4, 1, 8), ("gpipe", 2, 1, 3),
                                                       ("interleaved_1f1b", 4, 2, 8)])
def test_lockstep_pricing_of_a_table(kind, stages, virtual, micro):
    sched = sched_lib.build(kind, stages, virtual, micro)
    even = {(pipeline_cost.FWD, ""): 1.0, (pipeline_cost.BWD, ""): 1.0}
    length, busy = pipeline_cost.lockstep(sched, even)
    assert length == sched.length and busy == 2 * micro * virtual
    assert 1 - busy / length == pytest.approx(sched.bubble)  # ops of one tick: the table's
    # A tick lasts the slowest stage's F + B: a backward 2x or 3.9x a forward (remat =
    # block) leaves the bubble at the textbook value (one-op ticks would make it grow).
    for b in (2.0, 3.9):
        length_b, busy_b = pipeline_cost.lockstep(sched, {(pipeline_cost.FWD, ""): 1.0, (pipeline_cost.BWD, ""): b})
        assert busy_b == pytest.approx((1 + b) * micro * virtual)
        assert 1 - busy_b / length_b == pytest.approx(sched.bubble)
    slow_bwd = {(pipeline_cost.FWD, ""): 1.0, (pipeline_cost.BWD, ""): 2.0}
    length2, busy2 = pipeline_cost.lockstep(sched, slow_bwd)
    assert busy2 == 3 * micro * virtual and length2 >= busy2
    assert 1 - busy2 / length2 >= sched.bubble - 1e-12
    # Work on the first chunk (the prologue) lengthens the ticks stage 0 runs it in.
    extra = dict(slow_bwd) | {(pipeline_cost.FIRST, pipeline_cost.FWD): 0.5}
    length3, busy3 = pipeline_cost.lockstep(sched, extra)
    assert busy3 == pytest.approx(busy2 + 0.5 * micro / stages)
    assert length3 >= length2
