"""Per-device memory of a compiled step: the arguments by part of the train state (from
the shardings, exact), the compiled memory analysis, and which buffers are live at the
peak (from XLA's buffer live-range dump), grouped by what they hold.

Every buffer live at the peak is named after what produced it: an argument by its
train-state path (XLA keeps the JAX argument name as the parameter's op_name); a value
made under one of the model's named scopes by that scope (forward or backward); a value
carried through a loop by the value the loop started from; a zero-initialized buffer
(gradient accumulators, stacked residuals of the layer scan) by the parameter whose
per-device shape it has, when one has it.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from pathlib import Path

import jax
import numpy as np
from jax.sharding import NamedSharding

from olmo_jax.model.params import path_name
from olmo_jax.parallel import zero
from olmo_jax.planner.hlo import metadata
from olmo_jax.planner.hlo.array_types import dims, type_bytes
from olmo_jax.planner.hlo.dumps import buffer_slices, read_peak
from olmo_jax.planner.hlo.parse import HloModule
from olmo_jax.planner.hlo_cost import OTHER, Walker, scope_of


@dataclasses.dataclass(frozen=True)
class PeakGroup:
    label: str
    bytes: int
    values: int
    example: str  # one value's type


def argument_bytes(state, shardings, batch) -> dict[str, int]:
    """Per-device bytes of each part of the step's arguments."""
    out = {part: zero.per_device_bytes(getattr(state, part), getattr(shardings, part))
           for part in ("params", "opt_state", "model_state")}
    out["step, rng"] = zero.per_device_bytes((state.step, state.rng),
                                             (shardings.step, shardings.rng))
    out["guard"] = zero.per_device_bytes(state.guard, shardings.guard)  # trainer/guard.py
    out["batch"] = int(math.prod(batch.sharding.shard_shape(batch.shape))
                       * np.dtype(batch.dtype).itemsize)
    return out


def param_shapes(params, plan) -> dict[tuple[int, ...], str]:
    """Per-device shapes of the parameters (as computed with and as stored; a pipeline
    stage's MoE-block weights also as its [V * c] chunk rows) -> the names of the
    parameters with that shape ("a/b/{c,d}" when several share it)."""
    names: dict[tuple[int, ...], list[str]] = collections.defaultdict(list)
    leaves = jax.tree_util.tree_leaves_with_path(params)
    layouts = jax.tree.leaves(plan.layouts, is_leaf=lambda x: isinstance(x, zero.ParamLayout))
    rows = None
    if plan.pipeline is not None:
        rows = plan.pipeline.chunks.virtual * plan.pipeline.chunks.slots
    for (path, x), lay in zip(leaves, layouts, strict=True):
        shapes = [tuple(NamedSharding(plan.mesh, spec).shard_shape(x.shape))
                  for spec in (lay.storage, lay.compute)]
        if rows is not None and getattr(lay, "stage", False):
            shapes.append((rows,) + shapes[1][1:])
        for shape in shapes:
            if path_name(path) not in names[shape]:
                names[shape].append(path_name(path))
    out = {}
    for shape, group in names.items():
        prefix = group[0].rsplit("/", 1)[0]
        same_dir = all(n.rsplit("/", 1)[0] == prefix for n in group)
        out[shape] = (group[0] if len(group) == 1 else
                      f"{prefix}/{{{','.join(sorted(n.rsplit('/', 1)[1] for n in group))}}}"
                      if same_dir else f"{group[0]} (+{len(group) - 1} more)")
    return out


def _new_bytes(covered: dict[int, list], where: tuple[int, int, int]) -> int:
    """Bytes of the slice `where` not yet in `covered` (allocation -> [(start, end)]),
    which it joins."""
    allocation, start, size = where
    spans = covered.setdefault(allocation, [])
    end = start + size
    seen = 0
    for a, b in sorted(spans):  # disjoint spans: the overlap with each counts once
        lo, hi = max(a, start), min(b, end)
        seen += max(0, hi - lo)
    spans.append((start, end))
    merged = []
    for a, b in sorted(spans):
        if merged and a <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], b))
        else:
            merged.append((a, b))
    covered[allocation] = merged
    return size - seen


def _ref(operand: str) -> tuple[str, str]:
    """An operand reference "name" / "name#i" as (name, tuple index)."""
    name, _, index = operand.partition("#")
    return name, index


