"""What a compiled XLA:GPU program runs, read from its HLO: the collectives by kind and the
library / kernel custom calls, so a test or a plan can say which path a step took.

    module = comms.parse_module(compiled)          # or pass the Compiled / the HLO text
    collective_counts(module)   # Counter: all-to-all 6, ragged-all-to-all 2, ...
    block_scaled_dots(module)   # cuDNN MXFP8 GEMMs (jax.nn.scaled_matmul on Blackwell)
    cudnn_attention(module)     # cuDNN fused attention (forward and backward calls)
    mosaic_gpu_kernels(module)  # Pallas Mosaic GPU kernels; .wgmma: a Hopper matmul kernel
    custom_call_dot_flops(module, ins)  # matmul FLOPs of a library / kernel custom call

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
  does not). The op_name is the generic `mpmd_map`, so the module is what tells them apart.

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
import json
import math
import re

from olmo_jax.planner import comms

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "ragged-all-to-all",
               "collective-permute", "collective-broadcast")
BLOCK_SCALED_DOT = "__cudnn$blockScaledDot"
UNREWRITTEN_BLOCK_SCALED_DOT = "__op$block_scaled_dot"
MOSAIC_GPU = ("mosaic_gpu_v2", "mosaic_gpu")
CPU_SWIGLU = {"olmo_cpu_swiglu_fwd": (3, 3), "olmo_cpu_swiglu_bwd": (6, 5)}  # GEMMs, w_gate operand
CPU_ATTENTION = {"olmo_cpu_attention_fwd": 2, "olmo_cpu_attention_bwd": 5}  # GEMMs
# every CPU FFI kernel (olmo_jax/kernels/cpu_ffi.py): opaque to XLA's own cost analysis
CPU_FFI = frozenset({*CPU_SWIGLU, *CPU_ATTENTION, "olmo_cpu_attention_prep_fwd",
                     "olmo_cpu_attention_prep_bwd", "olmo_cpu_rms_norm_fwd",
                     "olmo_cpu_rms_norm_bwd"})
_TARGET = re.compile(r'custom_call_target="([^"]+)"')


def _module(program) -> comms.HloModule:
    return program if isinstance(program, comms.HloModule) else comms.parse_module(program)


def _collective_kind(opcode: str) -> str | None:
    if opcode in COLLECTIVES:
        return opcode
    if opcode.endswith("-start") and opcode[: -len("-start")] in COLLECTIVES:
        return opcode[: -len("-start")]
    return None


def collective_counts(program, executions: bool = False) -> collections.Counter:
    """Collectives by kind (COLLECTIVES): instructions in the program, or with `executions`
    the times one run executes them (loop trip counts multiplied, comms.parse_module)."""
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
        if ins.opcode != "custom-call":
            continue
        m = _TARGET.search(ins.args)
        if m and m.group(1).startswith(prefix):
            out.append(CustomCall(ins.name, m.group(1), ins.op_name, ins.count))
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


def mosaic_gpu_kernels(program) -> list[MosaicKernel]:
    """The Pallas Mosaic GPU kernel calls of the program."""
    out = []
    for ins in _module(program).instructions:
        if ins.opcode != "custom-call":
            continue
        m = _TARGET.search(ins.args)
        if m and m.group(1) in MOSAIC_GPU:
            out.append(MosaicKernel(ins.name, ins.op_name, "wgmma" in ins.args, ins.count))
    return out


_CONTRACTING = re.compile(r'"lhs_contracting_dimensions":\s*\[([^\]]*)\]')
_SCORES = re.compile(r'"intermediate_tensor_shape":\s*\{[^{}]*?"dimensions":\s*\[([^\]]*)\]')
_CAUSAL = re.compile(r'"mask_type":\s*"CAUSAL"')
_COST = re.compile(r'cost_estimate_json\s*=\s*"((?:[^"\\]|\\.)*)"')


def _dims(type_str: str) -> list[int]:
    m = re.search(r"\b[a-z]\w*\[([\d,]*)\]", type_str)
    return [int(d) for d in m.group(1).split(",") if d] if m else []


def _ints(text: str) -> list[int]:
    return [int(x.strip().strip('"')) for x in text.split(",") if x.strip()]


def call_target(ins: comms.Instruction) -> str | None:
    m = _TARGET.search(ins.args) if ins.opcode == "custom-call" else None
    return m.group(1) if m else None


def custom_call_dot_flops(module: comms.HloModule, ins: comms.Instruction) -> float:
    """Matmul FLOPs of one execution of a custom call (module docstring); 0 for others."""
    target = call_target(ins)
    if target is None:
        return 0.0
    out = math.prod(_dims(ins.type_str))
    if target.startswith("__cublas$"):
        m = _CONTRACTING.search(ins.args)
        lhs = _dims(module.type_of(ins.operands[0])) if ins.operands else []
        if not m or not lhs:
            return 0.0
        return 2.0 * out * math.prod(lhs[d] for d in _ints(m.group(1)))
    if target.startswith("__cudnn$fmha"):
        m = _SCORES.search(ins.args)
        if not m or not ins.operands:
            return 0.0
        B, N, T, S = _ints(m.group(1))
        H = math.prod(_dims(module.type_of(ins.operands[0]))) / (B * N * T)
        gemms = 5 if "Backward" in target else 2
        causal = (S + 1) / (2 * S) if _CAUSAL.search(ins.args) and T == S else 1.0
        return gemms * 2.0 * B * N * T * S * H * causal
    if target == BLOCK_SCALED_DOT and ins.operands:
        lhs = _dims(module.type_of(ins.operands[0]))
        return 2.0 * out * lhs[-1] if lhs else 0.0
    if target in CPU_SWIGLU and len(ins.operands) > CPU_SWIGLU[target][1]:
        gemms, wg = CPU_SWIGLU[target]
        R, D = _dims(module.type_of(ins.operands[0]))
        F = _dims(module.type_of(ins.operands[wg]))[-1]
        return gemms * 2.0 * R * D * F
    if target in CPU_ATTENTION and ins.operands:
        from olmo_jax.kernels.cpu_attention import computed_fraction

        B, T, N, H = _dims(module.type_of(ins.operands[0]))
        return CPU_ATTENTION[target] * 2.0 * B * N * T * T * H * computed_fraction(T)
    if target in MOSAIC_GPU:
        m = _COST.search(ins.args)
        if m:
            return float(json.loads(m.group(1).encode().decode("unicode_escape")).get("flops", 0))
    return 0.0


def uncounted_kernels(program) -> list[CustomCall]:
    """Mosaic GPU kernel calls that declare no cost estimate: their FLOPs are unknown."""
    return [c for c in custom_calls(program)
            if c.target in MOSAIC_GPU and not _COST.search(_module(program).instruction(c.name).args)]


_FLOAT = ("f32", "bf16", "f16")


def score_buffers(program, seq_len: int) -> list[str]:
    """Buffers of the program (values of its top-level instructions, not inside a fusion)
    shaped like attention scores of a sequence of `seq_len`: floating point, batched (rank
    >= 3: batch and heads before the [queries, keys] of each; a 2-D [T, H] or [rows, S]
    value is none), the last dimension spanning keys (seq_len, or a causal query chunk's
    end: a multiple of the chunk length Tc = seq_len / model.attention.query_chunks) and
    the one before it spanning queries (a multiple of Tc), made inside the model's
    `attention_scores` scope (hlo_cost.Walker.scope: its op_name, or for one without, its
    fusion's or its neighbours'; a [B, T, heads x H] slice of the q/k/v projection, in the `attention` scope, is shaped
    the same when heads x H = seq_len). cuDNN's fused attention makes none; the xla core
    makes [B, K, G * Tc, S] (XLA keeps them). "name: type" of each."""
    from olmo_jax.model.attention import query_chunks
    from olmo_jax.planner import hlo_cost  # imports this module

    tc = seq_len // query_chunks(seq_len)
    module = _module(program)
    walker = hlo_cost.Walker(module)
    out = []
    for ins in module.instructions:
        if ins.context != "top" or ins.opcode in ("parameter", "get-tuple-element", "tuple",
                                                  "bitcast"):
            continue
        if walker.scope(ins) != "attention_scores":
            continue
        for dtype, dims in re.findall(r"\b([a-z]\w*)\[([\d,]*)\]", ins.type_str):
            d = [int(x) for x in dims.split(",") if x]
            if (dtype in _FLOAT and len(d) >= 3 and d[-1] % tc == 0 and d[-1] <= seq_len
                    and d[-2] % tc == 0 and d[-2] >= tc):
                out.append(f"{ins.name}: {dtype}[{dims}]")
    return out
