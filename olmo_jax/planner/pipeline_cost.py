"""The pipelined step in a plan: how often each device runs each pipeline branch, and the
schedule's bubble in time.

The pipeline executor (olmo_jax/parallel/pipeline/run.py) is one `lax.scan` over the
schedule table's ticks; at every tick a device takes `lax.cond` branches named by scope:
pipe_fwd (one chunk's forward), pipe_bwd (its backward) and, inside them, pipe_first
(chunk 0: the embedding and dense blocks) and pipe_last (the last chunk: head and loss).
The compiled HLO keeps each as a conditional whose op_name ends in "<scope>/cond", with
branch_computations {false, true}. The HLO walk's default runs every branch every time,
which would charge each device a forward and a backward at every tick; `branch_weights`
gives each branch the share of its conditional's runs the table gives it, over all
stages, so the plan's per-device FLOPs, bytes and collectives are the mean over the
stages (the step's total / devices: per-token figures are exact).

The bubble: the ticks run in lockstep (each ends with a ppermute between neighbouring
stages), and in a tick a stage runs its F slot, then its B slot (schedule.py), so a tick
lasts as long as the largest (F + B) of any stage. `cost` prices one execution of each
branch with the roofline of its compiled operations and collectives (a forward or
backward of one chunk, plus the prologue / head on the first / last chunk), lays those
durations on the table, and compares its length (sum over ticks of the slowest stage's
F + B) with the mean busy time of a stage. The difference is time a device idles: the
projected step adds it (roofline.Projection.bubble_s), each op priced nothing overlapped,
collectives fully overlapped, and as the compiler scheduled it (planner/overlap.py). The
table's own bubble (what the trainer logs as `pipeline_bubble`) counts a backward as long
as a forward.
"""

from __future__ import annotations

import collections
import dataclasses
from fractions import Fraction

import numpy as np

from olmo_jax.parallel.pipeline import schedule as sched_lib
from olmo_jax.planner import comms, hlo_cost, overlap, roofline
from olmo_jax.planner.hardware import DeviceSpec
from olmo_jax.planner.hlo import metadata
from olmo_jax.planner.hlo.parse import HloModule

FWD, BWD = "pipe_fwd", "pipe_bwd"
FIRST, LAST = "pipe_first", "pipe_last"
# (role, the role it sits in) -> what one execution of its true branch runs
ROLES = {(FWD, ""): "forward of a chunk", (BWD, ""): "backward of a chunk",
         (FIRST, FWD): "+ embedding, dense blocks (chunk 0)",
         (LAST, FWD): "+ head and loss, forward and backward (last chunk)",
         (FIRST, BWD): "+ embedding, dense blocks backward (chunk 0)"}


@dataclasses.dataclass(frozen=True)
class Branch:
    role: str  # pipe_fwd | pipe_bwd | pipe_first | pipe_last
    within: str  # the role whose branch holds this conditional ("" at the tick level)
    taken: str  # the true branch's computation (the op)
    skipped: str  # the false branch's computation (the identity)


def branches(module: HloModule) -> list[Branch]:
    """The pipeline's conditionals in a compiled step."""
    out = []
    for ins in module.instructions:
        if ins.opcode != "conditional" or not (
                found := metadata.cond_scope(ins.op_name, (FWD, BWD, FIRST, LAST))):
            continue
        role, before = found
        comps = ins.computations("branch_computations")
        if not comps and ins.attr("true_computation"):  # a predicated conditional (XLA:GPU)
            comps = [ins.attr(k).lstrip("%") for k in ("false_computation", "true_computation")]
        if len(comps) != 2:
            raise ValueError(f"pipeline conditional {ins.name} ({ins.op_name}) has "
                             f"{len(comps)} branches, expected the two of a lax.cond")
        outer = metadata.conds_within(before + "/", (FWD, BWD))
        within = outer[-1] if role in (FIRST, LAST) and outer else ""
        out.append(Branch(role, within, comps[1], comps[0]))
    return out


