"""The one HLO reader (olmo_jax/planner/hlo/) on real HLO: two XLA:GPU modules compiled
deviceless for 8 abstract H200s by the GPU compile venv's jax 0.12 (tests/planner/hlo/:
cuDNN fused attention forward and backward around a 3-step lax.scan, and a shard_map
all_to_all; their stack-frame tables left out), a lowered module's text, and the
hand-written fixtures of the planner's other tests. And the rule that makes it the one:
no module of olmo_jax outside planner/hlo/ uses `re` but the few listed below, none of
which reads HLO."""

import ast
import math
from pathlib import Path

import pytest

from olmo_jax.planner import comms, gpu_hlo, hlo
from olmo_jax.planner.hlo import array_types, backend_config, dumps, metadata

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
ATTENTION = (HERE / "hlo" / "h200_attention_scan.hlo").read_text()
ALL_TO_ALL = (HERE / "hlo" / "h200_all_to_all.hlo").read_text()
# jax.lax.ragged_dot(x [64, 32], w [4, 32, 16], group_sizes [4]) compiled by XLA:GPU for an
# abstract B300 (olmo_jax.targets): rows masked per group, one dot over all 4 groups' K.
RAGGED_DOT = (HERE / "hlo" / "b300_ragged_dot.hlo").read_text()
# A Mosaic GPU kernel's call as XLA:GPU prints it: the declared cost estimate is an MLIR
# string whose quotes are the escape \22 (the kernel's hash bytes are escaped the same way).
MOSAIC = (
    "HloModule m\n\nENTRY %e (x: bf16[64,32]) -> bf16[64,16] {\n"
    "  %x = bf16[64,32]{1,0} parameter(0)\n"
    '  ROOT %k = bf16[64,16]{1,0} custom-call(%x), custom_call_target="mosaic_gpu_v2", '
    r'backend_config={cost_estimate_json = "{\22flops\22: 65536, \22transcendentals\22: 0, '
    r'\22bytes_accessed\22: 6144, \22remote_bytes_transferred\22: 0}", '
    r'kernel_hash = "\DC\FCVH|\C6"}' "\n}\n")

# `jax.jit(lambda x: jnp.sin(x) @ x.T).lower(x).as_text(dialect="hlo")`: headers carry no
# signature and operands no `%`.
LOWERED = """HloModule jit__lambda, entry_computation_layout={(f32[4,4]{1,0})->f32[4,4]{1,0}}

ENTRY main.1 {
  x.1 = f32[4,4]{1,0} parameter(0)
  sin.1 = f32[4,4]{1,0} sine(x.1)
  transpose.1 = f32[4,4]{0,1} transpose(x.1), dimensions={1,0}
  ROOT dot_general.1 = f32[4,4]{1,0} dot(sin.1, transpose.1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}
"""


@pytest.fixture(scope="module")
def attention():
    return hlo.parse_module(ATTENTION)


def test_module_computations_and_loop_counts(attention):
    assert attention.entry == "main.6_spmd" and attention.num_partitions == 8
    assert hlo.num_partitions(ATTENTION) == 8
    loop = attention.by_name["while.18"]
    assert loop.opcode == "while" and loop.known_trip_count == 3 and loop.count == 1
    assert loop.computations("body") == ["region_0.1_spmd"]
    assert loop.computations("condition") == ["region_1.2_spmd"]
    assert loop.operands == ["tuple.13"]
    body = [i for i in attention.instructions if i.computation == "region_0.1_spmd"]
    cond = [i for i in attention.instructions if i.computation == "region_1.2_spmd"]
    assert body and all(i.count == 3 and i.trip_counts_known for i in body)
    assert cond and all(i.count == 4 for i in cond)  # tested once more than the body runs
    assert attention.roots["region_0.1_spmd"].opcode == "tuple"
    fused = [i for i in attention.instructions if i.context == "fused"]
    assert fused and all(attention.roots[i.computation].is_root for i in fused)


