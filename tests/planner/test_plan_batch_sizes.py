"""A run with trainer.batch_size_schedule planned at every batch size its steps take
(planner/batch_sizes.py), through the planner's API on XLA:CPU (2 fake devices, expert=2):
the schedule 8 -> 16 -> 32 sequences of a microbatch of 8 compiles three programs, with
1, 2 and 4 microbatches. Each size's batch, FLOPs, step time and memory are its own
compiled program's (one microbatch: no accumulation loop and no float32 gradient sums, so
a smaller peak; 2 -> 4 microbatches: the loop runs twice as often); the detailed plan and
the fit verdict are the largest size's; a memory limit the largest size exceeds is an
ERROR naming trainer.batch_size_schedule; the run's steps, tokens and projected time are
the schedule's."""

import dataclasses

import jax
import pytest

from olmo_jax import config as config_lib
from olmo_jax.config import default_config
from olmo_jax.planner import api, batch_sizes, hardware, plan_build

SEQ, MICRO = 32, 8  # sequences of a microbatch (global_batch_size / grad_accum)
SCHEDULE = f"{8 * SEQ}@0,{16 * SEQ}@{4 * 8 * SEQ},{32 * SEQ}@{16 * 8 * SEQ}"


def schedule_config(**trainer):
    c = default_config()
    m = c.model
    m.vocab_size, m.d_model, m.n_layers, m.n_dense_layers = 128, 32, 2, 0
    m.n_heads, m.n_kv_heads = 4, 2
    m.moe.num_experts, m.moe.top_k, m.moe.expert_hidden = 4, 2, 32
    c.parallel.data, c.parallel.expert = 1, 2
    t = c.trainer
    t.global_batch_size, t.seq_len, t.grad_accum = MICRO, SEQ, 1
    t.max_steps, t.max_tokens = 0, 40 * 8 * SEQ
    t.batch_size_schedule = SCHEDULE
    for k, v in trainer.items():
        setattr(t, k, v)
    return config_lib.validate(c)


@pytest.fixture(scope="module")
def planned():
    """(run, {size: Plan}, {"text", "json"}): plan_config's steps on 2 of the fake devices."""
    run = schedule_config()
    by_size = api.plan_sizes(run, jax.devices()[:2], "h100", hardware.device_spec("h100"))
    _, text, out = api.plan_run(run, by_size)
    return run, by_size, {"text": "\n\n".join(text), "json": out}


def test_sizes_the_run_takes():
    t = schedule_config().trainer
    # 4 steps of 8, then 16 from 1,024 tokens... (the schedule's own segments)
    sizes = batch_sizes.run_sizes(t)
    assert [(r.size, r.first_step) for r in sizes] == [(8, 0), (16, 4), (32, 10)]
    assert sum(r.steps for r in sizes) == t.total_steps
    assert sum(r.steps * r.size * SEQ for r in sizes) == t.tokens_before(t.total_steps)
    # A size that starts after the run's end is not planned; without a schedule, one size.
    short = schedule_config(max_tokens=0, max_steps=6).trainer
    assert [(r.size, r.steps) for r in batch_sizes.run_sizes(short)] == [(8, 4), (16, 2)]
    plain = schedule_config(batch_size_schedule="", max_tokens=0, max_steps=7).trainer
    assert batch_sizes.run_sizes(plain) == [batch_sizes.RunSize(8, 7, 0)]