def _cells(schedule: sched_lib.Schedule):
    """(forward, backward, chunk index) per (tick, stage): the F slot's forward and the
    B slot's backward ([ticks, P] each, the chunk index [ticks, 2, P])."""
    ops = schedule.table[..., sched_lib.COL["op"]]
    k = schedule.table[..., sched_lib.COL["virtual"]] * schedule.stages + np.arange(schedule.stages)
    return ops[:, 0] == sched_lib.FWD, ops[:, 1] == sched_lib.BWD, k


def shares(schedule: sched_lib.Schedule) -> dict[tuple[str, str], Fraction]:
    """Per role, the fraction of its conditional's runs that take the true branch, over
    all stages: forwards / (ticks x stages) (the F slot's cond runs once a tick), the
    same for backwards, and the first / last chunks' share of them."""
    fwd, bwd, k = _cells(schedule)
    kf, kb = k[:, 0], k[:, 1]
    last = schedule.chunks - 1
    return {(FWD, ""): Fraction(int(fwd.sum()), fwd.size),
            (BWD, ""): Fraction(int(bwd.sum()), bwd.size),
            (FIRST, FWD): Fraction(int((fwd & (kf == 0)).sum()), int(fwd.sum())),
            (LAST, FWD): Fraction(int((fwd & (kf == last)).sum()), int(fwd.sum())),
            (FIRST, BWD): Fraction(int((bwd & (kb == 0)).sum()), int(bwd.sum()))}


def branch_weights(module: HloModule, schedule: sched_lib.Schedule
                   ) -> dict[str, Fraction]:
    """Branch computation -> the share of its conditional's runs that take it (for
    HloModule.counted). Raises ValueError when the compiled step does not hold the
    pipeline's conditionals as expected (the counts would be wrong)."""
    found = branches(module)
    roles = {(b.role, b.within) for b in found}
    if not {(FWD, ""), (BWD, "")} <= roles:
        raise ValueError("the compiled step has no pipe_fwd / pipe_bwd conditional: the "
                         "planner cannot count the pipeline schedule's ops")
    share = shares(schedule)
    callers = collections.Counter(callee for edges in module.calls.values()
                                  for callee, _, _ in edges)
    weights: dict[str, Fraction] = {}
    for b in found:
        if (b.role, b.within) not in share:
            raise ValueError(f"a {b.role} conditional inside {b.within or 'the tick'}: not a "
                             "place the pipeline executor puts one")
        for comp in (b.taken, b.skipped):
            if callers[comp] != 1:
                raise ValueError(f"pipeline branch computation {comp} has {callers[comp]} "
                                 "callers; its runs cannot be split by the schedule")
        weights[b.taken] = share[(b.role, b.within)]
        weights[b.skipped] = 1 - weights[b.taken]
    return weights


@dataclasses.dataclass(frozen=True)
class PipelineCost:
    """The schedule of one step priced with the roofline (seconds per device)."""

    kind: str
    stages: int
    virtual: int
    microbatches: int
    ticks: int
    passes: int  # table passes per step (trainer.grad_accum)
    table_bubble: float  # the table's, in op times (Schedule.bubble)
    op_s: dict[str, float]  # ROLES label -> seconds of one execution (nothing overlapped)
    schedule_s: float  # lockstep length of the step's passes (nothing overlapped)
    busy_s: float  # mean busy time of a stage over those passes
    schedule_overlapped_s: float  # the same with each op's collectives overlapped
    busy_overlapped_s: float
    schedule_scheduled_s: float  # the same with each op as the compiler scheduled it
    busy_scheduled_s: float

    @property
    def bubble_s(self) -> float:
        return self.schedule_s - self.busy_s

    @property
    def bubble_overlapped_s(self) -> float:
        return self.schedule_overlapped_s - self.busy_overlapped_s

    @property
    def bubble_scheduled_s(self) -> float:
        return self.schedule_scheduled_s - self.busy_scheduled_s

    @property
    def bubble(self) -> float:
        """Idle share of the schedule's time."""
        return self.bubble_s / self.schedule_s if self.schedule_s else 0.0

    def to_json(self) -> dict:
        return dataclasses.asdict(self) | {"bubble": self.bubble, "bubble_s": self.bubble_s,
                                           "bubble_overlapped_s": self.bubble_overlapped_s,
                                           "bubble_scheduled_s": self.bubble_scheduled_s}


