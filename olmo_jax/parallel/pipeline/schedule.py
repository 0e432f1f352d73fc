"""Pipeline schedules as pure tables: what every stage does at every tick, and the
buffer slot each value waiting between ticks occupies.

P stages (the devices along mesh axis `pipe`) with V virtual stages each run the model
split into K = P * V chunks: chunk k = v * P + s lives on stage s as its virtual stage
v, and activations flow chunk k -> k + 1 (stage s -> s + 1, and P - 1 -> 0 into the next
virtual stage). A tick has two op slots per stage, run in order: the F slot (at most
one forward: chunk k of microbatch m, (m, v)) and the B slot (at most one backward);
then one ppermute each way carries the tick's activations and cotangents to the
neighbouring stages, which can use them from the next tick. A backward may use the
forward its own stage ran in the F slot of the same tick: the last chunk's F (with the
head's cotangent) and its B share a tick. The ticks run in lockstep, so a tick lasts as
long as the longest (F + B) of any stage: pairing a forward with a backward in each tick
of 1F1B's steady state keeps a stage from waiting, in its forward ticks, on its
neighbours' slower backwards (a backward costs several forwards with model.remat = block).

Schedules are per-stage op orders; `simulate` runs each stage through its order, an op
taking its slot at the first tick its inputs exist:
  gpipe             every forward (virtual stage by virtual stage, microbatches in
                    order), then every backward in the reverse order. V > 1 gives the
                    circular GPipe. All M * V activations are alive at the turn.
  1f1b              one-forward-one-backward: stage s runs min(2 (P - s - 1), M) warm-up
                    forwards (the round trip to the last stage and back, a tick a hop),
                    then pairs F and B in each tick, then drains; at most min(2P - 1, M)
                    microbatches are alive on a stage, whatever M is (Megatron's
                    one-op ticks keep P, but a tick there lasts as long as a backward).
  interleaved_1f1b  Megatron's interleaved 1F1B over V >= 2 virtual stages (M a multiple
                    of P): forwards in groups of P microbatches per virtual stage,
                    warm-up 2 (P - s - 1) + (V - 1) P chunks (so at most Megatron's
                    2 (P - 1) + (V - 1) P + 1 alive), then F and B paired per tick.
Bubble fraction, in op times (a forward = a backward = 1 unit; a tick lasts as many
units as the most ops a stage runs in it): idle stage-units / all of them. Every table
has its textbook value, (P - 1) / (M + P - 1) for gpipe and 1f1b and (P - 1) / (V M + P - 1)
for interleaved (and circular gpipe): the length is 2 (V M + P - 1) units, P - 1 ticks of
filling and P - 1 of draining around the V M forwards and backwards of a stage. 1f1b and
interleaved take V M + 2 (P - 1) + (V - 1) P ticks, V M - 2 (P - 1) - (V - 1) P of them
(when positive) with a forward and a backward on every stage. With a backward b times
as long as a forward, a microbatch's F and B on a stage take 1 + b in the steady state,
not the 2b of two one-op ticks where neighbours alternate F and B, each tick lasting a
backward (olmo_jax/planner/pipeline_cost.py prices the table so).
"""

from __future__ import annotations

import dataclasses

import numpy as np

PIPELINE_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")
IDLE, FWD, BWD = 0, 1, 2
NO_SLOT = -1

# Columns of Schedule.table ([ticks, 2 (F slot, B slot), stages, len(FIELDS)] int32).
FIELDS = ("op", "mb", "virtual", "stash", "prologue", "fwd_in", "bwd_in", "head_out",
          "recv_fwd", "recv_bwd")
#   op        IDLE | FWD (F slot only) | BWD (B slot only)
#   mb, virtual  the microbatch and virtual stage of the op
#   stash     FWD writes / BWD reads the chunk's saved residuals here
#   prologue  chunk 0: FWD writes / BWD reads the embedding + dense blocks' residuals
#   fwd_in    FWD (chunk > 0) reads its input activation from this inbox slot
#   bwd_in    BWD reads its output cotangent from this inbox slot
#   head_out  last chunk's FWD writes the loss cotangent (the head's backward) here
#             (a bwd_in slot, read by the BWD of the same microbatch)
#   recv_fwd  where the activation arriving from stage s - 1 at the end of the tick goes
#   recv_bwd  where the cotangent arriving from stage s + 1 at the end of the tick goes
#             (recv_*: in the B-slot cell, the end of the tick; NO_SLOT in the F slot's)
COL = {name: i for i, name in enumerate(FIELDS)}


