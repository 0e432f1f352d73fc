"""The one reader of HLO text: a module's computations and instructions, each with its
opcode, result type, operands, attributes and metadata, and the number of times one run of
the program executes it (loop bodies times their trip counts).

    module = parse_module(compiled)   # a jax Compiled, or HLO text
    for ins in module.instructions:
        ins.opcode, ins.type_str, ins.operands, ins.attr("calls"), ins.op_name, ins.count

The text is XLA's HLO dump (`Compiled.as_text()`, `Lowered.as_text(dialect="hlo")`, the
`*after_optimizations.txt` files of `--xla_dump_to`): computations headed
`[ENTRY] %name (params) -> type {`, one instruction a line,
`[ROOT] %name = type opcode(operands), attribute=value, ..., metadata={op_name="..."}`.
The lowered module's text (before XLA's passes) heads computations `[ENTRY] name {` and
names operands without `%`: its instructions, types and attributes read the same, but
`Instruction.operands` (which reads `%` names) finds none there.
Each instruction runs in a context: on its own ("top"), inside a fusion ("fused": one
kernel with its fusion instruction), or in a reducer / comparator applied per element
("applied"). A conditional's branches each count every time the conditional runs (an upper
bound); `HloModule.counted` recounts with the fraction of runs each branch takes (the
planner's pipeline schedules) or per execution of one computation.

Shapes and bytes of type strings: hlo/array_types.py; backend_config fields:
hlo/backend_config.py; op_name scopes: hlo/metadata.py; XLA's buffer dumps: hlo/dumps.py.
Every regular expression over HLO text in olmo_jax lives in this package.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
import re
from fractions import Fraction

from olmo_jax.planner.hlo.array_types import tuple_elements

_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*(?:\(.*->.*)?\{\s*$")
_INSTR = re.compile(r"^\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s+([a-z][\w\-]*)\((.*)$")
_CALLEES = re.compile(
    r"\b(?:body|condition|calls|to_apply|true_computation|false_computation)=%?([\w.\-]+)")
_CONTEXT_CALLEES = re.compile(r"\b(calls|to_apply)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_WHILE = re.compile(r"\swhile\(")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"')
_OPNAME = re.compile(r'op_name="([^"]*)"')
_OPERAND = re.compile(r"%([\w.\-]+(?:#\d+)?)")
_TARGET = re.compile(r'custom_call_target="([^"]+)"')
_WINDOW = re.compile(r"size=([\dx]+)")
_MESH_GROUPS = re.compile(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}")
_MESH_SIZES = re.compile(r"'(\w+)'=(\d+)")
_MESH_AXES = re.compile(r"'(\w+)'")
_IOTA_GROUPS = re.compile(r"replica_groups=\[([\d,]+)\]<=")
_LIST_GROUPS = re.compile(r"replica_groups=\{\{([\d,]*)\}")
_PARTITIONS = re.compile(r"num_partitions=(\d+)")


@functools.cache
def _attr_pattern(key: str) -> re.Pattern:
    return re.compile(rf"\b{re.escape(key)}=(\{{[^}}]*\}}|%?[\w.\-]+)")


@functools.cache
def _body_pattern(callee: str) -> re.Pattern:
    return re.compile(rf"body=%?{re.escape(callee)}\b")


def hlo_text(program) -> str:
    """The HLO text of a jax Compiled (`as_text()`), or the text itself (a Lowered's is
    `as_text(dialect="hlo")`; its default is StableHLO, which this does not read)."""
    if isinstance(program, str):
        return program
    return program.as_text()


def num_partitions(program) -> int:
    """The module's `num_partitions` (1 when it names none)."""
    m = _PARTITIONS.search(hlo_text(program))
    return int(m.group(1)) if m else 1


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
            is_while = _WHILE.search(line) is not None
            trip = _TRIP.search(line)
            n = int(trip.group(1)) if trip else 1
            for callee in callees:
                if is_while and _body_pattern(callee).search(line):
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
        """The value of attribute `key`: a `{...}` list as written, or a name / number
        (a computation's keeps its `%`)."""
        m = _attr_pattern(key).search(self.args)
        return m.group(1) if m else None

    def computations(self, key: str) -> list[str]:
        """The computations attribute `key` names (`calls`, `to_apply`, `body`,
        `branch_computations`, ...), without their `%`."""
        text = self.attr(key)
        if text is None:
            return []
        return [c.strip().lstrip("%") for c in text.strip("{}").split(",") if c.strip()]

    @property
    def custom_call_target(self) -> str | None:
        """The target of a custom call (None for other opcodes)."""
        if self.opcode != "custom-call":
            return None
        m = _TARGET.search(self.args)
        return m.group(1) if m else None

    @property
    def known_trip_count(self) -> int | None:
        """A while loop's trip count, as its backend_config states it (None: unknown)."""
        m = _TRIP.search(self.args)
        return int(m.group(1)) if m else None

    @property
    def window_elements(self) -> int:
        """Elements of a reduce-window's window (`window={size=2x3 ...}`; 1 without)."""
        m = _WINDOW.search(self.args)
        return math.prod(int(s) for s in m.group(1).split("x")) if m else 1

    def replica_group(self, n_partitions: int) -> tuple[int, tuple[str, ...]]:
        """(devices in each group of a collective, the mesh axes the group spans when the
        HLO names them): from `replica_groups` (mesh[...]{axes}, iota [n,g]<=..., or an
        explicit {{...}} list), a collective-permute's pairs (2), else every partition."""
        if m := _MESH_GROUPS.search(self.args):
            sizes = dict(_MESH_SIZES.findall(m.group(1)))
            axes = tuple(_MESH_AXES.findall(m.group(2)))
            return math.prod(int(sizes[a]) for a in axes), axes
        if m := _IOTA_GROUPS.search(self.args):
            return int(m.group(1).split(",")[-1]), ()
        if m := _LIST_GROUPS.search(self.args):
            return len([d for d in m.group(1).split(",") if d]), ()
        if "source_target_pairs" in self.args:
            return 2, ()
        return n_partitions, ()


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
            for attr, callee in _CONTEXT_CALLEES.findall(line):
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
    """Every instruction of a program (a jax Compiled, or HLO text: hlo_text) with
    the number of times one program run executes it."""
    text = hlo_text(program)
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


