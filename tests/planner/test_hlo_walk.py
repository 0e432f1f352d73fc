"""The HLO walk on hand-written modules, where every number is known: FLOPs and bytes of
each instruction kind, loop bodies multiplied by their trip counts (or counted once, as
XLA's cost analysis does), scopes from op_names and, for an instruction the compiler made
without one, from its data flow; tuple-element operands ("%t#2"); a collective widened by
the backend (convert before it, no op_name) reported at the JAX program's dtype."""

import re

import pytest

from olmo_jax.planner import comms, hlo, hlo_cost
from olmo_jax.planner.hlo.array_types import tuple_elements

MODULE = """HloModule m, num_partitions=4

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%fused_mul (p0: bf16[8,16]) -> f32[8,16] {
  %p0 = bf16[8,16]{1,0} parameter(0)
  %cv = f32[8,16]{1,0} convert(%p0), @routed_experts/convert_element_type@
  ROOT %m = f32[8,16]{1,0} multiply(%cv, %cv), @routed_experts/mul@
}

%fused_widen (q0: bf16[8,16]) -> f32[8,16] {
  %q0 = bf16[8,16]{1,0} parameter(0)
  ROOT %w = f32[8,16]{1,0} convert(%q0)
}

%body (p: (s32[], bf16[8,32], bf16[32,16])) -> (s32[], bf16[8,32], bf16[32,16]) {
  %p = (s32[], bf16[8,32]{1,0}, bf16[32,16]{1,0}) parameter(0)
  %x = bf16[8,32]{1,0} get-tuple-element(%p), index=1
  %w = bf16[32,16]{1,0} get-tuple-element(%p), index=2
  %d = bf16[8,16]{1,0} dot(%x, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}, @attention/dot_general@
  %d2 = bf16[8,16]{1,0} dot(%x, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %f = f32[8,16]{1,0} fusion(%d2), kind=kLoop, calls=%fused_mul
  %e = f32[8,16]{1,0} exponential(%f), @checkpoint/rematted_computation/router/exp@
  %r = f32[8]{0} reduce(%e, %zero), dimensions={1}, to_apply=%add, @router/reduce_sum@
  %zero = f32[] constant(0)
  %wide = f32[8,16]{1,0} fusion(%d), kind=kLoop, calls=%fused_widen
  %a2a = f32[8,16]{1,0} all-to-all(%wide), channel_id=1, GROUPS, @routed_experts/all_to_all@
  ROOT %t = (s32[], bf16[8,32]{1,0}, bf16[32,16]{1,0}) tuple(%i, %x, %w)
}

%cond (c: (s32[], bf16[8,32], bf16[32,16])) -> pred[] {
  %c = (s32[], bf16[8,32]{1,0}, bf16[32,16]{1,0}) parameter(0)
  ROOT %lt = pred[] constant(true)
}

ENTRY %main (x0: bf16[8,32], w0: bf16[32,16]) -> f32[8,16] {
  %x0 = bf16[8,32]{1,0} parameter(0), metadata={op_name="state.params"}
  %w0 = bf16[32,16]{1,0} parameter(1)
  %i0 = s32[] constant(0)
  %t0 = (s32[], bf16[8,32]{1,0}, bf16[32,16]{1,0}) tuple(%i0, %x0, %w0)
  %loop = (s32[], bf16[8,32]{1,0}, bf16[32,16]{1,0}) while(%t0), condition=%cond, body=%body, TRIP3
  %y = bf16[8,32]{1,0} get-tuple-element(%loop), index=1
  %sl = bf16[8,16]{1,0} slice(%loop#1), slice={[0:8], [0:16]}
  ROOT %out = f32[8,16]{1,0} convert(%sl), metadata={op_name="jit(f)/convert_element_type"}
}
"""

# @scope/op@: an op_name in the loop body; TRIP3: a known trip count of 3; GROUPS: a group.
MODULE = re.sub(r"@([^@]*)@", r'metadata={op_name="jit(f)/while/body/\1"}', MODULE).replace(
    "TRIP3", 'backend_config={"known_trip_count":{"n":"3"}}').replace(
    "GROUPS", "replica_groups=mesh['data'=2,'expert'=2] {'expert'}, dimensions={0}")
DOT = 2 * 8 * 16 * 32  # 8x32 @ 32x16


@pytest.fixture(scope="module")
def module():
    return hlo.parse_module(MODULE)


def test_parse_counts_contexts_and_tuple_operands(module):
    by = module.by_name
    assert by["d"].count == 3 and by["loop"].count == 1 and by["lt"].count == 4
    assert by["m"].context == "fused" and by["s"].context == "applied"
    assert by["d"].context == "top"
    assert module.type_of("loop#1") == "bf16[8,32]{1,0}"
    assert by["sl"].operands == ["loop#1"] and by["d"].operands == ["x", "w"]
    assert by["d"].attr("lhs_contracting_dims") == "{1}"
    assert tuple_elements("(s32[], /*index=1*/f32[2,3]{1,0}, (u8[4], f32[]))") == [
        "s32[]", "f32[2,3]{1,0}", "(u8[4], f32[])"]