@dataclasses.dataclass(frozen=True, eq=False)
class Schedule:
    kind: str
    stages: int  # P
    virtual: int  # V
    microbatches: int  # M
    table: np.ndarray  # [ticks, 2 (F slot, B slot), P, len(FIELDS)] int32
    slots: dict  # buffer name (stash, prologue, fwd_in, bwd_in) -> slots needed

    @property
    def ticks(self) -> int:
        return self.table.shape[0]

    @property
    def chunks(self) -> int:
        return self.stages * self.virtual

    def column(self, name: str) -> np.ndarray:
        """[ticks * 2, P]: the field per op slot, in execution order (tick t's F slot is
        row 2t, its B slot row 2t + 1)."""
        return self.table[..., COL[name]].reshape(-1, self.stages)

    def ops_per_tick(self) -> np.ndarray:
        """[ticks, P]: how many ops (0, 1 or 2) each stage runs at each tick."""
        return (self.table[..., COL["op"]] != IDLE).sum(axis=1)

    @property
    def length(self) -> int:
        """The table's length in op times (a forward = a backward = 1): a tick lasts as
        long as the most ops a stage runs in it."""
        return int(self.ops_per_tick().max(axis=1).sum())

    @property
    def bubble(self) -> float:
        """Idle share of the stages' time over the table's length (op times)."""
        return 1.0 - float(self.ops_per_tick().sum()) / (self.stages * self.length)


def textbook_bubble(kind: str, stages: int, microbatches: int, virtual: int = 1) -> float:
    """The closed-form bubble fraction: (P-1)/(V*M + P-1) (V = 1 for plain gpipe/1f1b)."""
    del kind  # gpipe, 1f1b and interleaved share the formula once V is counted
    return (stages - 1) / (virtual * microbatches + stages - 1)


def check(kind: str, stages: int, virtual: int, microbatches: int) -> None:
    """Raises ValueError naming the config field for a schedule that cannot run."""
    if kind not in PIPELINE_SCHEDULES:
        raise ValueError(f"parallel.pipeline_schedule={kind!r}: choose one of {', '.join(PIPELINE_SCHEDULES)}")
    if stages < 1 or virtual < 1 or microbatches < 1:
        raise ValueError(
            f"parallel.pipe={stages}, parallel.virtual_stages={virtual} and "
            f"parallel.microbatches={microbatches} must all be >= 1")
    if kind == "1f1b" and virtual > 1:
        raise ValueError(
            f"parallel.pipeline_schedule=1f1b runs one chunk per stage, but "
            f"parallel.virtual_stages={virtual}; use interleaved_1f1b (or gpipe) for virtual stages")
    if kind == "interleaved_1f1b":
        if virtual < 2:
            raise ValueError(
                "parallel.pipeline_schedule=interleaved_1f1b needs parallel.virtual_stages >= 2 "
                "(with one chunk per stage use 1f1b)")
        if microbatches % stages:
            raise ValueError(
                f"parallel.pipeline_schedule=interleaved_1f1b runs microbatches in groups of "
                f"parallel.pipe={stages}: parallel.microbatches={microbatches} must be a multiple of it")


