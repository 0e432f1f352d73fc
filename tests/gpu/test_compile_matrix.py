"""The real training step, compiled by XLA:GPU for abstract GPUs (olmo_jax.targets): every
combination of GPU, expert dispatch, grouped-matmul implementation and expert precision
either compiles on the GPU path it names or is refused while the plan is built.

The step is `python -m olmo_jax.train`'s: `compile_train_step(run, devices,
trainer_step=True)` builds the plan, the abstract state (with the bad-step guard's
counters), the guarded train step and `plan.jit_train_step`, lowers it on
ShapeDtypeStructs carrying the state's shardings and compiles it. One compile option
differs from the trainer's: `xla_gpu_autotune_level=0` (COMPILE_OPTIONS). Without a GPU
XLA cannot time candidate kernels anyway; at level 0 it takes each Triton GEMM fusion's
default tiling instead of compiling the candidates, the same HLO, fusions, custom calls,
collectives and buffers, in ~60% of the compile time (5.7 instead of 9.8 CPU seconds for
an 8-GPU cell).

Cells (ids `<kind>x<gpus>-<dispatch>-<gmm_impl>-<precision>[-pipe2-<schedule>]`):
  - 1 H200, dispatch local, x model.moe.gmm_impl {auto, ragged_dot, pallas, pallas_tcgen05} x
    model.moe.precision {bf16, mxfp8};
  - 8 H200 and 8 B300 (parallel.data=2, parallel.expert=4) x parallel.dispatch {rowwise,
    ragged, allgather} x the same gmm_impl x precision;
  - 8 B200, the same mesh, x dispatch, gmm_impl=auto in bf16 (Blackwell's default path);
  - 8 H200, parallel.pipe=2 x data=2 x expert=2, one cell per pipeline schedule.
One MoE block with d_model 128, 8 experts top-2, seq 64, vocab 256 in bfloat16 (`matrix_config`);
the pipelined cells have a dense first block and 2 MoE blocks (4 for interleaved 1F1B, 2
chunks a stage). The other cells leave out `cell_config`'s dense first block: no GPU-path
choice lives in it (each such cell asserts that its plan resolves the same kernels and model
config with the dense block), its attention is the MoE block's and its SwiGLU plain GEMMs,
and it compiles on H200s in the pipelined cells and in tests/gpu's doc-mask and window steps.
Without it a cell compiles about a quarter faster (177 fusions instead of 254 for an
8-GPU Pallas cell).

Phases. (1) The config is validated and the plan built: the only place a cell may be
refused, with a ConfigError / ValueError naming the field, and only the cells of REFUSED
(a refusal elsewhere fails; so does building a plan REFUSED says must be refused).
(2) Trace, lower, compile: any exception fails the cell. (3) The compiled program is on
the path the cell asks for (`path_problems`): native ragged_all_to_all for
dispatch=ragged (not the dense emulation CPU runs); the expert GEMMs in the cell's layout
(`expert_layout`: every dispatch runs the resolved grouped matmul, rowwise over its
equal-sized capacity groups, which the Pallas kernels read in place as the all_to_all
delivers them (sender-major slots, no transposes of the expert rows; the batched einsum
transposes them: `receive_transposes`): the Pallas kernel's wgmma Mosaic GPU calls for pallas (= auto
on Hopper), its tcgen05 calls for pallas_tcgen05 (= auto on Blackwell in bf16; the B200
cells compile it, the B300 auto cells are its twins), jax.lax.ragged_dot for ragged_dot;
MXFP8 on Blackwell takes the batched / blocked einsum layouts, and no cell but an
explicit ragged_dot compiles a dense product
over the expert groups (`gpu_hlo.dense_grouped_dots`: XLA:GPU lowers every ragged_dot
so, which the explicit cells show); cuDNN block-scaled
GEMMs for MXFP8 experts on Blackwell (`block_scaled_expected`), none on Hopper or in
bf16; the fused MXFP8 quantizer kernel on both; cuDNN fused attention forward and
backward and no [T, S] score buffer in the optimized HLO (`attention_problems`;
model.attention_impl=auto in bfloat16; its control, the xla attention core's forward and
backward on one GPU, has no cuDNN call and score buffers the check finds); stage-to-stage
sends in the pipelined cells. A step that compiled a CPU path for a GPU mesh fails here.

An `auto` cell whose resolution the matrix also names explicitly (on Hopper auto is pallas,
on a B300 in bf16 pallas_tcgen05)
builds the twin cell's plan too and asserts the same resolved model config and kernels,
the whole input of the compiled program; it is not compiled a second time (status
"same"). The session prints each cell's status and wall times (tests/gpu/results.py).
"""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from olmo_jax import config as config_lib
from olmo_jax import targets
from olmo_jax.config import default_config
from olmo_jax.model.attention import causal_attention
from olmo_jax.parallel.strategy import build_plan
from olmo_jax.planner import gpu_hlo, hlo_cost
from olmo_jax.planner.compile import compile_train_step, model_config
from tests.gpu import results

