"""The step as the compiler scheduled it: which collectives run asynchronously, what compute
the latency-hiding scheduler placed between each one's start and done, and the step time
that follows when only that compute hides them ("as scheduled", between the roofline's two
bounds: nothing overlapped and collectives fully overlapped).

XLA:GPU's optimized module is scheduled (`is_scheduled=true`): each computation lists its
instructions in the order they are issued. A collective is asynchronous when it is split
into a start and a done (`async-start` wrapping a computation that holds the plain op, with
`async-done` on it; or an `all-gather-start` / `-done` pair), and its backend_config does
not say `"is_sync":true`; XLA turns a pair with nothing worth hiding between them back into
the plain op, which runs synchronously (the compute waits for it). A plain collective in a
scheduled computation is synchronous. XLA:CPU runs every collective synchronously.

`simulate` replays the schedule on one device with two resources, as the roofline prices
them: the compute stream (each operation takes its roofline time, roofline.op_seconds) and
the links (each collective its link time, hardware.link_seconds, one after another as the
roofline adds them):
  compute op        the clock advances by its roofline time;
  async start       the collective is queued on the links (it starts when the links are
                    free, not before its start is issued) and the compute runs on;
  done              the compute waits until that collective has finished;
  sync collective   the compute waits for the links, then for the collective;
  while / call /    their computations replayed in place (a loop body as often as its trip
  conditional       count; a conditional's branches weighted by the share of its runs that
                    take each, as HloModule.counted counts them: a pipeline schedule's);
  async compute     (an `async-start` wrapping a fusion) priced as compute where it starts.
The replayed length is the step "as scheduled": each collective is hidden by at most the
compute issued between its start and done, and compute cannot hide two collectives at once
(they share the links). Every operation's roofline time is in it exactly once and every
collective's link time at most once, so roofline <= as scheduled <= roofline + links, and
max(roofline, links) <= it. What it does not model: a second compute stream, collectives on
NVLink and the network running at once, and the contention of a GEMM with a concurrent
collective for SMs and HBM (which would lengthen both).

`exposed` per collective row is the time the compute waited on it; `between` the roofline
time of the operations scheduled between its start and done (per step).
"""

from __future__ import annotations

import collections
import dataclasses

from olmo_jax.planner import comms, hardware, hlo_cost, roofline
from olmo_jax.planner.hlo import backend_config
from olmo_jax.planner.hlo.parse import HloModule, Instruction


@dataclasses.dataclass(frozen=True)
class Row:
    """Collectives of one (kind, purpose, phase), per step per device."""

    kind: str
    purpose: str
    phase: str
    runs: float
    async_runs: float  # runs split into start / done with work between
    link_s: float  # their time on the links
    between_s: float  # roofline time of the ops scheduled between start and done
    exposed_s: float  # time the compute waited on them in the replayed schedule
    between_by_scope: dict[str, float] = dataclasses.field(default_factory=dict)  # of between_s

    @property
    def hidden_s(self) -> float:
        return self.link_s - self.exposed_s


@dataclasses.dataclass(frozen=True)
class Scheduled:
    """One run of a computation (the step, or one pipeline branch) replayed as scheduled."""

    step_s: float  # the replayed length
    compute_s: float  # the roofline time it contains (= roofline.Projection.roofline_s)
    link_s: float  # the link time it contains
    rows: list[Row]

    @property
    def exposed_s(self) -> float:
        """Link time the compute waited on (step_s - compute_s)."""
        return self.step_s - self.compute_s

    def to_json(self) -> dict:
        return {"step_s": self.step_s, "compute_s": self.compute_s, "link_s": self.link_s,
                "exposed_s": self.exposed_s,
                "rows": [dataclasses.asdict(r) | {"hidden_s": r.hidden_s} for r in self.rows]}


@dataclasses.dataclass(frozen=True)
class _Link:
    key: tuple[str, str, str]  # (kind, purpose, phase)
    seconds: float
    asynchronous: bool


@dataclasses.dataclass
class _State:
    t: float = 0.0  # the compute stream's clock
    free: float = 0.0  # when the links are free
    compute: float = 0.0
    link: float = 0.0
    pending: dict = dataclasses.field(default_factory=dict)  # start name -> (end, key)
    exposed: collections.Counter = dataclasses.field(default_factory=collections.Counter)

    def add(self, n: float, other: _State) -> None:
        """n runs of a computation replayed from idle links (`other`) in place."""
        self.t += n * other.t
        self.compute += n * other.compute
        self.link += n * other.link
        for k, v in other.exposed.items():
            self.exposed[k] += n * v


