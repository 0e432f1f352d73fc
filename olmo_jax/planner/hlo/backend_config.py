"""Fields of an instruction's backend_config (the JSON XLA:GPU attaches to collectives,
GEMMs and fused attention) and of a Mosaic GPU kernel's call, read from the instruction's
text. Each returns None (or False) when the instruction does not state the field.
"""

from __future__ import annotations

import json
import re

from olmo_jax.planner.hlo.parse import Instruction

_SYNC = re.compile(r'"is_sync":\s*true')
_CONTRACTING = re.compile(r'"lhs_contracting_dimensions":\s*\[([^\]]*)\]')
_SCORES = re.compile(r'"intermediate_tensor_shape":\s*\{[^{}]*?"dimensions":\s*\[([^\]]*)\]')
_CAUSAL = re.compile(r'"mask_type":\s*"CAUSAL"')
_COST = re.compile(r'cost_estimate_json\s*=\s*"((?:[^"\\]|\\.)*)"')
_HEX_ESCAPE = re.compile(r"\\([0-9A-Fa-f]{2})")  # MLIR's string escape: \22 is a quote


def _ints(text: str) -> list[int]:
    return [int(x.strip().strip('"')) for x in text.split(",") if x.strip()]


def is_sync(ins: Instruction) -> bool:
    """An async collective XLA marked `"is_sync":true` (it runs as if synchronous)."""
    return _SYNC.search(ins.args) is not None


def lhs_contracting_dimensions(ins: Instruction) -> list[int] | None:
    """A cuBLAS GEMM's contracted dimensions of its lhs (operand 0)."""
    m = _CONTRACTING.search(ins.args)
    return _ints(m.group(1)) if m else None


def intermediate_tensor_shape(ins: Instruction) -> list[int] | None:
    """cuDNN fused attention's score shape [B, N, T, S]."""
    m = _SCORES.search(ins.args)
    return _ints(m.group(1)) if m else None


def causal_mask(ins: Instruction) -> bool:
    """cuDNN fused attention with a CAUSAL mask."""
    return _CAUSAL.search(ins.args) is not None


def cost_estimate(ins: Instruction) -> dict | None:
    """The cost estimate a Mosaic GPU kernel declared (`cost_estimate_json`: flops,
    bytes_accessed, ...), decoded from its MLIR-escaped string (`\\22` for each quote)."""
    m = _COST.search(ins.args)
    return json.loads(_HEX_ESCAPE.sub(lambda e: chr(int(e.group(1), 16)), m.group(1))) if m else None
