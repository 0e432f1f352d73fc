"""The step replayed as scheduled (planner/overlap.py) on a hand-written scheduled module
where every time is known: a synchronous collective (the compute waits all of it), async
ones hidden fully and in part by the compute between start and done, two in flight at
once sharing the links, a loop whose body's collective waits on one issued before the
loop (replayed in place, then from the memo), a conditional weighted by its branches'
shares (HloModule.counted, as a pipeline schedule counts them), and the bounds: nothing
overlapped >= as scheduled >= collectives fully overlapped."""

from fractions import Fraction

import pytest

from olmo_jax.planner import comms, hardware, hlo, hlo_cost, overlap, roofline

MS = 1e-3
# 1e9 B/s of HBM and of link: a 1 MB op or collective-permute (a pair: bus factor 1) is 1 ms.
SPEC = hardware.DeviceSpec("test", {"bfloat16": 1e18, "float32": 1e18}, 1e12, 1e9, 1e9, 1e9,
                           gpus_per_node=8)
MESH = {"pipe": 1, "data": 1, "expert": 2}


def _permute(name: str, elems: int, scope: str) -> str:
    return (f"%{name}_comp (p_{name}: f32[{elems}]) -> f32[{elems}] {{\n"
            f"  %p_{name} = f32[{elems}]{{0}} parameter(0)\n"
            f"  ROOT %{name} = f32[{elems}]{{0}} collective-permute(%p_{name}), channel_id=1, "
            f'source_target_pairs={{{{0,1}},{{1,0}}}}, metadata={{op_name="{scope}/ppermute"}}\n'
            "}\n")


def _start(name: str, operand: str, elems: int) -> str:
    return (f"  %{name}_start = ((f32[{elems}]{{0}}), f32[{elems}]{{0}}) async-start(%{operand}), "
            f"calls=%{name}_comp\n")


def _done(name: str, elems: int) -> str:
    return f"  %{name}_done = f32[{elems}]{{0}} async-done(%{name}_start)\n"


def _work(name: str, operand: str) -> str:
    return f"  %{name} = f32[250000]{{0}} fusion(%{operand}), kind=kLoop, calls=%fused\n"


def _loop_body(i: int) -> str:
    return (f"%body{i} (s{i}: (s32[], f32[250000])) -> (s32[], f32[250000]) {{\n"
            f"  %s{i} = (s32[], f32[250000]{{0}}) parameter(0)\n"
            f"  %i{i} = s32[] get-tuple-element(%s{i}), index=0\n"
            f"  %x{i} = f32[250000]{{0}} get-tuple-element(%s{i}), index=1\n"
            + _start(f"send{i}", f"x{i}", 250000) + _work(f"c_loop{i}", f"x{i}")
            + _done(f"send{i}", 250000)
            + f"  ROOT %t{i} = (s32[], f32[250000]{{0}}) tuple(%i{i}, %send{i}_done)\n}}\n"
            f"%cond{i} (k{i}: (s32[], f32[250000])) -> pred[] {{\n"
            f"  %k{i} = (s32[], f32[250000]{{0}}) parameter(0)\n"
            f"  ROOT %b{i} = pred[] constant(true)\n}}\n")


MODULE = (
    "HloModule replay, is_scheduled=true, num_partitions=2\n\n"
    "%fused (q: f32[250000]) -> f32[250000] {\n  %q = f32[250000]{0} parameter(0)\n"
    "  ROOT %n = f32[250000]{0} negate(%q)\n}\n"
    + _permute("p1", 500000, "zero_gather") + _permute("p2", 500000, "zero_reduce")
    + _permute("p3", 250000, "moe_rowwise") + _permute("p4", 250000, "transpose(jvp())/moe_rowwise")
    + _permute("p6", 1000000, "muon_gather")
    + _permute("send1", 250000, "pipe_send") + _permute("send2", 250000, "pipe_send")
    + _loop_body(1) + _loop_body(2)
    + "%br_true (bt: f32[250000]) -> f32[250000] {\n  %bt = f32[250000]{0} parameter(0)\n"
    "  ROOT %c_true = f32[250000]{0} fusion(%bt), kind=kLoop, calls=%fused\n}\n"
    "%br_false (bf: f32[250000]) -> f32[250000] {\n  %bf = f32[250000]{0} parameter(0)\n"
    "  ROOT %c_false = f32[250000]{0} negate(%bf)\n}\n"
    "ENTRY %main (a: f32[250000], i: s32[], pr: pred[]) -> f32[250000] {\n"
    "  %a = f32[250000]{0} parameter(0)\n  %i = s32[] parameter(1)\n  %pr = pred[] parameter(2)\n"
    "  %p0 = f32[250000]{0} collective-permute(%a), channel_id=2, "
    'source_target_pairs={{0,1},{1,0}}, metadata={op_name="loss_allsum/ppermute"}\n'
    "  %a2 = f32[500000]{0} broadcast(%a), dimensions={}\n"
    + _start("p1", "a2", 500000) + _work("c1", "a") + _done("p1", 500000)
    + _start("p2", "a2", 500000) + _work("c2", "a") + _done("p2", 500000)
    + _start("p3", "a", 250000) + _start("p4", "a", 250000) + _work("c3", "a")
    + _done("p3", 250000) + _done("p4", 250000)
    + "  %init1 = (s32[], f32[250000]{0}) tuple(%i, %a)\n"
    '  %w1 = (s32[], f32[250000]{0}) while(%init1), condition=%cond1, body=%body1, '
    'backend_config={"known_trip_count":{"n":"3"}}\n'
    "  %a4 = f32[1000000]{0} broadcast(%a), dimensions={}\n"
    + _start("p6", "a4", 1000000)
    + "  %init2 = (s32[], f32[250000]{0}) tuple(%i, %a)\n"
    '  %w2 = (s32[], f32[250000]{0}) while(%init2), condition=%cond2, body=%body2, '
    'backend_config={"known_trip_count":{"n":"3"}}\n'
    + _done("p6", 1000000)
    + "  %cd = f32[250000]{0} conditional(%pr, %a, %a), true_computation=%br_true, "
    "false_computation=%br_false\n"
    "  ROOT %out = f32[250000]{0} add(%p0, %cd)\n}\n")