def test_one_compiled_plan_per_size(planned):
    run, by_size, out = planned
    print(out["text"])
    rows = out["json"]["run"]["sizes"]
    assert [(r["batch_size"], r["grad_accum"], r["tokens_per_step"]) for r in rows] == [
        (8, 1, 8 * SEQ), (16, 2, 16 * SEQ), (32, 4, 32 * SEQ)]
    assert [r["steps"] for r in rows] == [4, 6, run.trainer.total_steps - 10]
    for size, plan in by_size.items():
        ga = run.trainer.grad_accum_at(size)
        assert plan.step.batch.shape == (ga, size // ga, SEQ + 1)  # the trainer's batch
        assert plan.step.grad_accum == ga and plan.step.tokens_per_step == size * SEQ
    # Per token, the compiled matmuls are the same at every size: the accumulation loop is
    # counted by its trip count (not a scaling by hand: each is its own program's walk).
    dots = {s: sum(p.hlo.values()) for s, p in by_size.items()}
    assert dots[16] == pytest.approx(dots[8], rel=1e-9)
    assert dots[32] == pytest.approx(dots[8], rel=1e-9)
    flops = {s: p.cost.flops for s, p in by_size.items()}
    assert flops[8] < flops[16] < flops[32]
    # Step times grow with the microbatches, each from its own program (the update's cost
    # is paid once a step, so not in proportion to the tokens).
    step = {r["batch_size"]: r["step_s"] for r in rows}
    assert step[8] < step[16] < step[32]
    assert {r["batch_size"]: r["tokens_per_s_per_device"] for r in rows} == {
        s: pytest.approx(s * SEQ / 2 / step[s]) for s in step}
    # Memory: one microbatch has no float32 gradient sums; 2 and 4 microbatches are the
    # same loop, apart from the batch argument's bytes.
    peak = {r["batch_size"]: r["peak_bytes"] for r in rows}
    params = by_size[8].args["params"]
    assert peak[16] - peak[8] >= params  # the float32 sums: the size of the parameters
    batch = {s: p.args["batch"] for s, p in by_size.items()}
    assert peak[32] - peak[16] == batch[32] - batch[16] > 0


def test_the_largest_size_is_the_detailed_plan_and_is_checked(planned):
    run, by_size, out = planned
    plan, rp = out["json"]["plan"], out["json"]["run"]
    assert plan["batch_size"] == 32 and plan["grad_accum"] == 4
    assert plan["peak_bytes"] == max(r["peak_bytes"] for r in rp["sizes"])
    assert plan["fits"] is True and plan["memory_limit_bytes"] == 80e9 and not plan["errors"]
    assert all(r["fits"] for r in rp["sizes"]) and not rp["errors"]
    text = out["text"]
    assert "32 x 32 tokens per step in 4 microbatch(es)" in text
    assert f"Batch sizes (trainer.batch_size_schedule={SCHEDULE})" in text
    # The run: the schedule's steps and tokens, each size's step time x its steps.
    t = run.trainer
    assert rp["steps"] == t.total_steps and rp["tokens"] == t.tokens_before(t.total_steps)
    assert rp["binds"] == "trainer.max_tokens"
    assert rp["time_s"] == pytest.approx(sum(r["steps"] * r["step_s"] for r in rp["sizes"]))
    assert rp["time_s_scheduled"] == pytest.approx(
        sum(r["steps"] * r["scheduled_s"] for r in rp["sizes"]))
    assert f"run          {t.total_steps} steps, {rp['tokens']:,} tokens" in text


def test_a_largest_size_that_does_not_fit_is_an_error(planned):
    run, by_size, out = planned
    peaks = {s: p.counted_peak_bytes for s, p in by_size.items()}
    limit_gb = (peaks[8] + peaks[16]) / 2 / 2**30  # the first size fits, the larger do not
    limited = run.with_values({"trainer.memory_limit_gb": limit_gb})
    rebuilt = {s: plan_build.build(dataclasses.replace(p.step, cfg=limited), p.spec)
               for s, p in by_size.items()}  # the same programs, checked against the limit
    plan, text, out = api.plan_run(limited, rebuilt)
    run_plan = batch_sizes.build(limited.trainer, rebuilt)
    assert plan.step.batch_size == 32 and plan.fits is False
    assert [s.run.size for s in run_plan.unfit()] == [16, 32]
    text = "\n\n".join(text)
    assert "does NOT fit" in text.split("Memory per device")[1].split("\n\n")[0]
    errors = [line for line in text.splitlines() if line.startswith("  ERROR")]
    assert len(errors) == 2 and all("trainer.batch_size_schedule's batch of" in e for e in errors)
    assert "batch of 32 sequences" in errors[1] and "trainer.memory_limit_gb=" in errors[1]
    rows = text.split("Batch sizes (")[1].splitlines()
    assert [row.split()[-1] for row in rows[2:5]] == ["yes", "NO", "NO"]
    assert out["run"]["errors"] == plan.errors == out["plan"]["errors"]
    assert [r["fits"] for r in out["run"]["sizes"]] == [True, False, False]


def test_the_report_lists_every_size(planned):
    """The plan report's "Batch sizes" section (report/plan_view.py) is the run's JSON: a row
    per size, with its microbatches, steps and its own step's projection and peak."""
    from olmo_jax.report import plan_view

    run, by_size, out = planned
    data = plan_view.sizes_data(out["json"]["run"], "h100")
    rows = data["table"]["rows"]
    last = f"{run.trainer.total_steps - 10:,}"
    assert [(r[0], r[2], r[4]) for r in rows] == [(8, 1, "4"), (16, 2, "6"), (32, 4, last)]
    assert [r[9] for r in rows] == [f"{by_size[s].counted_peak_bytes / 1e6:,.2f} MB" for s in (8, 16, 32)]
    assert len({r[5] for r in rows}) == 3  # each size's own step time
    assert f"trainer.batch_size_schedule={SCHEDULE}" in data["note"]
    assert f"{run.trainer.total_steps:,} steps" in data["note"]