# Each cell records its lower and compile seconds: compiled for real, not read from the
# run's persistent compilation cache (tests/conftest.py).
pytestmark = pytest.mark.no_compile_cache

GMM_IMPLS = ("auto", "ragged_dot", "pallas", "pallas_tcgen05")
PRECISIONS = ("bf16", "mxfp8")
DISPATCHES = ("rowwise", "ragged", "allgather")
SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")
HOPPER, BLACKWELL = ("h100", "h200"), ("b200", "b300")
COMPILE_OPTIONS = {"xla_gpu_autotune_level": 0}
SEQ_LEN = 64
# rowwise: C = ceil(8 x 64 tokens x top-2 / 8 experts) = 128 slots per (sender, expert),
# one row block of the Pallas kernels, which then read the receive buffer in place
ROWWISE_CF = 8.0

# Cells refused while the plan is built: (kind, gmm_impl) or (kind, gmm_impl, precision)
# -> what the message must name.
REFUSED = {
    # The Pallas grouped matmuls are per architecture: wgmma (Hopper), tcgen05 (Blackwell).
    ("b300", "pallas"): "model.moe.gmm_impl",
    ("h200", "pallas_tcgen05"): "model.moe.gmm_impl",
    ("b300", "pallas_tcgen05", "mxfp8"): "model.moe.precision=mxfp8",  # no MXFP8 version
}


def refused(cell) -> str | None:
    return REFUSED.get((cell.kind, cell.gmm)) or REFUSED.get((cell.kind, cell.gmm, cell.precision))


@dataclasses.dataclass(frozen=True)
class Cell:
    kind: str
    n: int
    dispatch: str  # "local" on one GPU
    gmm: str
    precision: str
    schedule: str = ""  # parallel.pipe=2 cells

    @property
    def id(self) -> str:
        s = f"{self.kind}x{self.n}-{self.dispatch}-{self.gmm}-{self.precision}"
        return s + (f"-pipe2-{self.schedule}" if self.schedule else "")

    @property
    def resolved_gmm(self) -> str:
        """What model.moe.gmm_impl must resolve to on this GPU (model.dtype bfloat16)."""
        if self.gmm != "auto":
            return self.gmm
        if self.kind in HOPPER:
            return "pallas"
        # Blackwell: the tcgen05 kernel in bf16; MXFP8 runs the blocked scaled_matmul einsum
        return "pallas_tcgen05" if self.precision == "bf16" else "einsum"


CELLS = (
    [Cell("h200", 1, "local", g, p) for g in GMM_IMPLS for p in PRECISIONS]
    + [Cell(k, 8, d, g, p) for k in ("h200", "b300") for d in DISPATCHES for g in GMM_IMPLS
       for p in PRECISIONS]
    + [Cell("b200", 8, d, "auto", "bf16") for d in DISPATCHES]
    + [Cell("h200", 8, "rowwise", "auto", "bf16", s) for s in SCHEDULES]
)


