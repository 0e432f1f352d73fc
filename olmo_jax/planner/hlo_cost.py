"""FLOPs and memory traffic of one run of a compiled program, from its HLO, loop bodies
multiplied by their trip counts (the walk of `olmo_jax.planner.hlo.parse_module`), split
by the model's named scopes into the terms of OLMo-core's FLOPs formula.

Counting follows XLA's HloCostAnalysis:
  dot           2 x result elements x contracted size (the lhs contracting dimensions)
  custom call   a library GEMM's or fused attention's matmul FLOPs, from its shapes and
                backend_config (gpu_hlo.custom_call_dot_flops: cuBLAS, cuDNN, Mosaic GPU)
  elementwise   one FLOP per result element; exp, log, tanh, rsqrt, ... count as
                transcendentals instead
  reduce        (input - result elements) x the reducer's FLOPs (1 for add / max);
                reduce-window (window - 1) x result elements x the reducer's; scatter
                update elements x the combiner's
  the rest      data movement (copy, slice, gather, transpose, ...): no FLOPs
XLA's own total (`compiled.cost_analysis()["flops"]`) counts every loop body once;
`program_cost(module, loops_once=True)` reproduces that number (the tests compare them;
it leaves out the CPU expert FFN's FFI calls, which XLA counts as no FLOPs and no bytes),
the default multiplies each instruction by the number of times one run executes it.

Bytes accessed (the HBM term of the roofline) count each operation that runs on its own (a
fusion is one): operands read plus result written; slices read only the sliced part; an
in-place dynamic-update-slice moves only the update; parameters, tuples, bitcasts and loop
plumbing nothing. They are the compiled program's operations and fusions: XLA:GPU's when
the planner compiled for a GPU, else XLA:CPU's (an estimate of a GPU's).
"""

from __future__ import annotations

import collections
import dataclasses
import math

from olmo_jax.planner import gpu_hlo
from olmo_jax.planner.comms import KINDS
from olmo_jax.planner.hlo import metadata
from olmo_jax.planner.hlo.array_types import arrays, dims, elements, type_bytes
from olmo_jax.planner.hlo.parse import HloModule, Instruction, parse_module

# The model's named scopes (model/transformer.py, model/attention.py, model/moe/layer.py;
# the optimizer's update: trainer/step.py),
# most specific first, and the term of OLMo-core's formula each one is (metrics.py).
SCOPES = ("attention_scores", "attention", "router", "routed_experts", "shared_experts",
          "dense_mlp", "lm_head", "optimizer")
SCOPE_TERM = {"attention_scores": "attention_scores", "attention": "attention_proj",
              "router": "router", "routed_experts": "routed_experts",
              "shared_experts": "shared_experts", "dense_mlp": "dense_mlp",
              "lm_head": "lm_head", "optimizer": "optimizer"}  # optimizer: not a model term
OTHER = "other"
REMAT_SCOPE = "rematted_computation"  # jax.checkpoint's name for the recomputed forward

TRANSCENDENTAL = {"exponential", "exponential-minus-one", "log", "log-plus-one", "logistic",
                  "tanh", "sqrt", "rsqrt", "cbrt", "power", "sine", "cosine", "tan", "atan2",
                  "erf", "acosh"}
ELEMENTWISE = TRANSCENDENTAL | {
    "add", "subtract", "multiply", "divide", "maximum", "minimum", "remainder", "negate",
    "abs", "sign", "floor", "ceil", "round-nearest-afz", "round-nearest-even", "compare",
    "select", "clamp", "convert", "and", "or", "xor", "not", "shift-left",
    "shift-right-logical", "shift-right-arithmetic", "is-finite", "reduce-precision",
    "real", "imag", "popcnt", "count-leading-zeros", "stochastic-convert",
}
# Operations that move no data of their own (loop and tuple plumbing, aliasing views; an
# async-start's wrapped computation runs on its own and its operations count themselves:
# XLA:GPU runs a layer scan's dynamic-(update-)slice fusions so).
NO_BYTES = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "while", "call",
            "async-start",
            "conditional", "after-all", "add-dependency", "partition-id", "replica-id",
            "opt-barrier", "all-gather-done", "all-reduce-done", "collective-permute-done",
            "async-done", "async-update", "copy-done", "send-done", "recv-done", "domain"}

def scope_of(op_name: str) -> str:
    """The innermost-listed model scope an op_name carries (SCOPES order), or 'other'."""
    for scope in SCOPES:
        if metadata.in_scope(op_name, scope):
            return scope
    return OTHER


def _index_list(text: str | None) -> list[int]:
    return [int(x) for x in text.strip("{}").split(",") if x.strip()] if text else []


