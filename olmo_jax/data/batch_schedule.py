"""Batch-size warmup: the global batch size of every step, as OLMo-core's
`BatchSizeSchedulerCallback` (olmo_core/train/callbacks/batch_size_scheduler.py) sets its
data loader's.

`trainer.batch_size_schedule` lists `TOKENS@START` events, e.g. "65536@0,131072@2e9":
from the first step at which `START` tokens have been trained on, the global batch holds
`TOKENS` tokens (OLMo-core's `batch_sizes` with a `schedule` of `Duration.tokens`). The
run's `trainer.global_batch_size` is the batch the base learning rate belongs to (OLMo-core's
data loader's configured size).

OLMo-core's rules, re-created by `BatchSizeSchedule`:
- the first event starts at 0, later ones strictly later; each size differs from the one
  before by an integer factor;
- before each batch is loaded (and once before the first), the latest event that is due
  (tokens seen >= START) sets the size. A smaller size applies at once; a larger one only
  when the batches already read are a whole number of the new batches (the loader's
  `batches_processed % ratio == 0`), so no instance is read twice or skipped: until then
  the current size stays;
- each change multiplies the learning rate the schedule starts from by
  sqrt(new / old), so at any step it is `optim.lr` x sqrt(B / trainer.global_batch_size)
  (`initial_lrs`: OLMo-core's factors applied one after another, in its order).

The batches are consecutive slices of the loader's stream (loader.py): the batch of step s
is stream positions [position(s), position(s) + size(s)), and the tokens seen before step
s are position(s) x seq_len. The sizes change at finitely many steps (`segments`), so
every per-step quantity is a lookup, whatever the run's length.

Where olmo_jax differs: OLMo-core counts `batches_processed` within an epoch (it restarts
at 0, dropping the epoch's last partial batch), olmo_jax's stream runs epoch after epoch
without a gap (loader.py), so the alignment of a pending increase is counted from the
run's start; the two agree in the first epoch. Sizes are checked once here to form a
divisibility chain with trainer.global_batch_size (any two divide one another), which
OLMo-core checks only between neighbours (its callback then asserts at run time when a
pending size is skipped to one that is no integer factor of the current).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np

from olmo_jax.errors import ConfigError

FIELD = "trainer.batch_size_schedule"
_EXAMPLE = "e.g. 4096@0,8192@1000000 (a global batch of TOKENS tokens from START tokens trained)"


def _count(text: str, what: str, spec: str) -> int:
    """An int written as 123, 1_000 or 2e9 (an exact integer)."""
    try:
        value = int(text) if "e" not in text.lower() else float(text)
    except ValueError:
        raise ConfigError(f"{FIELD}={spec!r}: {what} {text!r} is not a number; {_EXAMPLE}") from None
    if value != int(value):
        raise ConfigError(f"{FIELD}={spec!r}: {what} {text!r} is not a whole number of tokens")
    return int(value)


def parse(spec: str) -> list[tuple[int, int]]:
    """[(batch tokens, start tokens)] of a `TOKENS@START,...` spec ('' = []), in order."""
    events = []
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            continue
        if part.count("@") != 1:
            raise ConfigError(f"{FIELD}={spec!r}: {part!r} is not TOKENS@START; {_EXAMPLE}")
        size, start = part.split("@")
        events.append((_count(size.strip(), "batch size", spec), _count(start.strip(), "start", spec)))
    return events


@dataclass(frozen=True)
class Segments:
    """The steps at which the batch size changes: from step first_step[i] on (until the
    next), batches hold size[i] instances, the first at stream position first_position[i]."""
    first_step: np.ndarray  # int64[n], first_step[0] = 0
    size: np.ndarray  # int64[n], instances
    first_position: np.ndarray  # int64[n]


@dataclass(frozen=True)
class BatchSizeSchedule:
    """`events` [(batch tokens, start tokens)] over a run of `seq_len` whose configured
    batch (trainer.global_batch_size) is `reference` instances."""
    events: tuple[tuple[int, int], ...]
    seq_len: int
    reference: int

    @classmethod
    def from_spec(cls, spec: str, seq_len: int, reference: int) -> BatchSizeSchedule | None:
        """The checked schedule of a trainer.batch_size_schedule spec; None for ''."""
        events = parse(spec)
        if not events:
            return None
        schedule = cls(tuple(events), seq_len, reference)
        schedule.check(spec)
        return schedule

    def check(self, spec: str) -> None:
        """OLMo-core's __post_init__ rules, and what the instances need; ConfigError naming
        the field and the fix."""
        where = f"{FIELD}={spec!r}"
        if self.events[0][1] != 0:
            raise ConfigError(f"{where}: the batch size schedule must start at 0 (OLMo-core's rule); "
                              f"make the first event SIZE@0")
        for (size, start), (next_size, next_start) in zip(self.events, self.events[1:], strict=False):
            if next_start <= start:
                raise ConfigError(f"{where}: each event must start after the one before "
                                  f"({next_start} <= {start}); list them in increasing START")
            if next_size == size:
                raise ConfigError(f"{where}: duplicate batch size {size} in a row; drop the later event")
        for size, _ in self.events:
            if size < 1 or size % self.seq_len:
                raise ConfigError(f"{where}: batch size {size} tokens is not a positive multiple of "
                                  f"trainer.seq_len={self.seq_len}; use whole sequences")
        sizes = sorted({s // self.seq_len for s, _ in self.events} | {self.reference})
        for small, big in zip(sizes, sizes[1:], strict=False):
            if big % small:
                raise ConfigError(
                    f"{where}: batch sizes {small * self.seq_len} and {big * self.seq_len} tokens "
                    f"(with trainer.global_batch_size={self.reference} x seq_len) are not integer "
                    "multiples of one another; the loader changes size only by integer factors: "
                    "use sizes that double (or multiply) each time")

    @property
    def spec(self) -> str:
        """The canonical spec (what a checkpoint records)."""
        return ",".join(f"{size}@{start}" for size, start in self.events)

    @property
    def sizes(self) -> np.ndarray:
        """The distinct batch sizes (instances) the run's steps take, ascending."""
        return np.unique(self.segments.size)

    # ------------------------------------------------------------------ the steps
    @functools.cached_property
    def segments(self) -> Segments:
        return _segments(self.events, self.seq_len, self.reference)

    def _segment(self, step) -> np.ndarray:
        return np.searchsorted(self.segments.first_step, step, side="right") - 1

    def size(self, step: int) -> int:
        """Instances in step `step`'s batch (0-based steps)."""
        return int(self.segments.size[self._segment(step)])

    def position(self, step) -> np.ndarray | int:
        """The stream position of step `step`'s first instance (the instances read before
        it); vectorised over an array of steps."""
        seg = self.segments
        i = self._segment(step)
        out = seg.first_position[i] + (np.asarray(step) - seg.first_step[i]) * seg.size[i]
        return int(out) if np.ndim(out) == 0 else out

    def tokens_before(self, step) -> np.ndarray | int:
        """Tokens trained on in steps 0 .. step - 1."""
        out = np.asarray(self.position(step)) * self.seq_len
        return int(out) if np.ndim(out) == 0 else out

    def steps_for_tokens(self, tokens: int) -> int:
        """The steps a run of `tokens` takes: the first step count whose tokens reach it
        (OLMo-core ends a token-duration run once tokens seen >= max_tokens)."""
        seg = self.segments
        target = -(-tokens // self.seq_len)  # instances
        i = int(np.searchsorted(seg.first_position, target, side="right")) - 1
        return int(seg.first_step[i] + -(-(target - seg.first_position[i]) // seg.size[i]))

    def step_sizes(self, steps: int) -> np.ndarray:
        """int64[steps]: instances in each of steps 0 .. steps - 1."""
        return self.segments.size[self._segment(np.arange(steps))]

    def initial_lrs(self, lr: float, steps: int) -> np.ndarray:
        """float64[steps]: the learning rate a schedule starts from at each step, `lr` at
        trainer.global_batch_size: OLMo-core's callback multiplies it by sqrt(new / old) at
        each change (in tokens), in that order, in float64."""
        current, values = self.reference * self.seq_len, []
        for size in self.segments.size:
            new = int(size) * self.seq_len
            lr *= math.sqrt(new / current)
            current = new
            values.append(lr)
        return np.asarray(values, np.float64)[self._segment(np.arange(steps))]

    def describe(self) -> str:
        """One banner line: the sizes and the steps at which they start."""
        seg = self.segments
        parts = [f"{int(s) * self.seq_len:,} tokens ({int(s)} x {self.seq_len}) from step {int(k) + 1:,}"
                 for k, s in zip(seg.first_step, seg.size, strict=True)]
        return (f"batch size schedule ({FIELD}): " + ", ".join(parts)
                + f"; lr x sqrt(batch / {self.reference * self.seq_len:,} tokens)")


def _segments(events, seq_len: int, reference: int) -> Segments:
    """OLMo-core's callback, event by event: before each step the latest due event's size
    applies (a larger one once the position is a multiple of it). Jumps from one step where
    something can change to the next, so its cost is the number of events, not of steps."""
    starts = [-(-start // seq_len) for _, start in events]  # due once position >= this
    targets = [size // seq_len for size, _ in events]
    step, position, current = 0, 0, reference
    first_step, size, first_position = [], [], []
    while True:
        due = max(i for i, s in enumerate(starts) if position >= s)
        target = targets[due]
        if target != current and (target < current or position % target == 0):
            current = target
            first_step.append(step), size.append(current), first_position.append(position)
        if not first_step:  # the reference size until the first event applies
            first_step.append(0), size.append(current), first_position.append(0)
        waits = []
        if due + 1 < len(starts):  # the steps until the next event is due
            waits.append(-(-(starts[due + 1] - position) // current))
        if target > current:  # a pending increase: the steps until the position aligns
            waits.append((-position % target) // current)
        if not waits:
            break
        n = min(waits)
        step, position = step + n, position + n * current
    return Segments(np.asarray(first_step, np.int64), np.asarray(size, np.int64),
                    np.asarray(first_position, np.int64))