def _seconds(module: HloModule, root: str, weights: dict[str, Fraction],
             spec: DeviceSpec, dtype: str, mesh: dict[str, int],
             accounting: roofline.Accounting) -> tuple[float, float, float]:
    """(nothing overlapped, collectives overlapped, as scheduled) seconds of one run of
    computation `root`: its operations' roofline plus its collectives on the links."""
    rooted = module.counted(weights, root=root)
    ops = hlo_cost.program_cost(rooted).ops
    links = roofline.link_uses(comms.collectives(rooted))
    p = roofline.project(ops, links, spec, dtype, mesh, 1.0, 1.0, accounting=accounting)
    replay = overlap.simulate(rooted, ops, spec, dtype, mesh, accounting, root=root)
    return p.step_s, p.overlapped_s, replay.step_s


def lockstep(schedule: sched_lib.Schedule, op_s: dict[tuple[str, str], float]
             ) -> tuple[float, float]:
    """(sum over ticks of the slowest stage's F slot + B slot, mean busy time per stage)
    of one pass through the table, an op costing op_s[(role, within)] (+ the nested
    roles)."""
    fwd, bwd, k = _cells(schedule)
    kf, kb = k[:, 0], k[:, 1]
    cell = np.zeros(fwd.shape)  # [ticks, P]: a stage's time in the tick
    cell[fwd] += op_s[(FWD, "")]
    cell[bwd] += op_s[(BWD, "")]
    cell[fwd & (kf == 0)] += op_s.get((FIRST, FWD), 0.0)
    cell[fwd & (kf == schedule.chunks - 1)] += op_s.get((LAST, FWD), 0.0)
    cell[bwd & (kb == 0)] += op_s.get((FIRST, BWD), 0.0)
    return float(cell.max(axis=1).sum()), float(cell.sum() / schedule.stages)


def cost(module: HloModule, schedule: sched_lib.Schedule, passes: int,
         spec: DeviceSpec, dtype: str, mesh: dict[str, int],
         accounting: roofline.Accounting = roofline.XLA_CPU_AS_GPU) -> PipelineCost:
    """`module`: the compiled step (any counts); `passes`: table passes per step;
    `accounting`: which bytes the roofline counts (roofline.Accounting)."""
    found = branches(module)
    weights = branch_weights(module, schedule)
    alone = dict(weights)  # a forward / backward without its nested first / last parts
    for b in found:
        if b.within:
            alone[b.taken], alone[b.skipped] = Fraction(0), Fraction(1)
    per_role: dict[tuple[str, str], list[tuple[float, float, float]]] = \
        collections.defaultdict(list)
    for b in found:
        per_role[(b.role, b.within)].append(
            _seconds(module, b.taken, weights if b.within else alone, spec, dtype, mesh,
                     accounting))
    plain = {r: float(np.mean([s[0] for s in v])) for r, v in per_role.items()}
    over = {r: float(np.mean([s[1] for s in v])) for r, v in per_role.items()}
    as_sched = {r: float(np.mean([s[2] for s in v])) for r, v in per_role.items()}
    sched_s, busy_s = lockstep(schedule, plain)
    sched_o, busy_o = lockstep(schedule, over)
    sched_a, busy_a = lockstep(schedule, as_sched)
    return PipelineCost(schedule.kind, schedule.stages, schedule.virtual, schedule.microbatches,
                        schedule.ticks, passes, schedule.bubble,
                        {ROLES[r]: s for r, s in plain.items()}, passes * sched_s,
                        passes * busy_s, passes * sched_o, passes * busy_o, passes * sched_a,
                        passes * busy_a)