def dot_flops(module: HloModule, ins: Instruction) -> int:
    lhs_dims = dims(module.type_of(ins.operands[0]))
    contracted = math.prod(lhs_dims[d] for d in _index_list(ins.attr("lhs_contracting_dims")))
    return 2 * elements(ins.type_str) * contracted


@dataclasses.dataclass(frozen=True)
class OpCost:
    """One operation that runs on its own (a fusion with everything fused into it)."""

    scope: str
    count: int | float  # executions per program run (mean over pipeline stages)
    dot_flops: float  # per execution
    bytes: float  # per execution
    collective: bool
    # A dtype convert or layout copy the backend inserted (no op_name of its own): XLA:CPU
    # widens bf16 around its matmuls and copies into its matmul library's layouts.
    backend_inserted: bool = False
    name: str = ""  # the instruction's (planner/overlap.py prices the schedule by name)


@dataclasses.dataclass
class ProgramCost:
    """Per device, one program run. `dot_flops` / `other_flops` by model scope; `ops`
    every operation that runs on its own, for a per-operation roofline."""

    dot_flops: dict[str, float]
    recomputed_dot_flops: dict[str, float]  # the part of dot_flops that remat recomputes
    other_flops: dict[str, float]
    transcendentals: float
    bytes_accessed: float
    bytes_by_scope: dict[str, float]
    ops: list[OpCost]

    @property
    def total_dot_flops(self) -> float:
        return sum(self.dot_flops.values())

    @property
    def flops(self) -> float:
        """Everything XLA calls FLOPs (dots, elementwise, reductions)."""
        return self.total_dot_flops + sum(self.other_flops.values())


