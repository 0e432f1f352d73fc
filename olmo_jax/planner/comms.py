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

The program is read by the planner's HLO reader (planner/hlo/parse.py: every instruction
with its execution count); a conditional's branches each count every time it runs unless
the module was recounted (`HloModule.counted`: the planner's pipeline schedules).
"""

from __future__ import annotations

import dataclasses
import json

from olmo_jax.planner.hlo import metadata
from olmo_jax.planner.hlo.array_types import shape_bytes, tuple_elements
from olmo_jax.planner.hlo.parse import HloModule, Instruction, parse_module

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "ragged-all-to-all",
         "collective-permute", "collective-broadcast")
# Named scopes set by olmo_jax.parallel (zero.py, strategy.py, expert/*).
SCOPES = ("zero_gather", "zero_reduce", "fsdp_gather", "loss_allsum", "moe_rowwise",
          "moe_ragged", "moe_allgather", "pipe_gather", "pipe_reduce", "pipe_send",
          "muon_gather", "muon_return")


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
            if metadata.in_collective_scope(self.op_name, scope):
                return scope
        return "other"


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
    src_bytes = sum(shape_bytes(t)[0] for t in src_types)
    op_bytes = sum(shape_bytes(module.type_of(o))[0] for o in ins.operands)
    return size * src_bytes // op_bytes if 0 < src_bytes < op_bytes else size


def collectives(program) -> list[Collective]:
    """Every collective in a compiled program (a jax Compiled, HLO text, or a parsed
    HloModule)."""
    module = program if isinstance(program, HloModule) else parse_module(program)
    out = []
    for ins in module.instructions:
        op = ins.opcode
        kind = op[: -len("-start")] if op.endswith("-start") else op
        if kind not in KINDS or op.endswith("-done"):
            continue
        size, shapes = shape_bytes(ins.type_str)
        parts = tuple_elements(ins.type_str)
        if op.endswith("-start") and len(parts) > 1 and (
                parts[0].startswith("(") or kind in ("all-gather", "collective-permute")):
            # An async start's ((operands), results[, context]) (XLA:GPU: every kind, one
            # array or a tuple of them for a combined collective), or an older (operand,
            # result, ...) all-gather / collective-permute: count the results.
            size, shapes = shape_bytes(parts[1])
        group, axes = ins.replica_group(module.num_partitions)
        if kind == "reduce-scatter":
            size *= group
        out.append(Collective(kind, ins.name, ins.computation, shapes, size, group, axes,
                              ins.count, ins.trip_counts_known, ins.op_name,
                              _jax_bytes(module, ins, size)))
    return out


def all_to_all_ops(program) -> list[int]:
    """Bytes delivered by each all-to-all op of a program, in text order: the result type
    of each synchronous `all-to-all` and of each `all-to-all-done` (an async pair counted
    once), tuple results summed. Use the HLO as lowered
    (`jit(f).lower(...).as_text(dialect="hlo")`) to compare payload dtypes (the expert
    dispatch's, model/moe/payload.py): XLA:CPU widens bf16 collectives to f32 when it
    compiles."""
    module = program if isinstance(program, HloModule) else parse_module(program)
    return [shape_bytes(ins.type_str)[0] for ins in module.instructions
            if ins.opcode in ("all-to-all", "all-to-all-done")]


def all_to_all_bytes(program) -> int:
    """Total bytes of all_to_all_ops(program)."""
    return sum(all_to_all_ops(program))


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