def cell_config(cell: Cell):
    c = default_config()
    m = c.model
    m.vocab_size, m.d_model, m.n_heads, m.n_kv_heads = 256, 128, 4, 2
    m.n_layers, m.n_dense_layers, m.dense_hidden = 2, 1, 256
    m.moe.num_experts, m.moe.top_k, m.moe.expert_hidden = 8, 2, 128
    m.dtype = "bfloat16"
    m.moe.gmm_impl, m.moe.precision = cell.gmm, cell.precision
    p, t = c.parallel, c.trainer
    t.global_batch_size, t.seq_len = 8, SEQ_LEN
    if cell.n > 1:
        p.data, p.expert, p.dispatch = 2, 4, cell.dispatch
        if cell.dispatch == "rowwise":  # 128 slots per (sender, expert): one 128-row block
            m.moe.capacity_factor = ROWWISE_CF
    if cell.schedule:
        interleaved = cell.schedule == "interleaved_1f1b"
        m.n_layers = 1 + (4 if interleaved else 2)
        p.pipe, p.data, p.expert = 2, 2, 2
        p.pipeline_schedule, p.microbatches = cell.schedule, 4
        p.virtual_stages = 2 if interleaved else 1
        t.global_batch_size = 16
    return c


def matrix_config(cell: Cell):
    """What the cell compiles: `cell_config` without the dense first block, except in the
    pipelined cells (module docstring)."""
    c = cell_config(cell)
    if not cell.schedule:
        c.model.n_layers, c.model.n_dense_layers = 1, 0
    return c


def expert_layout(cell: Cell) -> str:
    """How the cell's expert GEMMs run: the resolved grouped matmul over rows grouped by
    expert (pallas: the Pallas kernel; ragged_dot: jax.lax.ragged_dot; rowwise's capacity
    buffers are such groups of equal size), or with einsum (auto on Blackwell)
    batched products: over rowwise's capacity buffers, or the blocked dropless layout."""
    r = cell.resolved_gmm
    if r in ("pallas", "pallas_tcgen05", "ragged_dot"):
        return {"pallas": "pallas", "pallas_tcgen05": "tcgen05", "ragged_dot": "ragged"}[r]
    return "batched" if cell.dispatch == "rowwise" else "blocked"


def block_scaled_expected(cell: Cell) -> bool:
    """MXFP8 experts on Blackwell run cuDNN block-scaled GEMMs in the batched and blocked
    layouts (gmm_impl=auto must pick one there); ragged_dot dequantizes."""
    return (cell.kind in BLACKWELL and cell.precision == "mxfp8"
            and expert_layout(cell) in ("batched", "blocked"))