class Walker:
    """Per-instruction FLOPs, bytes and model scope over a parsed module."""

    def __init__(self, module: HloModule):
        self.module = module
        self.comp = collections.defaultdict(list)
        self.users = collections.defaultdict(list)
        self.caller: dict[str, Instruction] = {}  # fused computation -> its fusion
        for ins in module.instructions:
            self.comp[ins.computation].append(ins)
            for o in ins.operands:
                self.users[o.split("#", 1)[0]].append(ins)
            if ins.opcode == "fusion" and (callee := ins.attr("calls")):
                self.caller[callee.lstrip("%")] = ins
        self._reducer_flops: dict[str, float] = {}
        self._origins: dict[str, str] = {}

    def origin(self, ins: Instruction) -> str:
        """The op_name that says where an instruction comes from: its own; for one the
        compiler made without one (e.g. a dot XLA:CPU rewrote) its fusion's, else that of
        the nearest producers of its operands within a model scope (the most specific
        scope among them), else of its nearest such consumers."""
        if ins.name not in self._origins:
            origin = self._own_origin(ins) or None
            if origin is None and ins.computation in self.caller:
                origin = self.origin(self.caller[ins.computation]) or None
            if origin is None:
                module = self.module
                origin = (self._nearest(ins, lambda i: [module.instruction(o) for o in i.operands
                                                        if module.instruction(o)])
                          or self._nearest(ins, lambda i: self.users[i.name]))
            self._origins[ins.name] = origin or ""
        return self._origins[ins.name]

    def _own_origin(self, ins: Instruction) -> str:
        """Its op_name; for a fusion without one, that of the instructions fused into it
        (the root's, else the most specific scope's)."""
        if ins.op_name or ins.opcode != "fusion" or not (callee := ins.attr("calls")):
            return ins.op_name
        comp = callee.lstrip("%")
        root = self.module.roots.get(comp)
        if root is not None and root.op_name:
            return root.op_name
        named = [i.op_name for i in self.comp[comp] if i.op_name]
        return min(named, key=lambda o: SCOPES.index(s) if (s := scope_of(o)) in SCOPES
                   else len(SCOPES), default="")

    def scope(self, ins: Instruction) -> str:
        """The model scope an instruction belongs to (SCOPES), or 'other'."""
        return scope_of(self.origin(ins))

    def recomputed(self, ins: Instruction) -> bool:
        """Part of a forward pass recomputed in the backward pass (jax.checkpoint), as its
        own op_name or its fusion's says (never inferred from neighbours: the backward's
        own ops consume the recomputed values)."""
        while not ins.op_name and ins.computation in self.caller:
            ins = self.caller[ins.computation]
        return REMAT_SCOPE in ins.op_name

    def _nearest(self, ins: Instruction, step, depth: int = 6) -> str | None:
        frontier, seen = [ins], {ins.name}
        for _ in range(depth):
            frontier = [n for cur in frontier for n in step(cur) if n.name not in seen][:32]
            seen.update(n.name for n in frontier)
            found = [o for o in map(self._own_origin, frontier) if scope_of(o) != OTHER]
            if found:
                return min(found, key=lambda o: SCOPES.index(scope_of(o)))
        return None

    def backend_inserted(self, ins: Instruction) -> bool:
        """A convert / copy (or a fusion ending in one) that has no op_name: made by the
        compiler, not by the JAX program."""
        if ins.op_name:
            return False
        op = ins
        if ins.opcode == "fusion" and (callee := ins.attr("calls")):
            op = self.module.roots.get(callee.lstrip("%"))
            while op is not None and op.opcode == "bitcast":
                op = self.module.instruction(op.operands[0])
        return op is not None and op.opcode in ("convert", "copy")

    def top_level(self, ins: Instruction) -> Instruction:
        """The operation that runs on its own and contains `ins` (its outermost fusion)."""
        while ins.context == "fused" and ins.computation in self.caller:
            ins = self.caller[ins.computation]
        return ins

    def reducer_flops(self, name: str | None) -> float:
        """FLOPs of one application of a reducer / combiner computation."""
        if not name:
            return 0.0
        name = name.lstrip("%")
        if name not in self._reducer_flops:
            self._reducer_flops[name] = sum(
                elements(i.type_str) for i in self.comp[name] if i.opcode in ELEMENTWISE)
        return self._reducer_flops[name]

    def flops(self, ins: Instruction) -> tuple[float, float, float]:
        """(dot FLOPs, other FLOPs, transcendentals) of one execution."""
        op = ins.opcode
        if op == "dot":
            return dot_flops(self.module, ins), 0.0, 0.0
        if op == "custom-call":
            return gpu_hlo.custom_call_dot_flops(self.module, ins), 0.0, 0.0
        if op in TRANSCENDENTAL:
            return 0.0, 0.0, float(elements(ins.type_str))
        if op in ELEMENTWISE:
            return 0.0, float(elements(ins.type_str)), 0.0
        if op == "reduce":
            count = elements(self.module.type_of(ins.operands[0])) - elements(ins.type_str)
            return 0.0, count * self.reducer_flops(ins.attr("to_apply")), 0.0
        if op == "reduce-window":
            count = (ins.window_elements - 1) * elements(ins.type_str)
            return 0.0, count * self.reducer_flops(ins.attr("to_apply")), 0.0
        if op == "scatter":
            updates = elements(self.module.type_of(ins.operands[-1]))
            return 0.0, updates * self.reducer_flops(ins.attr("to_apply")), 0.0
        return 0.0, 0.0, 0.0

    def _fused_param_read(self, comp: str, index: int, full: int) -> int:
        """Bytes a fusion reads of its operand `index`: only the sliced parts when every
        use in the fused computation slices it, nothing for an in-place update buffer."""
        params = [i for i in self.comp[comp] if i.opcode == "parameter"
                  and i.args.startswith(f"{index})")]
        if not params:
            return full
        users = [i for i in self.comp[comp] if params[0].name in i.operands]
        total = 0
        for u in users:
            if u.opcode in ("slice", "dynamic-slice") and u.operands[0] == params[0].name:
                total += type_bytes(u.type_str)
            elif u.opcode == "dynamic-update-slice" and u.operands[0] == params[0].name:
                continue
            else:
                return full
        return total

    def bytes(self, ins: Instruction) -> float:
        """Bytes one execution reads and writes (top-level operations only)."""
        op = ins.opcode
        if op in NO_BYTES:
            return 0.0
        type_of = self.module.type_of
        if op in ("slice", "dynamic-slice"):
            return 2.0 * type_bytes(ins.type_str)
        if op == "dynamic-update-slice":
            return 2.0 * type_bytes(type_of(ins.operands[1]))
        out = type_bytes(ins.type_str)
        operands = [type_bytes(type_of(o)) for o in ins.operands]
        if op == "fusion" and (callee := ins.attr("calls")):
            comp = callee.lstrip("%")
            root = self.module.roots.get(comp)
            if root is not None and root.opcode == "dynamic-update-slice":
                out = type_bytes(type_of(root.operands[1]))
            operands = [self._fused_param_read(comp, i, b) for i, b in enumerate(operands)]
        return float(out + sum(operands))


