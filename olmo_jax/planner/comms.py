"""Collective accounting from compiled HLO: every collective of a compiled program, its
bytes, and how many times one execution runs it (loop bodies times their trip counts;
the model's layers run in a lax.scan, microbatches in another).

    colls = collectives(jitted.lower(*args).compile())     # or the HLO text
    print(format_table(colls, title="ddp step"))

Bytes of one collective execution, per device, are the size of the full buffer it works
on: the result of all-gather / all-reduce / all-to-all / collective-permute, the operand
(result x group size) of reduce-scatter, and the output buffer of ragged-all-to-all (an
upper bound: the rows it moves depend on routing). Multiply by the device count for
the whole mesh (SPMD programs are symmetric). `backward` marks collectives that come from
differentiation (their op_name has `transpose(`), `phase` says fwd / bwd / step (once per
step: ZeRO parameter gathers and gradient reductions); op_name also carries the scopes
the parallel code sets (`Collective.purpose`: zero_gather, zero_reduce, fsdp_gather,
loss_allsum, moe_<backend>, and for pipelines pipe_gather / pipe_reduce (parameters to the
stages and gradients back) and pipe_send (activations and cotangents between stages),
muon_gather / muon_return (Muon's matrices to their owning ranks and the results back);
"other" for what GSPMD adds, e.g. the gradient-norm sum).
A backend may widen a collective's payload (XLA:CPU sends bf16 as f32, converting before
and after): `bytes` is what the compiled program moves, `jax_bytes` what the JAX program
asked for (the dtype before the backend's convert), which is what a GPU sends.

The parsed module itself (`parse_module`: every instruction with its execution count and
whether it runs on its own, inside a fusion or as a per-element reducer) is public for
other accounting built on the same walk (olmo_jax/planner: FLOPs and bytes per step).
A conditional's branches each count every time the conditional runs (an upper bound);
`HloModule.counted` recounts with the fraction of runs each branch takes (the planner's
pipeline schedules) or per execution of one computation.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import math
import re
from fractions import Fraction

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "ragged-all-to-all",
         "collective-permute", "collective-broadcast")
DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4,
               "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16,
               "f8e4m3fn": 1, "f8e5m2": 1, "f8e8m0fnu": 1, "s4": 1, "u4": 1}

# Named scopes set by olmo_jax.parallel (zero.py, strategy.py, expert/*).
SCOPES = ("zero_gather", "zero_reduce", "fsdp_gather", "loss_allsum", "moe_rowwise",
          "moe_ragged", "moe_allgather", "pipe_gather", "pipe_reduce", "pipe_send",
          "muon_gather", "muon_return")

_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\(.*->.*\{\s*$")
_INSTR = re.compile(r"^\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s+([a-z][\w\-]*)\((.*)$")
_SHAPE = re.compile(r"\b([a-z]\w*)\[([\d,]*)\]")
_CALLEES = re.compile(
    r"\b(?:body|condition|calls|to_apply|true_computation|false_computation)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"')
_OPNAME = re.compile(r'op_name="([^"]*)"')
_MESH_GROUPS = re.compile(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}")
_IOTA_GROUPS = re.compile(r"replica_groups=\[([\d,]+)\]<=")
_LIST_GROUPS = re.compile(r"replica_groups=\{\{([\d,]*)\}")
_PARTITIONS = re.compile(r"num_partitions=(\d+)")


@dataclasses.dataclass(frozen=True)
class Collective:
    kind: str
    name: str
    computation: str
    shapes: tuple[str, ...]  # result array types, e.g. ("f32[4,2,16]",)
    bytes: int  # per device, one execution
    group_size: int  # devices taking part together
    axes: tuple[str, ...]  # mesh axes of the group, when the HLO names them
    count: int | float  # executions per program run (enclosing loop trip counts multiplied)
    trip_counts_known: bool
    op_name: str
    jax_bytes: int = -1  # per execution at the JAX program's dtype (-1: = bytes)

    def __post_init__(self):
        if self.jax_bytes < 0:
            object.__setattr__(self, "jax_bytes", self.bytes)

    @property
    def widened(self) -> bool:
        """True where the backend sends a wider dtype than the program asked for."""
        return self.jax_bytes != self.bytes

    @property
    def jax_bytes_per_run(self) -> int:
        return self.jax_bytes * self.count

    @property
    def backward(self) -> bool:
        return "transpose(" in self.op_name

    @property
    def bytes_per_run(self) -> int:
        return self.bytes * self.count

    @property
    def phase(self) -> str:
        """fwd | bwd (from differentiation) | step (once-per-step parameter and gradient
        traffic: ZeRO gathers/reductions and what GSPMD adds around the update)."""
        if self.backward:
            return "bwd"
        once = ("zero_gather", "zero_reduce", "pipe_gather", "pipe_reduce", "muon_gather",
                "muon_return", "other")
        return "step" if self.purpose in once else "fwd"

    @property
    def purpose(self) -> str:
        """What moves, from the named scope the parallel code set (see module docstring)."""
        for scope in SCOPES:  # "a/zero_gather/b", "jvp(loss_allsum)/psum", ...
            if re.search(rf"(^|[/(:]){scope}[/):]", self.op_name):
                return scope
        return "other"


def _hlo_text(program) -> str:
    if isinstance(program, str):
        return program
    return program.as_text()


def _shape_bytes(type_str: str) -> tuple[int, tuple[str, ...]]:
    total, shapes = 0, []
    for dtype, dims in _SHAPE.findall(type_str):
        if dtype not in DTYPE_BYTES:
            continue
        n = math.prod(int(d) for d in dims.split(",") if d) if dims else 1
        total += n * DTYPE_BYTES[dtype]
        shapes.append(f"{dtype}[{dims}]")
    return total, tuple(shapes)


def _group(line: str, n_partitions: int) -> tuple[int, tuple[str, ...]]:
    if m := _MESH_GROUPS.search(line):
        sizes = dict(re.findall(r"'(\w+)'=(\d+)", m.group(1)))
        axes = tuple(re.findall(r"'(\w+)'", m.group(2)))
        return math.prod(int(sizes[a]) for a in axes), axes
    if m := _IOTA_GROUPS.search(line):
        return int(m.group(1).split(",")[-1]), ()
    if m := _LIST_GROUPS.search(line):
        return len([d for d in m.group(1).split(",") if d]), ()
    if "source_target_pairs" in line:
        return 2, ()
    return n_partitions, ()


def _parse(text: str):
    comps: dict[str, list[str]] = {}
    entry, current = None, None
    for line in text.splitlines():
        if current is None:
            if m := _HEADER.match(line):
                current = m.group(2)
                comps[current] = []
                if m.group(1):
                    entry = current
        elif line.startswith("}"):
            current = None
        else:
            comps[current].append(line)
    return comps, entry


def _call_graph(comps: dict[str, list[str]]) -> dict[str, list[tuple[str, int, bool]]]:
    """computation -> (callee, executions per execution of the caller, trip count known)."""
    calls: dict[str, list[tuple[str, int, bool]]] = collections.defaultdict(list)
    for name, lines in comps.items():
        for line in lines:
            callees = _CALLEES.findall(line)
            if m := _BRANCHES.search(line):
                callees += [c.strip().lstrip("%") for c in m.group(1).split(",") if c.strip()]
            if not callees:
                continue
            is_while = re.search(r"\swhile\(", line) is not None
            trip = _TRIP.search(line)
            n = int(trip.group(1)) if trip else 1
            for callee in callees:
                if is_while and re.search(rf"body=%?{re.escape(callee)}\b", line):
                    calls[name].append((callee, n, trip is not None))
                elif is_while:  # condition: runs trip + 1 times; it holds no collectives
                    calls[name].append((callee, n + 1 if trip else 1, trip is not None))
                else:
                    calls[name].append((callee, 1, True))
    return dict(calls)


def _multipliers(calls: dict[str, list[tuple[str, int, bool]]], entry: str,
                 weights: dict[str, Fraction] | None = None
                 ) -> tuple[dict[str, int | float], dict[str, bool]]:
    """Executions of each computation per run of `entry` (call graph is a DAG). A callee in
    `weights` runs that fraction of its caller's executions (a conditional's branch)."""
    weights = weights or {}
    mult: dict[str, Fraction] = collections.defaultdict(Fraction)
    known: dict[str, bool] = collections.defaultdict(lambda: True)
    order: list[str] = []
    seen: set[str] = set()

    def visit(c):  # post-order for a topological order
        if c in seen:
            return
        seen.add(c)
        for callee, _, _ in calls.get(c, ()):
            visit(callee)
        order.append(c)

    visit(entry)
    mult[entry] = Fraction(1)
    for c in reversed(order):
        for callee, factor, ok in calls.get(c, ()):
            mult[callee] += mult[c] * factor * weights.get(callee, 1)
            known[callee] = known[callee] and known[c] and ok
    return {c: _number(n) for c, n in mult.items()}, known


def _number(x: Fraction) -> int | float:
    return int(x) if x.denominator == 1 else float(x)


@dataclasses.dataclass(frozen=True)
class Instruction:
    """One HLO instruction of a parsed module."""

    name: str
    computation: str
    type_str: str  # the result type, e.g. "bf16[8,128]{1,0}" or a tuple "(f32[], s32[4])"
    opcode: str
    args: str  # the text after "opcode(": operands, then attributes
    is_root: bool
    count: int | float  # executions per program run (0: unreachable from the entry; a
    # float only where HloModule.counted splits a conditional's executions between branches)
    trip_counts_known: bool
    # "top": runs as its own operation; "fused": inside a fusion (one kernel with its
    # fusion instruction); "applied": in a reducer / comparator applied per element.
    context: str

    @property
    def op_name(self) -> str:
        return m.group(1) if (m := _OPNAME.search(self.args)) else ""

    @property
    def operands(self) -> list[str]:
        """The operands (the text up to the closing parenthesis): instruction names, or
        "name#i" for element i of a tuple-shaped instruction (HloModule.type_of)."""
        depth, end = 1, len(self.args)
        for i, ch in enumerate(self.args):
            depth += {"(": 1, ")": -1}.get(ch, 0)
            if depth == 0:
                end = i
                break
        return _OPERAND.findall(self.args[:end])

    def attr(self, key: str) -> str | None:
        m = re.search(rf"\b{re.escape(key)}=(\{{[^}}]*\}}|%?[\w.\-]+)", self.args)
        return m.group(1) if m else None


_OPERAND = re.compile(r"%([\w.\-]+(?:#\d+)?)")


def tuple_elements(type_str: str) -> list[str]:
    """The element types of a tuple type string (one element for an array type)."""
    text = re.sub(r"/\*.*?\*/", "", type_str).strip()
    if not text.startswith("("):
        return [text]
    out, depth, start = [], 0, 1
    for i, ch in enumerate(text[1:-1], 1):
        depth += ch in "([{"
        depth -= ch in ")]}"
        if ch == "," and depth == 0:
            out.append(text[start:i].strip())
            start = i + 1
    last = text[start:-1].strip()
    return out + [last] if last else out


@dataclasses.dataclass(frozen=True)
class HloModule:
    instructions: list[Instruction]
    by_name: dict[str, Instruction]
    roots: dict[str, Instruction]  # computation -> its ROOT instruction
    num_partitions: int
    calls: dict = dataclasses.field(default_factory=dict, repr=False)  # _call_graph
    entry: str = ""

    def counted(self, weights: dict[str, Fraction] | None = None,
                root: str | None = None) -> HloModule:
        """This module with its execution counts recomputed. `weights`: conditional branch
        computations -> the fraction of their conditional's executions that take them (the
        default walk runs every branch every time, which over-counts a branch a schedule
        takes on some ticks only); `root`: counts per execution of that computation instead
        of per program run (what it does not reach counts 0)."""
        mult, known = _multipliers(self.calls, root or self.entry, weights)
        out = [dataclasses.replace(i, count=mult.get(i.computation, 0),
                                   trip_counts_known=known[i.computation])
               for i in self.instructions]
        by_name = {i.name: i for i in out}
        return HloModule(out, by_name, {c: by_name[r.name] for c, r in self.roots.items()},
                         self.num_partitions, self.calls, self.entry)

    def instruction(self, ref: str) -> Instruction | None:
        """The instruction an operand reference ("name" or "name#i") points into."""
        return self.by_name.get(ref.split("#", 1)[0])

    def type_of(self, ref: str) -> str:
        """The type of an operand reference: element i of a tuple for "name#i"."""
        ins = self.instruction(ref)
        if ins is None:
            return ""
        if "#" in ref:
            elems = tuple_elements(ins.type_str)
            i = int(ref.split("#", 1)[1])
            return elems[i] if i < len(elems) else ""
        return ins.type_str


def _contexts(comps: dict[str, list[str]]) -> dict[str, str]:
    """How each computation runs: inside a fusion, applied per element, or on its own."""
    ctx: dict[str, str] = {}
    for lines in comps.values():
        for line in lines:
            m = _INSTR.match(line)
            if not m:
                continue
            for attr, callee in re.findall(r"\b(calls|to_apply)=%?([\w.\-]+)", line):
                if attr == "to_apply":
                    ctx[callee] = "applied"
                elif m.group(4) == "fusion":
                    ctx[callee] = "fused"
    # A computation called from a fused/applied one inherits that context.
    changed = True
    while changed:
        changed = False
        for name, lines in comps.items():
            if name not in ctx:
                continue
            for line in lines:
                for callee in _CALLEES.findall(line):
                    if ctx.get(callee) != ctx[name] and ctx.get(callee, "top") == "top":
                        ctx[callee], changed = ctx[name], True
    return ctx


def parse_module(program) -> HloModule:
    """Every instruction of a compiled program (a jax Compiled, Lowered, or HLO text) with
    the number of times one program run executes it."""
    text = _hlo_text(program)
    comps, entry = _parse(text)
    if entry is None:
        raise ValueError("no ENTRY computation in the HLO text")
    calls = _call_graph(comps)
    mult, known = _multipliers(calls, entry)
    ctx = _contexts(comps)
    out, roots = [], {}
    for comp, lines in comps.items():
        for line in lines:
            if m := _INSTR.match(line):
                ins = Instruction(m.group(2), comp, m.group(3), m.group(4), m.group(5),
                                  bool(m.group(1)), mult.get(comp, 0), known[comp],
                                  ctx.get(comp, "top"))
                out.append(ins)
                if ins.is_root:
                    roots[comp] = ins
    n_part = int(m.group(1)) if (m := _PARTITIONS.search(text)) else 1
    return HloModule(out, {i.name: i for i in out}, roots, n_part, calls, entry)


def _narrowed_source(module: HloModule, operand: str) -> str | None:
    """The type an operand had before a backend-inserted widening convert (a convert, or a
    fusion whose root is a convert, with no op_name of its own), else None."""
    ins = None if "#" in operand else module.instruction(operand)
    if ins is not None and ins.opcode == "fusion" and (callee := ins.attr("calls")):
        ins = module.roots.get(callee.lstrip("%"))
    if ins is None or ins.opcode != "convert" or ins.op_name or not ins.operands:
        return None
    return module.type_of(ins.operands[0]) or None


def _jax_bytes(module: HloModule, ins: Instruction, size: int) -> int:
    """`size` rescaled to the dtype the operands had before a widening convert."""
    src_types = [_narrowed_source(module, o) for o in ins.operands]
    if not src_types or any(t is None for t in src_types):
        return size
    src_bytes = sum(_shape_bytes(t)[0] for t in src_types)
    op_bytes = sum(_shape_bytes(module.type_of(o))[0] for o in ins.operands)
    return size * src_bytes // op_bytes if 0 < src_bytes < op_bytes else size


def collectives(program) -> list[Collective]:
    """Every collective in a compiled program (a jax Compiled, Lowered, or HLO text)."""
    module = program if isinstance(program, HloModule) else parse_module(program)
    out = []
    for ins in module.instructions:
        op = ins.opcode
        kind = op[: -len("-start")] if op.endswith("-start") else op
        if kind not in KINDS or op.endswith("-done"):
            continue
        size, shapes = _shape_bytes(ins.type_str)
        parts = tuple_elements(ins.type_str)
        if op.endswith("-start") and len(parts) > 1 and (
                parts[0].startswith("(") or kind in ("all-gather", "collective-permute")):
            # An async start's ((operands), results[, context]) (XLA:GPU: every kind, one
            # array or a tuple of them for a combined collective), or an older (operand,
            # result, ...) all-gather / collective-permute: count the results.
            size, shapes = _shape_bytes(parts[1])
        group, axes = _group(ins.args, module.num_partitions)
        if kind == "reduce-scatter":
            size *= group
        out.append(Collective(kind, ins.name, ins.computation, shapes, size, group, axes,
                              ins.count, ins.trip_counts_known, ins.op_name,
                              _jax_bytes(module, ins, size)))
    return out


def num_partitions(program) -> int:
    m = _PARTITIONS.search(_hlo_text(program))
    return int(m.group(1)) if m else 1


def summary(colls: list[Collective]) -> list[dict]:
    """One row per (kind, purpose, direction, axes): executions and per-device bytes per run
    (as compiled, and at the JAX program's dtypes)."""
    rows: dict[tuple, dict] = {}
    for c in colls:
        key = (c.kind, c.purpose, c.phase,
               ",".join(c.axes) or f"group of {c.group_size}")
        r = rows.setdefault(key, {"kind": key[0], "purpose": key[1], "phase": key[2],
                                  "axes": key[3], "ops": 0, "executions": 0,
                                  "bytes_per_device": 0, "jax_bytes_per_device": 0})
        r["ops"] += 1
        r["executions"] += c.count
        r["bytes_per_device"] += c.bytes_per_run
        r["jax_bytes_per_device"] += c.jax_bytes_per_run
    return sorted(rows.values(), key=lambda r: (r["kind"], r["purpose"], r["phase"], r["axes"]))


def total_bytes(colls: list[Collective], kind: str | None = None,
                backward: bool | None = None) -> int:
    """Per-device bytes per run, optionally for one kind / direction."""
    return sum(c.bytes_per_run for c in colls
               if (kind is None or c.kind == kind) and (backward is None or c.backward == backward))


def format_table(colls: list[Collective], title: str = "", n_devices: int | None = None) -> str:
    rows = summary(colls)
    head = (f"{'collective':<18} {'purpose':<13} {'phase':<5} {'axes':<14} {'ops':>4} {'runs':>5} "
            f"{'MB/device':>10}")
    if n_devices:
        head += f" {'MB total':>10}"
    lines = [title, head] if title else [head]
    for r in rows:
        line = (f"{r['kind']:<18} {r['purpose']:<13} {r['phase']:<5} {r['axes']:<14} {r['ops']:>4} "
                f"{r['executions']:>5} {r['bytes_per_device'] / 1e6:>10.3f}")
        if n_devices:
            line += f" {r['bytes_per_device'] * n_devices / 1e6:>10.3f}"
        lines.append(line)
    total = total_bytes(colls)
    lines.append(f"{'total':<62} {total / 1e6:>10.3f}"
                 + (f" {total * n_devices / 1e6:>10.3f}" if n_devices else ""))
    return "\n".join(lines)


def to_json(colls: list[Collective]) -> str:
    return json.dumps([dataclasses.asdict(c) | {"backward": c.backward} for c in colls], indent=1)