def path_problems(cell: Cell, step) -> list[str]:
    """What in the compiled program contradicts the path the cell asks for."""
    module = step.module
    stablehlo = step.lowered.as_text()
    colls = gpu_hlo.collective_counts(module)
    kernels = gpu_hlo.mosaic_gpu_kernels(module)
    wgmma = [k for k in kernels if k.wgmma]
    tcgen05 = [k for k in kernels if k.tcgen05]
    scaled = gpu_hlo.block_scaled_dots(module)
    layout, want_scaled = expert_layout(cell), block_scaled_expected(cell)
    out = []
    if cell.dispatch == "ragged" and colls["ragged-all-to-all"] == 0:
        out.append(f"dispatch=ragged has no native ragged-all-to-all (collectives {dict(colls)}): "
                   "the dense emulation was compiled")
    if layout == "pallas" and len(wgmma) < 3:
        out.append(f"gmm_impl={cell.gmm} must run the Pallas grouped matmul on {cell.kind}: "
                   f"{len(wgmma)} wgmma Mosaic GPU kernels (of {len(kernels)} Mosaic calls)")
    if layout != "pallas" and wgmma:
        out.append(f"{len(wgmma)} Pallas grouped-matmul kernels in the {layout} layout")
    if layout == "tcgen05" and len(tcgen05) < 3:
        out.append(f"gmm_impl={cell.gmm} must run the Blackwell grouped matmul on {cell.kind}: "
                   f"{len(tcgen05)} tcgen05 Mosaic GPU kernels (of {len(kernels)} Mosaic calls)")
    if layout != "tcgen05" and tcgen05:
        out.append(f"{len(tcgen05)} Blackwell grouped-matmul kernels in the {layout} layout")
    moved = receive_transposes(module)
    in_place = (cell.dispatch == "rowwise" and cell.precision == "bf16" and not cell.schedule
                and layout in ("pallas", "tcgen05"))  # ffn.reads_slots (ROWWISE_CF's slots)
    if in_place and moved:
        out.append(f"the {layout} kernels must read rowwise's sender-major receive slots in "
                   f"place: {len(moved)} transposes of expert rows ({moved[:2]})")
    if cell.dispatch == "rowwise" and layout == "batched" and not cell.schedule and not moved:
        out.append("the batched einsum runs on group-major rows: its transposes of the "
                   "receive buffer are missing, so receive_transposes no longer sees them")
    if layout == "ragged" and not want_scaled and "ragged_dot" not in stablehlo:
        out.append(f"gmm_impl={cell.gmm} must resolve to ragged_dot on {cell.kind}: the "
                   "StableHLO has no ragged_dot")
    dense = gpu_hlo.dense_grouped_dots(module)
    if layout == "ragged" and not want_scaled and not dense:
        out.append("jax.lax.ragged_dot compiled without a dense product over the groups: "
                   "gpu_hlo.dense_grouped_dots no longer sees this XLA:GPU's lowering")
    if layout != "ragged" and dense:
        out.append(f"{len(dense)} dense products over the expert groups in the {layout} layout")
    if want_scaled and scaled == 0:
        out.append(f"MXFP8 experts on {cell.kind} ({layout} layout, gmm_impl={cell.gmm}) "
                   "compiled no cuDNN block-scaled GEMM (__cudnn$blockScaledDot)")
    if scaled and (cell.kind in HOPPER or cell.precision == "bf16"):
        out.append(f"{scaled} block-scaled GEMMs on {cell.kind} in {cell.precision}")
    if cell.precision == "mxfp8" and not [k for k in kernels if not (k.wgmma or k.tcgen05)]:
        out.append("MXFP8 weights quantized without the fused Pallas quantizer kernel "
                   "(kernels.mxfp8_quant.quantize_rowcol on sm_90+)")
    out += attention_problems(cell, module)
    if cell.schedule and colls["collective-permute"] == 0:
        out.append(f"pipe=2 ({cell.schedule}) has no collective-permute between stages")
    if step.compiled.memory_analysis() is None:
        out.append("no memory analysis (buffer assignment) from the compiled step")
    return out


def receive_transposes(module) -> list[str]:
    """The transposes of floating-point rows among the routed experts' operations (names of
    the fusions): the rowwise receive buffer moved between its sender-major and
    group-major orders (the routing's integer bookkeeping is not counted)."""
    return [o.name for o in hlo_cost.program_cost(module).ops
            if o.scope == "routed_experts" and "transpose" in o.name
            and module.by_name[o.name].type_str.startswith(("bf16", "f16", "f32"))]


def attention_problems(cell: Cell, module, seq_len: int = SEQ_LEN) -> list[str]:
    """model.attention_impl=auto in bfloat16 must run cuDNN's fused attention forward and
    backward and leave no [T, S] score buffer in the optimized HLO."""
    out = []
    attention = {c.target for c in gpu_hlo.cudnn_attention(module)}
    if not {"__cudnn$fmhaSoftmax", "__cudnn$fmhaSoftmaxBackward"} <= attention:
        out.append(f"model.attention_impl=auto in bfloat16 on {cell.kind} must run cuDNN fused "
                   f"attention forward and backward: found {sorted(attention)}")
    if scores := hlo_cost.score_buffers(module, seq_len):
        out.append(f"{len(scores)} [T, S] attention score buffers next to cuDNN's fused "
                   f"attention, e.g. {scores[:3]}")
    return out


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"


def _plan(cell: Cell, config=None):
    run = config_lib.validate((config or matrix_config)(cell))
    return build_plan(run.parallel, run.trainer, model_config(run), optim=run.optim,
                      devices=targets.abstract_devices(cell.kind, cell.n))


def explicit_twin(cell: Cell) -> Cell | None:
    """The cell that names explicitly the gmm_impl this `auto` cell resolves to, where the
    matrix has one (on Hopper: pallas). Its plan builds the same model config (asserted),
    so its compile is this cell's: the auto cell checks the resolution, not the program
    again."""
    twin = dataclasses.replace(cell, gmm=cell.resolved_gmm)
    return twin if cell.gmm == "auto" and twin != cell and twin in CELLS else None