class _Namer:
    def __init__(self, module: HloModule, shapes: dict[tuple[int, ...], str]):
        self.module = module
        self.shapes = shapes
        self.walker = Walker(module)
        self.body_of = {}  # loop body computation -> its while instruction
        for ins in module.instructions:
            if ins.opcode == "while" and (body := ins.attr("body")):
                self.body_of[body.lstrip("%")] = ins

    def label(self, name: str, index: str = "", depth: int = 0) -> str:
        ref = f"{name}#{index.split(',')[0]}" if index else name
        ins = self.module.instruction(ref)
        if ins is None or depth > 8:
            return "other"
        op = ins.opcode
        if op == "parameter" and (arg := metadata.argument(ins.op_name, "state")):
            return f"argument: {arg}"  # the jitted step's argument name
        if op == "parameter" and ins.computation in self.body_of and index:
            loop = self.body_of[ins.computation]  # carried through the loop: its start value
            init = self.module.instruction(loop.operands[0])
            i = int(index.split(",")[0])
            if init is not None and init.opcode == "tuple" and i < len(init.operands):
                return self.label(*_ref(init.operands[i]), depth + 1)
        if op == "get-tuple-element" and ins.operands:
            return self.label(_ref(ins.operands[0])[0], ins.attr("index") or "", depth + 1)
        if op in ("copy", "bitcast") and ins.operands:
            return self.label(*_ref(ins.operands[0]), depth + 1)
        type_str = self.module.type_of(ref)
        shape = tuple(dims(type_str))
        if shape in self.shapes and scope_of(ins.op_name) == OTHER:
            return (f"{type_str.split('[', 1)[0]} {shape} = per-device {self.shapes[shape]} "
                    "(gradients, weight copies)")
        written = self._stacked_update(ins) or self._loop_buffer_update(ins)
        if written is not None:
            update, writer = written
            what = ("per-layer outputs of the backward scan" if "transpose(" in writer.op_name
                    else "scan residuals for the backward pass")
            return f"{what}: {self.label(*_ref(update), depth + 1)}"
        scope = self.walker.scope(ins)
        if scope != OTHER:
            return f"{scope} ({'backward' if 'transpose(' in ins.op_name else 'forward'})"
        if op == "parameter":
            return "argument: batch" if ins.computation.startswith("main") else "loop state"
        tail = metadata.short_name(ins.op_name or op)
        return f"other ({tail})"

    def _loop_buffer_update(self, ins):
        """For a buffer that starts a layer scan's stacked output (a zero-initialized value
        in a while loop's initial tuple): (what the loop body writes into it, the writer)."""
        for user in self.walker.users[ins.name]:
            if user.opcode != "tuple" or ins.name not in user.operands:
                continue
            i = user.operands.index(ins.name)
            for loop in self.walker.users[user.name]:
                body = loop.attr("body") if loop.opcode == "while" else None
                for ref in self._element_refs(body.lstrip("%"), i) if body else ():
                    for writer in self.walker.users[ref.split("#")[0]]:
                        if ref not in writer.operands:
                            continue
                        if (written := self._stacked_update(writer)) is not None:
                            return written
        return None

    def _element_refs(self, body: str, i: int) -> list[str]:
        """Operand references that stand for element i of a loop body's parameter: its
        get-tuple-elements, and "param#i"."""
        params = {ins.name for ins in self.walker.comp[body] if ins.opcode == "parameter"}
        gtes = [ins.name for ins in self.walker.comp[body]
                if ins.opcode == "get-tuple-element" and ins.attr("index") == str(i)
                and ins.operands and ins.operands[0] in params]
        return gtes + [f"{p}#{i}" for p in params]

    def _stacked_update(self, ins):
        """For a value written by a dynamic-update-slice (a scan stacking one layer's value
        into its [layers, ...] buffer): (the operand holding the update, the writer)."""
        if ins.opcode == "dynamic-update-slice":
            return ins.operands[1], ins
        if ins.opcode != "fusion" or not (callee := ins.attr("calls")):
            return None
        root = self.module.roots.get(callee.lstrip("%"))
        while root is not None and root.opcode == "bitcast":
            root = self.module.instruction(root.operands[0])
        if root is None or root.opcode != "dynamic-update-slice":
            return None
        update = self.module.instruction(root.operands[1])
        while update is not None and update.opcode in ("bitcast", "copy", "convert"):
            update = self.module.instruction(update.operands[0])
        if update is None:
            return None
        if update.opcode == "parameter":
            index = int(update.args.split(")", 1)[0])
            return (ins.operands[index], ins) if index < len(ins.operands) else None
        return update.name, ins


def peak_groups(live_range_text: str, module: HloModule, shapes: dict[tuple[int, ...], str],
                buffer_assignment_text: str = "") -> tuple[int, list[PeakGroup]]:
    """(bytes live at the peak, the live values grouped by label, largest first). The
    live-range report lists values; with the buffer assignment, values live at the peak
    that lie in the same bytes (a loop carry and the value updated in place, ...) count
    once, under the first one listed."""
    namer = _Namer(module, shapes)
    slices = buffer_slices(buffer_assignment_text)
    covered: dict[int, list] = {}
    groups: dict[str, list] = collections.defaultdict(lambda: [0, 0, ""])
    total = 0
    for name, index, size in read_peak(live_range_text):
        if (where := slices.get((name, index))) is not None:
            size = _new_bytes(covered, where)
            if size <= 0:
                continue
        g = groups[namer.label(name, index)]
        g[0] += size
        g[1] += 1
        total += size
        ref = f"{name}#{index.split(',')[0]}" if index else name
        if not g[2] or size >= type_bytes(g[2]):
            g[2] = module.type_of(ref).split("{")[0]
    out = [PeakGroup(k, v[0], v[1], v[2]) for k, v in groups.items()]
    return total, sorted(out, key=lambda g: -g.bytes)


def _newest_dump(dump_dir: Path, suffix: str) -> Path | None:
    """The newest train-step file XLA dumped into `dump_dir` ending in `suffix`."""
    files = sorted(Path(dump_dir).glob(f"*train_step*{suffix}"), key=lambda p: p.stat().st_mtime)
    return files[-1] if files else None


def gpu_module_file(dump_dir: Path) -> Path | None:
    """XLA:GPU's optimized train-step module as the buffer assignment saw it (the names the
    live-range report uses; `Compiled.as_text()` renames some)."""
    return _newest_dump(dump_dir, "gpu_after_optimizations.txt")


def buffer_assignment_file(dump_dir: Path) -> Path | None:
    """The buffer assignment XLA wrote for the train step (newest when several)."""
    return _newest_dump(dump_dir, "buffer-assignment.txt")


def live_range_file(dump_dir: Path) -> Path | None:
    """The live-range report XLA wrote for the train step (newest when several)."""
    return _newest_dump(dump_dir, "live-range.txt")
