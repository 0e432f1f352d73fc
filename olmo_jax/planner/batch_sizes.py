"""The run's steps by batch size: with `trainer.batch_size_schedule` the run's steps take
several batch sizes (OLMo-core's batch-size warmup), each its own compiled program (the
microbatch is kept, so a larger batch accumulates more microbatches: another trip count of
the accumulation loop, and with one microbatch no loop and no float32 gradient sums at
all). `run_sizes` lists the sizes the run's `trainer.total_steps` take, with their steps;
`RunPlan` holds a planner/plan_build.py `Plan` per size (each compiled at that size, its
step time and memory its own program's), checks each against the memory per device
(`Plan.memory_limit`) and sums the run's projected time over its steps. Without a schedule it
holds the one size. planner/plan_text.py renders it.
"""

from __future__ import annotations

import dataclasses

from olmo_jax.data.batch_schedule import FIELD
from olmo_jax.planner.plan_build import Plan
from olmo_jax.trainer.config import TrainerConfig

OVERLAPS = ("none", "scheduled", "full")  # roofline.Projection's three step times


@dataclasses.dataclass(frozen=True)
class RunSize:
    """One batch size of the run: `size` sequences, from 0-based step `first_step`, for
    `steps` of the run's steps (not necessarily consecutive: a schedule may return to it)."""
    size: int
    steps: int
    first_step: int


def run_sizes(t: TrainerConfig) -> list[RunSize]:
    """The batch sizes the run's trainer.total_steps take, ascending (the schedule's
    sizes that start after the run's end are left out); the one size without a schedule."""
    schedule, total = t.batch_schedule, t.total_steps
    if schedule is None:
        return [RunSize(t.global_batch_size, total, 0)]
    seg = schedule.segments
    ends = [*(int(s) for s in seg.first_step[1:]), total]
    by_size: dict[int, RunSize] = {}
    for first, end, size in zip(seg.first_step, ends, seg.size, strict=True):
        first, size = int(first), int(size)
        if first >= total:
            break
        steps = min(end, total) - first
        prev = by_size.get(size)
        by_size[size] = (RunSize(size, prev.steps + steps, prev.first_step) if prev
                         else RunSize(size, steps, first))
    return [by_size[s] for s in sorted(by_size)]


@dataclasses.dataclass
class SizePlan:
    run: RunSize
    plan: Plan  # the step compiled at run.size

    @property
    def grad_accum(self) -> int:
        return self.plan.step.grad_accum

    @property
    def tokens_per_step(self) -> int:
        return self.plan.step.tokens_per_step

    def step_s(self, overlap: str = "none") -> float:
        p = self.plan.projection
        return {"none": p.step_s, "scheduled": p.scheduled_s, "full": p.overlapped_s}[overlap]

    def to_json(self) -> dict:
        p, peak = self.plan.projection, self.plan.counted_peak_bytes
        return {
            "batch_size": self.run.size, "tokens_per_step": self.tokens_per_step,
            "grad_accum": self.grad_accum, "steps": self.run.steps,
            "first_step": self.run.first_step,
            "step_s": p.step_s, "scheduled_s": p.scheduled_s, "overlapped_s": p.overlapped_s,
            "tokens_per_s_per_device": p.tokens_per_s(),
            "tokens_per_s_per_device_scheduled": p.tokens_per_s(overlap="scheduled"),
            "tokens_per_s_per_device_overlapped": p.tokens_per_s(True),
            "mfu": p.mfu(), "mfu_scheduled": p.mfu(overlap="scheduled"),
            "peak_bytes": self.plan.peak_bytes, "peak_bytes_counted": peak,
            "allocated_bytes": self.plan.allocated_bytes,
            "fits": self.plan.fits,
            "lower_s": self.plan.step.lower_s, "compile_s": self.plan.step.compile_s,
        }


@dataclasses.dataclass
class RunPlan:
    trainer: TrainerConfig
    sizes: list[SizePlan]  # ascending batch size
    limit_bytes: float  # memory per device each step must fit (0: unknown)
    limit_source: str

    @property
    def scheduled(self) -> bool:
        return self.trainer.batch_schedule is not None

    @property
    def largest(self) -> SizePlan:
        return self.sizes[-1]

    @property
    def steps(self) -> int:
        return sum(s.run.steps for s in self.sizes)

    @property
    def tokens(self) -> int:
        return sum(s.run.steps * s.tokens_per_step for s in self.sizes)

    def time_s(self, overlap: str = "none") -> float:
        """The run's projected time: each size's step time x its steps."""
        return sum(s.run.steps * s.step_s(overlap) for s in self.sizes)

    def unfit(self) -> list[SizePlan]:
        """The sizes whose step's peak (as plan_build counts it) exceeds the limit."""
        return [s for s in self.sizes if s.plan.fits is False]

    @property
    def errors(self) -> list[str]:
        """With a schedule, each size whose step does not fit, named with the field that
        sets it (a plan of one size says so in its memory section)."""
        if not self.scheduled:
            return []
        return [f"the step at {FIELD}'s batch of {s.run.size} sequences ({s.tokens_per_step:,} "
                f"tokens, {s.grad_accum} microbatches, from step {s.run.first_step + 1:,}) "
                f"needs {s.plan.counted_peak_bytes / 1e9:,.2f} GB per device at its peak: it "
                f"does NOT fit the {self.limit_bytes / 1e9:,.2f} GB of {self.limit_source}; "
                f"lower that size in {FIELD} or the microbatch (a larger trainer.grad_accum)"
                for s in self.unfit()]

    def to_json(self) -> dict:
        t = self.trainer
        return {
            "batch_size_schedule": t.batch_schedule.spec if self.scheduled else "",
            "sizes": [s.to_json() for s in self.sizes],
            "memory_limit_bytes": self.limit_bytes, "memory_limit_source": self.limit_source,
            "steps": self.steps, "tokens": self.tokens, "binds": t.binds,
            "time_s": self.time_s(), "time_s_scheduled": self.time_s("scheduled"),
            "time_s_overlapped": self.time_s("full"), "errors": self.errors,
        }


def build(trainer: TrainerConfig, plans: dict[int, Plan]) -> RunPlan:
    """The run plan from `plans` {batch size: its Plan}, one per size of run_sizes."""
    limit, source = plans[max(plans)].memory_limit  # the run's: every size's is the same
    return RunPlan(trainer, [SizePlan(r, plans[r.size]) for r in run_sizes(trainer)], limit,
                   source)