@pytest.mark.parametrize("cell", CELLS, ids=lambda c: c.id)
def test_cell(cell):
    cfg = matrix_config(cell)
    devices = targets.abstract_devices(cell.kind, cell.n)
    expected = refused(cell)
    t0 = time.perf_counter()
    try:  # phase 1: the only place a cell may be refused
        plan = _plan(cell)
        refusal = None
    except ValueError as e:  # ConfigError is one
        refusal = e
    if refusal is not None:
        ok = expected is not None and expected in str(refusal)
        results.record(cell.id, "refused" if ok else "FAILED", time.perf_counter() - t0,
                       note=_first_line(refusal))
        assert expected is not None, f"{cell.id} is refused but must compile: {refusal}"
        assert expected in str(refusal), f"the refusal must name {expected}: {refusal}"
        return
    assert plan.kernels.gmm == cell.resolved_gmm, (cell.id, plan.kernels)
    if not cell.schedule:  # no GPU-path choice lives in the dense block it leaves out
        full = _plan(cell, cell_config)
        assert full.kernels == plan.kernels, (full.kernels, plan.kernels)
        assert dataclasses.replace(full.model_cfg, n_layers=1, n_dense_layers=0) == plan.model_cfg
    if (twin := explicit_twin(cell)) is not None:  # the same program as a cell of its own
        twin_plan = _plan(twin)
        same = plan.model_cfg == twin_plan.model_cfg and plan.kernels == twin_plan.kernels
        results.record(cell.id, "same" if same else "FAILED", time.perf_counter() - t0,
                       note=f"resolves to {twin.id}'s model config and kernels: its program")
        assert same, (f"{cell.id} resolves like {twin.id} but builds another model config:\n"
                      f"  {plan.model_cfg}\n  {twin_plan.model_cfg}")
        return
    try:  # phase 2: trace, lower, compile
        step = compile_train_step(config_lib.validate(cfg), devices, trainer_step=True, options=COMPILE_OPTIONS)
    except Exception as e:
        results.record(cell.id, "FAILED", time.perf_counter() - t0, note=_first_line(e))
        raise
    problems = path_problems(cell, step)  # phase 3
    if expected is not None:
        problems.insert(0, f"compiled, but must be refused naming {expected}")
    results.record(cell.id, "wrongpath" if problems else "compiled", step.lower_s,
                   step.compile_s, "; ".join(problems))
    assert not problems, f"{cell.id}:\n  " + "\n  ".join(problems)


def test_xla_attention_core_leaves_score_buffers():
    """The control of `attention_problems`' score-buffer check: the xla attention core
    (model.attention_impl=xla; causal_attention in the model's `attention_scores` scope),
    forward and backward at the cells' attention shape, compiled for one H200, has no cuDNN
    attention, and the check finds its [B, K, G * T, S] score buffers."""
    cell = Cell("h200", 1, "local", "ragged_dot", "bf16")
    m = cell_config(cell).model
    N, K, H = m.n_heads, m.n_kv_heads, m.d_model // m.n_heads
    mesh = targets.make_mesh("h200", (1,), ("data",))
    spec = NamedSharding(mesh, PartitionSpec())

    def loss(q, k, v):
        with jax.named_scope("attention_scores"):
            return jnp.sum(causal_attention(q, k, v).astype(jnp.float32))

    args = [jax.ShapeDtypeStruct((2, SEQ_LEN, n, H), jnp.bfloat16, sharding=spec) for n in (N, K, K)]
    module = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(*args).lower().compile(
        COMPILE_OPTIONS).as_text()
    assert not gpu_hlo.cudnn_attention(module)
    scores = hlo_cost.score_buffers(module, SEQ_LEN)
    rows = N // K * SEQ_LEN  # one query chunk at this length
    assert any(s.endswith(f",{rows},{SEQ_LEN}]") for s in scores), scores
    problems = attention_problems(cell, module)
    assert len(problems) == 2 and "score buffers" in problems[1], problems