def test_custom_call_instructions(attention):
    fwd = attention.by_name["dot_product_attention_fwd.5"]
    assert fwd.opcode == "custom-call" and fwd.custom_call_target == "__cudnn$fmhaSoftmax"
    assert fwd.operands == ["param.4", "param.5", "param.6"]
    assert fwd.op_name.startswith("jit(loss)/jvp()/")
    assert array_types.tuple_elements(fwd.type_str) == ["bf16[2,4,128,64]{3,1,2,0}",
                                                   "f32[2,4,128]{2,1,0}", "u8[0]{0}"]
    assert attention.type_of("param.4") == "bf16[2,128,4,64]{3,2,1,0}"
    assert backend_config.intermediate_tensor_shape(fwd) == [2, 4, 128, 128]
    assert backend_config.causal_mask(fwd) and not backend_config.is_sync(fwd)
    assert backend_config.lhs_contracting_dimensions(fwd) == [3]  # Q K^T contracts H
    assert backend_config.cost_estimate(fwd) is None
    # operands past the 5th are written after an /*index=5*/ comment
    bwd = attention.by_name["dot_product_attention_bwd.8"]
    assert bwd.custom_call_target == "__cudnn$fmhaSoftmaxBackward"
    assert len(bwd.operands) == 6 and bwd.operands[-1] == "bitcast.10.0"
    assert attention.by_name["while.18"].custom_call_target is None
    # B N T S H = 2 4 128 128 64: 2 GEMMs forward, 5 backward, the causal 129/256 of each
    flops = 2 * 2 * 4 * 128 * 128 * 64 * 129 / 256
    assert gpu_hlo.custom_call_dot_flops(attention, fwd) == 2 * flops
    assert gpu_hlo.custom_call_dot_flops(attention, bwd) == 5 * flops


def test_ragged_dot_lowered_as_a_dense_product_over_the_groups():
    (dense,) = gpu_hlo.dense_grouped_dots(RAGGED_DOT)
    assert dense.op_name.endswith("ragged_dot_general") and dense.count == 1
    assert dense.flops == 4 * (2 * 64 * 32 * 16)  # every row against all 4 groups' weights
    assert gpu_hlo.dense_grouped_dots(ATTENTION) == []


def test_a_mosaic_kernels_declared_cost_estimate():
    module = hlo.parse_module(MOSAIC)
    kernel = module.by_name["k"]
    assert backend_config.cost_estimate(kernel) == {
        "flops": 65536, "transcendentals": 0, "bytes_accessed": 6144,
        "remote_bytes_transferred": 0}
    assert gpu_hlo.custom_call_dot_flops(module, kernel) == 65536
    assert gpu_hlo.uncounted_kernels(module) == []


def test_collective_instructions():
    module = hlo.parse_module(ALL_TO_ALL)
    (a2a,) = [i for i in module.instructions if i.opcode == "all-to-all"]
    assert a2a.replica_group(module.num_partitions) == (8, ("x",))
    assert backend_config.is_sync(a2a)
    assert a2a.attr("dimensions") == "{0}" and a2a.attr("channel_id") == "1"
    assert a2a.op_name == "jit(<lambda>)/shard_map/all_to_all"
    (c,) = comms.collectives(module)
    assert (c.kind, c.bytes, c.group_size, c.axes) == ("all-to-all", 8 * 16 * 2, 8, ("x",))
    assert comms.all_to_all_ops(ALL_TO_ALL) == [8 * 16 * 2]


def test_replica_groups_of_each_form():
    line = ("HloModule m, num_partitions=4\n\nENTRY %e (x: f32[8]) -> f32[8] {{\n"
            "  %x = f32[8]{{0}} parameter(0)\n  ROOT %a = f32[8]{{0}} {}\n}}\n")
    groups = {"all-reduce(%x), channel_id=1, replica_groups=[1,4]<=[4], to_apply=%add": (4, ()),
              "all-reduce(%x), channel_id=1, replica_groups={{0,1},{2,3}}, to_apply=%add": (2, ()),
              "collective-permute(%x), channel_id=1, source_target_pairs={{0,1},{1,0}}": (2, ()),
              "all-reduce(%x), replica_groups=mesh['data'=2,'expert'=2] {'data','expert'}":
                  (4, ("data", "expert")),
              "all-reduce(%x), channel_id=1, to_apply=%add": (4, ())}
    for text, want in groups.items():
        module = hlo.parse_module(line.format(text))
        assert module.by_name["a"].replica_group(module.num_partitions) == want, text


def test_lowered_text():
    module = hlo.parse_module(LOWERED)
    assert module.entry == "main.1"
    assert [i.opcode for i in module.instructions] == ["parameter", "sine", "transpose", "dot"]
    dot = module.by_name["dot_general.1"]
    assert dot.is_root and dot.attr("lhs_contracting_dims") == "{1}" and dot.count == 1
    assert dot.operands == []  # no % names: the lowered text's operands are not read


def test_reduce_window_and_attributes():
    text = ("HloModule m\n\nENTRY %e (x: f32[4,6]) -> f32[4,3] {\n"
            "  %x = f32[4,6]{1,0} parameter(0)\n  %z = f32[] constant(0)\n"
            "  ROOT %rw = f32[4,3]{1,0} reduce-window(%x, %z), window={size=2x3 stride=1x2}, "
            "to_apply=%add\n}\n")
    rw = hlo.parse_module(text).by_name["rw"]
    assert rw.window_elements == 6 and rw.attr("to_apply") == "%add"
    assert rw.computations("to_apply") == ["add"] and rw.attr("missing") is None