def stage_orders(kind: str, P: int, V: int, M: int) -> list[list[tuple[int, int, int]]]:
    """Per stage, its ops in program order as (op, microbatch, virtual stage)."""
    orders = []
    for s in range(P):
        if kind == "gpipe":
            fwd = [(FWD, m, v) for v in range(V) for m in range(M)]
            orders.append(fwd + [(BWD, m, v) for _, m, v in reversed(fwd)])
            continue
        total = M * V
        if kind == "1f1b":
            warmup = min(2 * (P - s - 1), M)
            f_ops = [(FWD, m, 0) for m in range(M)]
            b_ops = [(BWD, m, 0) for m in range(M)]
        else:  # interleaved_1f1b (Megatron's get_model_chunk_id / microbatch id)
            warmup = min(2 * (P - s - 1) + (V - 1) * P, total)

            def unit(j, op):
                group = j % (P * V)
                v = group // P
                return (op, (j // (P * V)) * P + j % P, v if op == FWD else V - 1 - v)

            f_ops = [unit(j, FWD) for j in range(total)]
            b_ops = [unit(j, BWD) for j in range(total)]
        order = f_ops[:warmup]
        for i in range(total - warmup):
            order += [f_ops[warmup + i], b_ops[i]]
        orders.append(order + b_ops[total - warmup:])
    return orders


def simulate(orders, P: int, V: int, M: int) -> list[list[tuple]]:
    """Runs every stage through its order, a tick taking at most one forward (its F
    slot) and then at most one backward (its B slot): the stage's next op runs in its
    slot at the first tick its inputs exist, an activation or cotangent from a neighbour
    counting from the tick after it was made, a stage's own forward (and the head's
    cotangent it leaves) already in the B slot of its tick. Returns per tick, per stage,
    (F op or None, B op or None)."""
    K = P * V
    done_f = np.full((M, K), -1)  # tick at which F(m, k) ran (-1: not yet)
    done_b = np.full((M, K), -1)
    pos = [0] * P
    ticks = []

    def next_op(s, kind):
        if pos[s] < len(orders[s]) and orders[s][pos[s]][0] == kind:
            return orders[s][pos[s]]
        return None

    while any(pos[s] < len(orders[s]) for s in range(P)):
        t = len(ticks)
        if t > 4 * (M * V + P) * 2 + 8:
            raise RuntimeError("pipeline schedule deadlocked (an op order violates dependencies)")
        row = []
        for s in range(P):  # F slots: inputs from earlier ticks only
            f = next_op(s, FWD)
            if f is not None and not (f[2] * P + s == 0 or 0 <= done_f[f[1], f[2] * P + s - 1] < t):
                f = None
            if f is not None:
                pos[s] += 1
            row.append([f, None])
        for s, (f, _) in enumerate(row):
            if f is not None:
                done_f[f[1], f[2] * P + s] = t
        for s in range(P):  # B slots: this stage's forward of this tick already ran
            b = next_op(s, BWD)
            if b is not None:
                _, m, v = b
                k = v * P + s
                if not (0 <= done_f[m, k] <= t and (k == K - 1 or 0 <= done_b[m, k + 1] < t)):
                    b = None
            if b is not None:
                pos[s] += 1
            row[s][1] = b
        for s, (_, b) in enumerate(row):
            if b is not None:
                done_b[b[1], b[2] * P + s] = t
        ticks.append([tuple(cell) for cell in row])
    return ticks


class _Slots:
    """Lowest-free slot allocator of one buffer on one stage."""

    def __init__(self):
        self.used: set[int] = set()
        self.peak = 0

    def take(self) -> int:
        slot = next(i for i in range(len(self.used) + 1) if i not in self.used)
        self.used.add(slot)
        self.peak = max(self.peak, len(self.used))
        return slot

    def free(self, slot: int) -> None:
        self.used.remove(slot)


def build(kind: str, stages: int, virtual: int, microbatches: int) -> Schedule:
    """The schedule table for `kind` with its buffer slots."""
    P, V, M = stages, virtual, microbatches
    check(kind, P, V, M)
    K = P * V
    ticks = simulate(stage_orders(kind, P, V, M), P, V, M)
    table = np.full((len(ticks), 2, P, len(FIELDS)), NO_SLOT, np.int32)
    table[..., COL["op"]] = IDLE
    bufs = {name: [_Slots() for _ in range(P)] for name in ("stash", "prologue", "fwd_in", "bwd_in")}
    where: dict = {}  # (buffer, m, k) -> slot holding that value
    for t, row in enumerate(ticks):
        arrivals = []
        for slot_i in (0, 1):  # the F slots, then the B slots
            for s, ops in enumerate(row):
                op = ops[slot_i]
                if op is None:
                    continue
                cell = table[t, slot_i, s]
                kind_, m, v = op
                k = v * P + s
                cell[COL["op"]], cell[COL["mb"]], cell[COL["virtual"]] = kind_, m, v
                if kind_ == FWD:
                    if k > 0:
                        cell[COL["fwd_in"]] = slot = where.pop(("fwd_in", m, k))
                        bufs["fwd_in"][s].free(slot)
                    cell[COL["stash"]] = where[("stash", m, k)] = bufs["stash"][s].take()
                    if k == 0:
                        cell[COL["prologue"]] = where[("prologue", m, k)] = bufs["prologue"][s].take()
                    if k == K - 1:
                        cell[COL["head_out"]] = where[("bwd_in", m, k)] = bufs["bwd_in"][s].take()
                    else:
                        arrivals.append(("fwd_in", (s + 1) % P, m, k + 1))
                else:
                    for name in ("bwd_in", "stash") + (("prologue",) if k == 0 else ()):
                        cell[COL[name]] = slot = where.pop((name, m, k))
                        bufs[name][s].free(slot)
                    if k > 0:
                        arrivals.append(("bwd_in", (s - 1) % P, m, k - 1))
        for name, s, m, k in arrivals:  # written at the end of the tick, after the reads
            slot = bufs[name][s].take()
            where[(name, m, k)] = slot
            table[t, 1, s, COL["recv_fwd" if name == "fwd_in" else "recv_bwd"]] = slot
    assert not where, where
    slots = {name: max(1, max(b.peak for b in per_stage)) for name, per_stage in bufs.items()}
    return Schedule(kind, P, V, M, table, slots)


def forward_only(stages: int, virtual: int, microbatches: int) -> Schedule:
    """Forwards only (evaluation): the gpipe forward half, no stash or backward."""
    P, V, M = stages, virtual, microbatches
    full = build("gpipe", P, V, M)
    last_fwd = int(np.max(np.nonzero((full.table[:, 0, :, COL["op"]] == FWD).any(axis=1))[0]))
    table = full.table[: last_fwd + 1].copy()
    table[:, 1, :, COL["op"]] = IDLE  # no backward slot
    for col in ("mb", "virtual", "stash", "prologue", "bwd_in"):
        table[:, 1, :, COL[col]] = NO_SLOT
    for col in ("stash", "prologue", "head_out", "recv_bwd"):
        table[..., COL[col]] = NO_SLOT
    return Schedule("forward", P, V, M, table, dict(full.slots))