def program_cost(module: HloModule, loops_once: bool = False) -> ProgramCost:
    """FLOPs by model scope and bytes accessed of one run of `module`, per device.
    `loops_once`: count each loop body once and leave out the FLOPs and bytes of FFI calls
    XLA cannot see into (gpu_hlo.CPU_FFI), as XLA's cost analysis does."""
    walker = Walker(module)
    dots: dict[str, float] = collections.defaultdict(float)
    recomputed: dict[str, float] = collections.defaultdict(float)
    others: dict[str, float] = collections.defaultdict(float)
    by_scope: dict[str, float] = collections.defaultdict(float)
    op_dots: dict[str, float] = collections.defaultdict(float)  # top-level op -> its dots
    trans = moved = 0.0
    for ins in module.instructions:
        if ins.count == 0 or ins.context == "applied":
            continue
        n = 1 if loops_once else ins.count
        scope = walker.scope(ins)
        d, o, t = walker.flops(ins)
        opaque = loops_once and gpu_hlo.call_target(ins) in gpu_hlo.CPU_FFI
        if opaque:
            d = 0.0
        dots[scope] += n * d
        if d and walker.recomputed(ins):
            recomputed[scope] += n * d
        others[scope] += n * o
        trans += n * t
        if d:
            op_dots[walker.top_level(ins).name] += d
        if ins.context == "top" and not opaque:
            b = n * walker.bytes(ins)
            moved += b
            by_scope[scope] += b
    ops = [OpCost(walker.scope(ins), 1 if loops_once else ins.count, op_dots.get(ins.name, 0.0),
                  walker.bytes(ins), ins.opcode.removesuffix("-start") in KINDS,
                  walker.backend_inserted(ins), ins.name)
           for ins in module.instructions if ins.count and ins.context == "top"]
    ops = [op for op in ops if op.dot_flops or op.bytes]
    return ProgramCost(dict(dots), dict(recomputed), dict(others), trans, moved, dict(by_scope),
                       ops)


_FLOAT = ("f32", "bf16", "f16")


def score_buffers(program, seq_len: int) -> list[str]:
    """Buffers of the program (values of its top-level instructions, not inside a fusion)
    shaped like attention scores of a sequence of `seq_len`: floating point, batched (rank
    >= 3: batch and heads before the [queries, keys] of each; a 2-D [T, H] or [rows, S]
    value is none), the last dimension spanning keys (seq_len, or a causal query chunk's
    end: a multiple of the chunk length Tc = seq_len / model.attention.query_chunks) and
    the one before it spanning queries (a multiple of Tc), made inside the model's
    `attention_scores` scope (Walker.scope: its op_name, or for one without, its
    fusion's or its neighbours'; a [B, T, heads x H] slice of the q/k/v projection, in the `attention` scope, is shaped
    the same when heads x H = seq_len). cuDNN's fused attention makes none; the xla core
    makes [B, K, G * Tc, S] (XLA keeps them). "name: type" of each."""
    from olmo_jax.model.attention import query_chunks

    tc = seq_len // query_chunks(seq_len)
    return [f"{name}: {dtype}[{','.join(map(str, d))}]"
            for name, dtype, d in _attention_score_arrays(program)
            if d[-1] % tc == 0 and d[-1] <= seq_len and d[-2] % tc == 0 and d[-2] >= tc]


def key_span_buffers(program, seq_len: int) -> list[str]:
    """score_buffers' candidates (floating point, rank >= 3, top-level, in the
    `attention_scores` scope) whose last dimension spans all `seq_len` keys of the
    sequence, whatever their queries: context parallelism's all-gather attention makes one
    [B, K, G, 2L, T] block per call (a shard's queries against every key), its ring only
    [L, L] blocks (olmo_jax/kernels/ring_attention.py). "name: type" of each."""
    return [f"{name}: {dtype}[{','.join(map(str, d))}]"
            for name, dtype, d in _attention_score_arrays(program) if d[-1] == seq_len]


def _attention_score_arrays(program):
    """(instruction name, dtype, dims) of every floating-point array of rank >= 3 that a
    top-level instruction in the `attention_scores` scope makes (score_buffers)."""
    module = program if isinstance(program, HloModule) else parse_module(program)
    walker = Walker(module)
    for ins in module.instructions:
        if ins.context != "top" or ins.opcode in ("parameter", "get-tuple-element", "tuple",
                                                  "bitcast"):
            continue
        if walker.scope(ins) != "attention_scores":
            continue
        for dtype, dims_text in arrays(ins.type_str):
            d = [int(x) for x in dims_text.split(",") if x]
            if dtype in _FLOAT and len(d) >= 3:
                yield ins.name, dtype, d


def document_masks(program) -> list[str]:
    """The document masks' compares in the attention cores (any context): instructions,
    fused or not, in the `attention_scores` scope comparing for equality into a boolean
    array of rank >= 3, the query's segment id against the key's per row ([B, Q, A] or
    [B, 1, M, A]; the causal and window masks compare positions, [Q, A], and the blas
    and cuDNN cores make none, their masks being offsets). "name: type" of each."""
    module = program if isinstance(program, HloModule) else parse_module(program)
    walker = Walker(module)
    out = []
    for ins in module.instructions:
        if ins.opcode != "compare" or ins.attr("direction") != "EQ":
            continue
        for dtype, dims_text in arrays(ins.type_str):
            if (dtype == "pred" and len(dims(ins.type_str)) >= 3
                    and walker.scope(ins) == "attention_scores"):
                out.append(f"{ins.name}: {dtype}[{dims_text}]")
    return out
