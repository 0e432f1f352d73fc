"""What a compiled XLA:GPU program runs, read from its HLO: the collectives by kind and the
library / kernel custom calls, so a test or a plan can say which path a step took.

    module = hlo.parse_module(compiled)            # or pass the Compiled / the HLO text
    collective_counts(module)   # Counter: all-to-all 6, ragged-all-to-all 2, ...
    block_scaled_dots(module)   # cuDNN MXFP8 GEMMs (jax.nn.scaled_matmul on Blackwell)
    cudnn_attention(module)     # cuDNN fused attention (forward and backward calls)
    mosaic_gpu_kernels(module)  # Pallas Mosaic GPU kernels; .wgmma / .tcgen05: a Hopper /
                                # Blackwell matmul kernel
    custom_call_dot_flops(module, ins)  # matmul FLOPs of a library / kernel custom call
    dense_grouped_dots(module)  # jax.lax.ragged_dot lowered as a dense product over groups

How each appears in XLA:GPU's compiled HLO (checked by tests/gpu/test_toolchain.py):
- Collectives run asynchronously: `all-reduce-start` / `all-reduce-done` pairs (likewise
  all-gather, collective-permute, all-to-all, ragged-all-to-all), or an `async-start`
  wrapping a computation that holds the plain op. Counted here: each plain op or `-start`,
  never the `-done` / `async-start` / `async-done` around it, so one collective is one.
- `jax.nn.scaled_matmul` lowers to the custom call `__op$block_scaled_dot`; XLA's
  block-scaling rewriter turns it into cuDNN's `__cudnn$blockScaledDot` when the target's
  cuDNN is >= 9.7 and the operands are MXFP8 (e4m3/e5m2 values, e8m0 scales, blocks of 32)
  — otherwise into a dequantize + ordinary dot, which is not counted.
- `jax.nn.dot_product_attention(implementation="cudnn")`: `__cudnn$fmha*` custom calls
  (`__cudnn$fmhaSoftmax` forward, `__cudnn$fmhaSoftmaxBackward`, ...).
- Pallas `plgpu.kernel` / Mosaic GPU: custom call `mosaic_gpu_v2` (older: `mosaic_gpu`)
  whose backend_config carries the kernel's MLIR module; a kernel issuing Hopper
  warpgroup MMAs names `wgmma` ops there (the grouped matmul does, the MXFP8 quantizer
  does not), one issuing Blackwell tensor-core MMAs `tcgen05` ops (the Blackwell grouped
  matmul, kernels/grouped_matmul_tcgen05.py). The op_name is the generic `mpmd_map`, so
  the module is what tells them apart.
- `jax.lax.ragged_dot`: this jaxlib's XLA:GPU (like XLA:CPU) has no grouped GEMM for it
  and rewrites it into a plain `dot` (op_name `.../ragged_dot_general`) over the rows
  masked per group, with the groups as a batch dimension, then a sum over them: every row
  is multiplied by every group's weights (`dense_grouped_dots`).

Matmul FLOPs of the custom calls (`custom_call_dot_flops`, what the planner's HLO walk
adds to the dots it counts itself; XLA:GPU's own GEMM fusions are dots it counts):
- cuBLAS GEMMs (`__cublas$gemm`, `__cublas$lt$matmul*`): 2 x result elements x the
  contracted size (the backend_config's `lhs_contracting_dimensions`);
- cuDNN fused attention: the backend_config's `intermediate_tensor_shape` is the [B, N, T, S]
  score shape; the head size H is q's (operand 0) elements / (B N T). The forward runs two
  GEMMs of 2 B N T S H FLOPs each (QK^T, PV), the flash backward five (QK^T recomputed from
  the saved log-sum-exp, dP, dV, dQ, dK); a CAUSAL mask computes the lower triangle,
  (S + 1) / 2S of the entries when T = S;
- cuDNN block-scaled GEMMs: 2 x result elements x lhs's last (contracted) dimension;
- Mosaic GPU kernels: the `cost_estimate_json` flops the kernel declared, else 0 (and
  `uncounted_kernels` lists them);
- the CPU expert FFN's FFI calls (olmo_jax/kernels/cpu_gmm.py, gmm_impl=blas): over the
  static buffer of R rows (operand 0, [R, D]) and w_gate [E, D, F], 3 GEMMs of 2 R D F
  forward, 6 backward (the routing runs only the routed rows, as a grouped GEMM would);
- the CPU attention core's FFI calls (olmo_jax/kernels/cpu_attention.py,
  attention_impl=blas): q (operand 0) [B, T, N, H]; 2 GEMMs of 2 B N T T H forward, 5
  backward (QK^T recomputed from the saved log-sum-exp, dV, dP, dQ, dK), each over the
  share of the [T, T] scores its query blocks compute (`cpu_attention.computed_fraction`);
  its QK-norm / RoPE calls and the RMSNorm ones (`CPU_FFI`) hold no matmul.
"""