def test_shapes():
    t = "(bf16[2,4,128,64]{3,1,2,0}, f32[2,4,128]{2,1,0}, u8[0]{0})"
    assert array_types.arrays(t) == [("bf16", "2,4,128,64"), ("f32", "2,4,128"), ("u8", "0")]
    assert array_types.dims(t) == [2, 4, 128, 64] and array_types.elements(t) == 2 * 4 * 128 * 64
    assert array_types.type_bytes(t) == 2 * 4 * 128 * 64 * 2 + 2 * 4 * 128 * 4
    assert array_types.shape_bytes("(f32[], token[], f8e4m3fn[32,4])") == (4 + 128, ("f32[]", "f8e4m3fn[32,4]"))
    assert array_types.elements("s32[]") == 1 and array_types.dims("s32[]") == []
    assert array_types.tuple_elements("(s32[], /*index=1*/f32[2,3]{1,0}, (u8[4], f32[]))") == [
        "s32[]", "f32[2,3]{1,0}", "(u8[4], f32[])"]
    assert array_types.tuple_elements("bf16[8]{0}") == ["bf16[8]{0}"]
    assert all(math.log2(b).is_integer() for b in array_types.DTYPE_BYTES.values())


def test_op_name_metadata():
    op = "jit(train_step)/jvp()/attention/attention_scores/bkmh,bkah->bkma/dot_general"
    assert metadata.in_scope(op, "attention_scores") and metadata.in_scope(op, "attention")
    assert metadata.in_scope("jvp(router)", "router") and metadata.in_scope("a/lm_head", "lm_head")
    assert not metadata.in_scope(op, "attention_score") and not metadata.in_scope("x_router/y", "router")
    assert metadata.in_collective_scope("jit(f)/transpose(jvp())/moe_rowwise/ppermute", "moe_rowwise")
    assert metadata.in_collective_scope("jvp(loss_allsum)/psum", "loss_allsum")
    assert not metadata.in_collective_scope("a/zero_gather", "zero_gather")  # the primitive's place
    assert metadata.argument("state.params['w']", "state") == "params"
    assert metadata.argument("batch", "state") is None and metadata.argument("xstate.a", "state") is None
    assert metadata.short_name("jit(f)/while/body/add.12") == "add" and metadata.short_name("fusion") == "fusion"
    roles = ("pipe_fwd", "pipe_bwd", "pipe_first", "pipe_last")
    cond = "jit(step)/while/body/pipe_fwd/cond/branch_1_fun/pipe_last/cond"
    assert metadata.cond_scope(cond, roles) == ("pipe_last", "jit(step)/while/body/pipe_fwd/cond/branch_1_fun")
    assert metadata.cond_scope(cond + "/add", roles) is None
    assert metadata.conds_within(cond, roles[:2]) == ["pipe_fwd"]


def test_live_range_dump():
    live = ("Some header\n  Live ranges at 7 (peak):\n    upd{}: 4096 bytes (cumulative: 4096 bytes)\n"
            "    loop{1}: 4096 bytes (cumulative: 8192 bytes)\n\n  Live ranges at 9:\n    x{}: 1 bytes\n")
    assert dumps.read_peak(live) == [("upd", "", 4096), ("loop", "1", 4096)]


# Modules of olmo_jax that use `re` for something other than HLO, and what they read.
NOT_HLO = {
    "data/mixture.py": "glob patterns of a source's paths (OLMo-core's ** semantics)",
    "evals/classic.py": "olmo_eval's text clean-ups of its classic tasks' documents",
    "evals/mmlu.py": "the few-shot count in an MMLU prompt-variation name",
    "host_memory.py": "the device count in XLA_FLAGS",
    "model/mxfp8_gemm.py": "einsum specs of the MXFP8 matmul",
    "report/run_charts.py": "metric names of a run's log (<group>/block<i>)",
    "shapes.py": "dimension suffixes of variable names (x_BTD)",
    "targets/__init__.py": "XLA:GPU target configs (protobuf text)",
}


def _uses_re(path: Path) -> bool:
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import) and any(a.name == "re" for a in node.names):
            return True
        if isinstance(node, ast.ImportFrom) and node.module == "re":
            return True
    return False


def test_no_regular_expressions_outside_the_hlo_reader():
    pkg = REPO / "olmo_jax"
    users = {p.relative_to(pkg).as_posix() for p in pkg.rglob("*.py") if _uses_re(p)}
    reader = {u for u in users if u.startswith("planner/hlo/")}
    assert reader, "the HLO reader's modules import re"
    stray = users - reader - set(NOT_HLO)
    assert not stray, f"move the HLO parsing of {sorted(stray)} into olmo_jax/planner/hlo/"
    stale = set(NOT_HLO) - users
    assert not stale, f"{sorted(stale)} no longer use re: remove them from NOT_HLO"