# Compute (roofline) seconds of the ops that have any (the rest: 0).
COMPUTE = {"c1": 3 * MS, "c2": 0.5 * MS, "c3": 1.5 * MS, "c_loop1": 0.25 * MS,
           "c_loop2": 0.25 * MS, "c_true": 2 * MS}


def _module(text: str = MODULE):
    m = hlo.parse_module(text)
    return m.counted({"br_true": Fraction(1, 4), "br_false": Fraction(3, 4)})


def _ops(m=None):
    """What hlo_cost.program_cost gives: per-execution costs, the runs per program run."""
    m = m or _module()
    return [hlo_cost.OpCost("other", m.instruction(n).count, 0.0, s * SPEC.hbm_bw, False, name=n)
            for n, s in COMPUTE.items()]


def test_replay_by_hand():
    m = _module()
    s = overlap.simulate(m, _ops(), SPEC, "bfloat16", MESH)
    # Timeline (ms): p0 synchronous 0-1; p1 (2) under c1 (3): t 4; p2 (2) on the links
    # 4-6 under c2 (0.5): waits to 6; p3 6-7 and p4 7-8 under c3 (to 7.5): p4 waits to 8;
    # loop 1: 3 x (send 1 under 0.25 of compute) = 3: t 11; p6 on the links 11-15; loop 2's
    # first send waits for the links (15-16, t 16), the other two run from the memo (2 x 1):
    # t 18, p6 long done; the conditional: 1/4 of its 2 ms branch: t 18.5.
    assert s.step_s == pytest.approx(18.5 * MS)
    assert s.compute_s == pytest.approx((3 + 0.5 + 1.5 + 6 * 0.25 + 0.5) * MS)
    assert s.link_s == pytest.approx((1 + 2 + 2 + 1 + 1 + 3 + 4 + 3) * MS)
    rows = {(r.purpose, r.phase): r for r in s.rows}
    assert {k: round(r.exposed_s / MS, 9) for k, r in rows.items()} == {
        ("loss_allsum", "fwd"): 1.0, ("zero_gather", "step"): 0.0, ("zero_reduce", "step"): 1.5,
        ("moe_rowwise", "fwd"): 0.0, ("moe_rowwise", "bwd"): 0.5,
        ("pipe_send", "fwd"): 3 * 0.75 + 4.75 + 2 * 0.75, ("muon_gather", "step"): 0.0}
    assert rows[("loss_allsum", "fwd")].async_runs == 0  # a plain collective: synchronous
    assert rows[("pipe_send", "fwd")].runs == rows[("pipe_send", "fwd")].async_runs == 6
    assert rows[("zero_gather", "step")].between_s == pytest.approx(3 * MS)
    assert rows[("moe_rowwise", "bwd")].between_s == pytest.approx(1.5 * MS)
    assert rows[("pipe_send", "fwd")].between_s == pytest.approx(6 * 0.25 * MS)
    assert rows[("muon_gather", "step")].between_s == pytest.approx(3 * MS)  # loop 2 alone
    assert rows[("muon_gather", "step")].between_by_scope == {"while": pytest.approx(3 * MS)}
    assert rows[("zero_gather", "step")].between_by_scope == {"other": pytest.approx(3 * MS)}
    assert sum(r.exposed_s for r in s.rows) == pytest.approx(s.exposed_s)


def test_the_replay_lies_between_the_bounds_and_matches_the_roofline():
    m = _module()
    ops = _ops(m)
    links = roofline.link_uses(comms.collectives(m))
    s = overlap.simulate(m, ops, SPEC, "bfloat16", MESH)
    p = roofline.project(ops, links, SPEC, "bfloat16", MESH, 1.0, 1.0, replayed_s=s.step_s)
    assert p.roofline_s == pytest.approx(s.compute_s)
    assert p.links_s == pytest.approx(s.link_s)
    assert p.overlapped_s < p.scheduled_s < p.step_s
    assert p.tokens_per_s(overlap="scheduled") == pytest.approx(1 / s.step_s)
    assert p.seconds("none") == p.step_s and p.seconds("full") == p.overlapped_s


def test_synchronous_collectives_hide_nothing():
    """Marked is_sync (XLA's converted pairs) or plain: the replay is roofline + links."""
    sync = MODULE.replace(
        "calls=%p", 'backend_config={"collective_backend_config":{"is_sync":true}}, calls=%p'
    ).replace("calls=%send", 'backend_config={"collective_backend_config":{"is_sync":true}}, '
              "calls=%send")
    m = _module(sync)
    s = overlap.simulate(m, _ops(m), SPEC, "bfloat16", MESH)
    assert all(r.async_runs == 0 and r.hidden_s == pytest.approx(0) for r in s.rows)
    assert s.step_s == pytest.approx(s.compute_s + s.link_s)