def test_flops_and_bytes_multiply_trip_counts(module):
    cost = hlo_cost.program_cost(module)
    once = hlo_cost.program_cost(module, loops_once=True)
    # The named dot is attention; the unnamed one takes the scope of its consumer fusion
    # (routed_experts, inferred from the fused ops' op_names).
    assert cost.dot_flops["attention"] == 3 * DOT
    assert cost.dot_flops["routed_experts"] == 3 * DOT
    assert once.dot_flops["attention"] == DOT
    # Elementwise: fused convert + multiply (128 each) in routed_experts, the widening
    # convert (128, no op_name: its scope from its producer, attention), the final convert.
    assert cost.other_flops["routed_experts"] == 3 * 2 * 128
    assert cost.other_flops["router"] == 3 * (128 - 8)  # reduce: (128 - 8) adds
    assert cost.transcendentals == 3 * 128  # exp
    assert cost.recomputed_dot_flops == {}  # exp is remat'ed but is no dot
    # Bytes of the ops that run on their own: dots read 8x32 + 32x16 bf16, write 8x16 bf16.
    dot_bytes = (8 * 32 + 32 * 16 + 8 * 16) * 2
    ops = {(op.scope, op.dot_flops, op.bytes) for op in cost.ops}
    assert ("attention", DOT, dot_bytes) in ops
    assert once.bytes_accessed < cost.bytes_accessed
    slice_bytes = 2 * 8 * 16 * 2  # a slice reads only what it keeps, and writes it
    assert any(op.bytes == slice_bytes and op.count == 1 for op in cost.ops)
    widen = [op for op in cost.ops if op.backend_inserted]
    assert len(widen) == 1 and widen[0].count == 3  # the unnamed convert fusion


def test_widened_collective_is_reported_at_the_jax_dtype(module):
    (a2a,) = comms.collectives(module)
    assert a2a.kind == "all-to-all" and a2a.count == 3 and a2a.axes == ("expert",)
    assert a2a.group_size == 2
    assert a2a.bytes == 8 * 16 * 4 and a2a.jax_bytes == 8 * 16 * 2 and a2a.widened
    assert a2a.jax_bytes_per_run == 3 * 8 * 16 * 2


COND_MODULE = """HloModule c, num_partitions=1

%taken (a: f32[8,8]) -> f32[8,8] {
  %a = f32[8,8]{1,0} parameter(0)
  ROOT %d = f32[8,8]{1,0} dot(%a, %a), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%skipped (b: f32[8,8]) -> f32[8,8] {
  ROOT %b = f32[8,8]{1,0} parameter(0)
}

%body (p: (s32[], f32[8,8])) -> (s32[], f32[8,8]) {
  %p = (s32[], f32[8,8]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %x = f32[8,8]{1,0} get-tuple-element(%p), index=1
  %y = f32[8,8]{1,0} conditional(%i, %x, %x), branch_computations={%skipped, %taken}
  ROOT %t = (s32[], f32[8,8]{1,0}) tuple(%i, %y)
}

%cond (q: (s32[], f32[8,8])) -> pred[] {
  %q = (s32[], f32[8,8]{1,0}) parameter(0)
  ROOT %c = pred[] constant(true)
}

ENTRY %main (x0: f32[8,8]) -> (s32[], f32[8,8]) {
  %x0 = f32[8,8]{1,0} parameter(0)
  %z = s32[] constant(0)
  %init = (s32[], f32[8,8]{1,0}) tuple(%z, %x0)
  ROOT %w = (s32[], f32[8,8]{1,0}) while(%init), condition=%cond, body=%body, TRIP12
}
""".replace("TRIP12", 'backend_config={"known_trip_count":{"n":"12"}}')


def test_counted_splits_a_conditionals_runs_between_its_branches():
    from fractions import Fraction

    module = hlo.parse_module(COND_MODULE)
    one_dot = 2 * 8 * 8 * 8
    # Default: every branch runs every time the conditional does (12 loop iterations).
    assert module.by_name["d"].count == 12 and module.by_name["b"].count == 12
    assert hlo_cost.program_cost(module).total_dot_flops == 12 * one_dot
    # A schedule that takes the branch on 5 of the 12 iterations.
    counted = module.counted({"taken": Fraction(5, 12), "skipped": Fraction(7, 12)})
    assert counted.by_name["d"].count == 5 and counted.by_name["b"].count == 7
    assert counted.by_name["y"].count == 12  # the loop body itself is unchanged
    assert hlo_cost.program_cost(counted).total_dot_flops == 5 * one_dot
    assert counted.counted({"taken": Fraction(1, 8)}).by_name["d"].count == 1.5  # a mean
    # Per run of one branch: only what it reaches counts.
    rooted = module.counted(root="taken")
    assert rooted.by_name["d"].count == 1 and rooted.by_name["y"].count == 0
    assert hlo_cost.program_cost(rooted).total_dot_flops == one_dot
