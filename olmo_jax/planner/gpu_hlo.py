"""What a compiled XLA:GPU program runs, read from its HLO: the collectives by kind and the
library / kernel custom calls, so a test or a plan can say which path a step took.

    module = comms.parse_module(compiled)          # or pass the Compiled / the HLO text
    collective_counts(module)   # Counter: all-to-all 6, ragged-all-to-all 2, ...
    block_scaled_dots(module)   # cuDNN MXFP8 GEMMs (jax.nn.scaled_matmul on Blackwell)
    cudnn_attention(module)     # cuDNN fused attention (forward and backward calls)
    mosaic_gpu_kernels(module)  # Pallas Mosaic GPU kernels; .wgmma: a Hopper matmul kernel

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
"""

from __future__ import annotations

import collections
import dataclasses
import re

from olmo_jax.planner import comms

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "ragged-all-to-all",
               "collective-permute", "collective-broadcast")
BLOCK_SCALED_DOT = "__cudnn$blockScaledDot"
UNREWRITTEN_BLOCK_SCALED_DOT = "__op$block_scaled_dot"
MOSAIC_GPU = ("mosaic_gpu_v2", "mosaic_gpu")
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