from __future__ import annotations

import collections
import dataclasses
import math

from olmo_jax.planner import hlo
from olmo_jax.planner.hlo import backend_config
from olmo_jax.planner.hlo.array_types import dims

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "ragged-all-to-all",
               "collective-permute", "collective-broadcast")
BLOCK_SCALED_DOT = "__cudnn$blockScaledDot"
UNREWRITTEN_BLOCK_SCALED_DOT = "__op$block_scaled_dot"
MOSAIC_GPU = ("mosaic_gpu_v2", "mosaic_gpu")
CPU_SWIGLU = {"olmo_cpu_swiglu_fwd": (3, 3), "olmo_cpu_swiglu_bwd": (6, 5)}  # GEMMs, w_gate operand
CPU_ATTENTION = {"olmo_cpu_attention_fwd": 2, "olmo_cpu_attention_bwd": 5,  # GEMMs; the
                 # document-masked ones compute at most the causal share (counted as it)
                 "olmo_cpu_attention_doc_fwd": 2, "olmo_cpu_attention_doc_bwd": 5}
# every CPU FFI kernel (olmo_jax/kernels/cpu_ffi.py): opaque to XLA's own cost analysis
CPU_FFI = frozenset({*CPU_SWIGLU, *CPU_ATTENTION, "olmo_cpu_attention_prep_fwd",
                     "olmo_cpu_attention_prep_bwd", "olmo_cpu_rms_norm_fwd",
                     "olmo_cpu_rms_norm_bwd"})


def _module(program) -> hlo.HloModule:
    return program if isinstance(program, hlo.HloModule) else hlo.parse_module(program)


def _collective_kind(opcode: str) -> str | None:
    if opcode in COLLECTIVES:
        return opcode
    if opcode.endswith("-start") and opcode[: -len("-start")] in COLLECTIVES:
        return opcode[: -len("-start")]
    return None


def collective_counts(program, executions: bool = False) -> collections.Counter:
    """Collectives by kind (COLLECTIVES): instructions in the program, or with `executions`
    the times one run executes them (loop trip counts multiplied, hlo.parse_module)."""
    out: collections.Counter = collections.Counter()
    for ins in _module(program).instructions:
        if (kind := _collective_kind(ins.opcode)) is not None:
            out[kind] += ins.count if executions else 1
    return out


@dataclasses.dataclass(frozen=True)
class CustomCall:
    name: str
    target: str
    op_name: str
    count: int | float  # executions per program run


def custom_calls(program, prefix: str = "") -> list[CustomCall]:
    """Every custom call whose target starts with `prefix`."""
    out = []
    for ins in _module(program).instructions:
        target = ins.custom_call_target
        if target is not None and target.startswith(prefix):
            out.append(CustomCall(ins.name, target, ins.op_name, ins.count))
    return out


def custom_call_targets(program) -> collections.Counter:
    return collections.Counter(c.target for c in custom_calls(program))


def block_scaled_dots(program) -> int:
    """cuDNN block-scaled (MXFP8 / NVFP4) GEMM calls in the program."""
    return sum(1 for c in custom_calls(program, BLOCK_SCALED_DOT))


def cudnn_attention(program) -> list[CustomCall]:
    """cuDNN fused-attention calls (forward and backward)."""
    return custom_calls(program, "__cudnn$fmha")


@dataclasses.dataclass(frozen=True)
class MosaicKernel:
    name: str
    op_name: str
    wgmma: bool  # issues Hopper warpgroup MMAs (a matmul kernel)
    count: int | float
    tcgen05: bool = False  # issues Blackwell tcgen05 MMAs (a matmul kernel)