def _row_key(c: comms.Collective) -> tuple[str, str, str]:
    return c.kind, c.purpose, c.phase


def _called(ins: Instruction) -> str | None:
    """The computation an instruction's `calls` names (an async-start's wrapped one)."""
    called = ins.computations("calls")
    return called[0] if called else None


class _Replay:
    def __init__(self, module: HloModule, op_s: dict[str, float],
                 coll_s: dict[str, float]):
        self.module = module
        self.op_s = op_s
        self.order: dict[str, list[Instruction]] = collections.defaultdict(list)
        self.comp_count: dict[str, float] = {}
        for ins in module.instructions:
            self.order[ins.computation].append(ins)
            self.comp_count.setdefault(ins.computation, ins.count)
        by_comp = {}  # a computation wrapping one collective (an async-start's) -> it
        self.links: dict[str, _Link] = {}  # instruction issuing a collective -> its link use
        colls = [c for c in comms.collectives(module) if c.group_size > 1]  # 1: no traffic
        for c in colls:
            by_comp[c.computation] = c
        self.wrapped = set()
        for ins in module.instructions:
            if ins.context != "top":
                continue
            if ins.opcode == "async-start" and (wrapped := _called(ins)) in by_comp:
                c = by_comp[wrapped]
                self.wrapped.add(wrapped)
                self.links[ins.name] = _Link(_row_key(c), coll_s.get(c.name, 0.0),
                                             not backend_config.is_sync(ins))
        for c in colls:
            ins = module.instruction(c.name)
            if c.computation in self.wrapped or ins is None or ins.context != "top":
                continue
            self.links[c.name] = _Link(_row_key(c), coll_s.get(c.name, 0.0),
                                       ins.opcode.endswith("-start")
                                       and not backend_config.is_sync(ins))
        self.memo: dict[str, _State] = {}
        self.walker: hlo_cost.Walker | None = None

    def alone(self, comp: str) -> _State:
        """One run of `comp` replayed from an idle link."""
        if comp not in self.memo:
            st = _State()
            self.run(comp, st)
            self.memo[comp] = st
        return self.memo[comp]

    def run(self, comp: str, st: _State) -> None:
        for ins in self.order.get(comp, ()):
            self.step(ins, st)

    def place(self, comp: str, st: _State, n: float = 1.0) -> None:
        """n runs of `comp` in place: replayed against the links' state while a collective
        issued before them is still on the links, else from the memo."""
        while n >= 1 and st.free > st.t:
            self.run(comp, st)
            n -= 1
        if n > 0:
            st.add(n, self.alone(comp))

    def step(self, ins: Instruction, st: _State) -> None:
        op = ins.opcode
        link = self.links.get(ins.name)
        if link is not None and link.asynchronous:
            begin = max(st.t, st.free)
            st.free = begin + link.seconds
            st.link += link.seconds
            st.pending[ins.name] = (st.free, link.key)
        elif link is not None:  # synchronous: the compute waits for the links and for it
            end = max(st.t, st.free) + link.seconds
            st.exposed[link.key] += end - st.t
            st.link += link.seconds
            st.t = st.free = end
        elif op.endswith("-done") and ins.operands and ins.operands[0] in st.pending:
            end, key = st.pending.pop(ins.operands[0])
            if end > st.t:
                st.exposed[key] += end - st.t
                st.t = end
        elif op == "while":
            body, cond = ins.attr("body").lstrip("%"), (ins.attr("condition") or "").lstrip("%")
            trip = 1 if (n := ins.known_trip_count) is None else n
            self.place(cond, st)  # tested once more than the body runs
            done = 0
            while done < trip and st.free > st.t:  # a collective issued before is on the links
                self.run(body, st)
                self.run(cond, st)
                done += 1
            if done < trip:
                st.add(trip - done, self.alone(body))
                st.add(trip - done, self.alone(cond))
        elif op == "call" and (callee := ins.attr("to_apply")):
            self.place(callee.lstrip("%"), st)
        elif op == "conditional":
            self.conditional(ins, st)
        elif op == "async-start" and (wrapped := _called(ins)):
            self.place(wrapped, st)  # async compute: priced where it starts
        cost = self.op_s.get(ins.name, 0.0)
        st.t += cost
        st.compute += cost

    def conditional(self, ins: Instruction, st: _State) -> None:
        text = ins.attr("branch_computations")
        if text:
            comps = [c.strip().lstrip("%") for c in text.strip("{}").split(",") if c.strip()]
        else:
            comps = [ins.attr(k).lstrip("%") for k in ("true_computation", "false_computation")
                     if ins.attr(k)]
        if not ins.count:
            return
        weights = [self.comp_count.get(c, 0) / ins.count for c in comps]
        if st.free <= st.t or abs(sum(weights) - 1) > 1e-9:
            for c, w in zip(comps, weights, strict=True):
                if w:
                    self.place(c, st, w)
            return
        # A collective is on the links: each branch replayed from this state, averaged.
        out = _State()
        for c, w in zip(comps, weights, strict=True):
            b = dataclasses.replace(st, pending=dict(st.pending), exposed=collections.Counter())
            self.run(c, b)
            out.t += w * b.t
            out.free += w * b.free
            out.compute += w * (b.compute - st.compute)
            out.link += w * (b.link - st.link)
            for k, v in b.exposed.items():
                out.exposed[k] += w * v
        st.t, st.free = out.t, out.free
        st.compute += out.compute
        st.link += out.link
        st.exposed.update(out.exposed)

    def between(self, comp: str) -> dict[str, collections.Counter]:
        """Per async collective of `comp`: the roofline time of what is scheduled between
        its start and its done, by model scope (hlo_cost.scope_of; a loop, call or
        conditional at its replayed length, under its opcode)."""
        out, open_ = {}, {}
        for ins in self.order.get(comp, ()):
            if ins.opcode.endswith("-done") and ins.operands and ins.operands[0] in open_:
                out[ins.operands[0]] = open_.pop(ins.operands[0])
            if open_ and (length := self._length(ins)):
                scope = self._scope(ins)
                for window in open_.values():
                    window[scope] += length
            link = self.links.get(ins.name)
            if link is not None and link.asynchronous:
                open_[ins.name] = collections.Counter()
        return out

    def _scope(self, ins: Instruction) -> str:
        if ins.opcode in ("while", "call", "conditional"):
            return ins.opcode
        if self.walker is None:
            self.walker = hlo_cost.Walker(self.module)
        if ins.opcode == "async-start" and (wrapped := _called(ins)):
            root = self.module.roots.get(wrapped)
            return self.walker.scope(root) if root is not None else hlo_cost.OTHER
        return self.walker.scope(ins)

    def _length(self, ins: Instruction) -> float:
        if ins.name in self.links:
            return 0.0
        st = _State()
        self.step(ins, st)
        return st.t