def mosaic_gpu_kernels(program) -> list[MosaicKernel]:
    """The Pallas Mosaic GPU kernel calls of the program."""
    out = []
    for ins in _module(program).instructions:
        if ins.custom_call_target in MOSAIC_GPU:
            out.append(MosaicKernel(ins.name, ins.op_name, "wgmma" in ins.args, ins.count,
                                    "tcgen05" in ins.args))
    return out


def call_target(ins: hlo.Instruction) -> str | None:
    """The custom call target of `ins` (None for other opcodes)."""
    return ins.custom_call_target


def custom_call_dot_flops(module: hlo.HloModule, ins: hlo.Instruction) -> float:
    """Matmul FLOPs of one execution of a custom call (module docstring); 0 for others."""
    target = call_target(ins)
    if target is None:
        return 0.0
    out = math.prod(dims(ins.type_str))
    if target.startswith("__cublas$"):
        contracting = backend_config.lhs_contracting_dimensions(ins)
        lhs = dims(module.type_of(ins.operands[0])) if ins.operands else []
        if contracting is None or not lhs:
            return 0.0
        return 2.0 * out * math.prod(lhs[d] for d in contracting)
    if target.startswith("__cudnn$fmha"):
        scores = backend_config.intermediate_tensor_shape(ins)
        if scores is None or not ins.operands:
            return 0.0
        B, N, T, S = scores
        H = math.prod(dims(module.type_of(ins.operands[0]))) / (B * N * T)
        gemms = 5 if "Backward" in target else 2
        causal = (S + 1) / (2 * S) if backend_config.causal_mask(ins) and T == S else 1.0
        return gemms * 2.0 * B * N * T * S * H * causal
    if target == BLOCK_SCALED_DOT and ins.operands:
        lhs = dims(module.type_of(ins.operands[0]))
        return 2.0 * out * lhs[-1] if lhs else 0.0
    if target in CPU_SWIGLU and len(ins.operands) > CPU_SWIGLU[target][1]:
        gemms, wg = CPU_SWIGLU[target]
        R, D = dims(module.type_of(ins.operands[0]))
        F = dims(module.type_of(ins.operands[wg]))[-1]
        return gemms * 2.0 * R * D * F
    if target in CPU_ATTENTION and ins.operands:
        from olmo_jax.kernels.cpu_attention import computed_fraction

        B, T, N, H = dims(module.type_of(ins.operands[0]))
        return CPU_ATTENTION[target] * 2.0 * B * N * T * T * H * computed_fraction(T)
    if target in MOSAIC_GPU:
        estimate = backend_config.cost_estimate(ins)
        if estimate is not None:
            return float(estimate.get("flops", 0))
    return 0.0


def uncounted_kernels(program) -> list[CustomCall]:
    """Mosaic GPU kernel calls that declare no cost estimate: their FLOPs are unknown."""
    return [c for c in custom_calls(program)
            if c.target in MOSAIC_GPU
            and backend_config.cost_estimate(_module(program).instruction(c.name)) is None]


@dataclasses.dataclass(frozen=True)
class DenseGroupedDot:
    name: str
    op_name: str
    count: int | float  # executions per program run
    flops: float  # per execution, as the dot runs (over every group)


def dense_grouped_dots(program) -> list[DenseGroupedDot]:
    """The dots a compiler made of `jax.lax.ragged_dot` (op_name `ragged_dot_general`):
    a grouped GEMM lowered as a plain dot runs every row against every group's weights
    (the rows masked per group, the products summed over the groups), the group count
    times the grouped FLOPs. A native lowering keeps a grouped op (a `ragged-dot`, a
    custom call or a kernel), never a `dot` with this op_name. XLA:GPU (this jaxlib) and
    XLA:CPU both lower it so."""
    module = _module(program)

    def flops(ins: hlo.Instruction) -> float:  # 2 x result elements x contracted size
        lhs = dims(module.type_of(ins.operands[0]))
        contracted = (ins.attr("lhs_contracting_dims") or "").strip("{}")
        return 2.0 * math.prod(dims(ins.type_str)) * math.prod(
            lhs[int(d)] for d in contracted.split(",") if d.strip())

    return [DenseGroupedDot(ins.name, ins.op_name, ins.count, flops(ins))
            for ins in module.instructions
            if ins.opcode == "dot" and "ragged_dot" in ins.op_name and ins.count]