def simulate(module: HloModule, ops: list[hlo_cost.OpCost], spec: hardware.DeviceSpec,
             dtype: str, mesh_shape: dict[str, int],
             accounting: roofline.Accounting = roofline.XLA_CPU_AS_GPU,
             root: str | None = None) -> Scheduled:
    """One run of `root` (default: the entry) of `module` replayed as scheduled (module
    docstring). `ops`: hlo_cost.program_cost(module).ops, priced by roofline.op_seconds."""
    op_s = {op.name: roofline.op_seconds(op, spec, dtype, accounting)[1] for op in ops if op.name}
    colls = comms.collectives(module)
    coll_s = {c.name: hardware.link_seconds(
        c.kind, c.jax_bytes, c.group_size,
        hardware.intra_node(mesh_shape, c.axes, c.group_size, spec), spec) for c in colls}
    replay = _Replay(module, op_s, coll_s)
    root = root or module.entry
    st = replay.alone(root)
    # Per row: runs, async runs, link time and compute between (static, per step).
    runs = collections.Counter()
    async_runs = collections.Counter()
    link_s = collections.Counter()
    between_s = collections.Counter()
    by_scope: dict[tuple, collections.Counter] = collections.defaultdict(collections.Counter)
    between = {}
    for comp in {replay.module.instruction(n).computation for n in replay.links}:
        between.update(replay.between(comp))
    for name, link in replay.links.items():
        n = module.instruction(name).count
        runs[link.key] += n
        link_s[link.key] += n * link.seconds
        if link.asynchronous:
            async_runs[link.key] += n
            for scope, t in between.get(name, {}).items():
                between_s[link.key] += n * t
                by_scope[link.key][scope] += n * t
    rows = [Row(*k, runs[k], async_runs[k], link_s[k], between_s[k], st.exposed.get(k, 0.0),
                dict(by_scope[k].most_common()))
            for k in sorted(runs) if runs[k]]
    return Scheduled(st.t, st.compute, st.link, rows)
