"""OLMo-core's learning-rate schedulers (`olmo_core/optim/scheduler.py`, OLMo-core 3.0),
re-implemented in plain Python floats, and the run's schedule built from them.

`optim.scheduler` names one of them the way OLMo-core's Python does, e.g.

    cos_with_warmup(warmup=2000, alpha_f=0.1)
    wsd(warmup=1000, decay_fraction=0.2, units="tokens")
    sequential(schedulers=[constant_with_warmup(warmup=100), cos_with_warmup(warmup=0)],
               schedulers_max=[5000])
    composable(stages=[stage(duration=100, start_lr=0.0, end_lr_fraction=1.0),
                       stage(duration=900, shape="cosine", end_lr_fraction=0.1)])

(`parse`: a call of a registered name with keyword arguments that are literals, lists or
further calls; `stage(...)` and `override_decay(...)` build ComposableSchedulerStage and
OverrideDecay). The names are OLMo-core's registry names (SCHEDULERS); the fields, their
defaults, the validation messages and `get_lr(initial_lr, current, t_max)` are OLMo-core's.
`units` is OLMo-core's SchedulerUnits: "steps" (current = the step, t_max = the run's
steps) or "tokens" (current = the tokens trained on including this step's batch, t_max =
the run's tokens).

The run applies OLMo-core's value at every step: OLMo-core's step k (1-based: its trainer
counts the step before it sets the learning rate) uses get_lr(lr, k, max_steps) (or the
tokens seen after step k's batch, of max_tokens); `lr_table` evaluates that in float64 for
every step of the run on the host, and `table_schedule` is the optax schedule that reads
it (rounded to float32, the precision the update is computed in) at the optimizer's step
count. An optax schedule traced in float32 would differ from OLMo-core's float64
arithmetic by ~1e-7 relative; the table is exact.
"""

from __future__ import annotations

import ast
import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import jax.numpy as jnp
import numpy as np

from olmo_jax.errors import ConfigError

FIELD = "optim.scheduler"
UNITS = ("steps", "tokens")  # OLMo-core's SchedulerUnits
SHAPES = ("linear", "cosine")  # OLMo-core's ComposableSchedulerStageType


def _err(msg: str) -> ConfigError:
    return ConfigError(f"{FIELD}: {msg}")


# ----------------------------------------------------------------------------- helpers


def _linear_warmup(initial_lr: float, current: int, warmup: int, warmup_min_lr: float = 0.0) -> float:
    if not 0 <= warmup_min_lr < initial_lr:
        raise _err(f"warmup_min_lr={warmup_min_lr} must be >= 0 and below the learning rate "
                   f"it warms up to ({initial_lr}); lower warmup_min_lr")
    return warmup_min_lr + (initial_lr - warmup_min_lr) * min(current, warmup) / warmup


def _linear_decay(initial_lr: float, step_from_end: int, decay: int, decay_min_lr: float = 0.0) -> float:
    if not 0 <= decay_min_lr < initial_lr:
        raise _err(f"decay_min_lr={decay_min_lr} must be >= 0 and below the learning rate it "
                   f"decays from ({initial_lr}); lower decay_min_lr")
    return decay_min_lr + (initial_lr - decay_min_lr) * min(step_from_end, decay) / decay


def _resolve_lr_from_initial(initial_lr: float, value: float | None, fraction: float | None) -> float:
    if value is not None:
        return value
    assert fraction is not None
    return initial_lr * fraction


def _interpolate_lr(shape: str, start_lr: float, end_lr: float, current: int, duration: int) -> float:
    if shape == "linear":
        return start_lr + (end_lr - start_lr) * current / duration
    return end_lr + (start_lr - end_lr) * (1 + math.cos(math.pi * current / duration)) / 2


def _check_warmup(s, quoted: bool = False) -> None:
    """OLMo-core's warmup checks (its classes word the range message two ways)."""
    if (s.warmup_fraction is None) == (s.warmup is None):
        raise _err("Either 'warmup_fraction' or 'warmup' must be specified.")
    if s.warmup_fraction is not None and not 0 <= s.warmup_fraction <= 1:
        name = "'warmup_fraction'" if quoted else "warmup_fraction"
        raise _err(f"{name} must be between 0 and 1.")


def _check_decay(s, quoted: bool = True, never_both: bool = True) -> None:
    if (s.decay_fraction is None) == (s.decay is None):
        raise _err("Either 'decay_fraction' or 'decay' must be specified."
                   + (" Never both." if never_both else ""))
    if s.decay_fraction is not None and not 0 <= s.decay_fraction <= 1:
        name = "'decay_fraction'" if quoted else "decay_fraction"
        raise _err(f"{name} must be between 0 and 1.")


def _warmup_of(s, t_max: int) -> int:
    return s.warmup if s.warmup is not None else round(t_max * s.warmup_fraction)


def _decay_of(s, t_max: int) -> int:
    return s.decay if s.decay is not None else round(t_max * s.decay_fraction)


# ----------------------------------------------------------------------------- schedulers


def fixed_phases(s, t_max: int) -> dict[str, int]:
    """The warmup and decay lengths scheduler `s` takes from a run of `t_max` (its units),
    for the check that they fit in the run (config.check_training); a sequential or
    composed schedule's own phases are not summed (empty)."""
    phases = {}
    if getattr(s, "warmup", None) is not None or getattr(s, "warmup_fraction", None) is not None:
        phases["warmup"] = _warmup_of(s, t_max)
    if getattr(s, "decay", None) is not None or getattr(s, "decay_fraction", None) is not None:
        phases["decay"] = _decay_of(s, t_max)
    return phases


@dataclass
class Scheduler:
    units: str = "steps"

    def check(self) -> None:
        if self.units not in UNITS:
            raise _err(f"units={self.units!r}: choose one of {', '.join(UNITS)}")

    def get_lr(self, initial_lr: float, current: int, t_max: int) -> float:
        raise NotImplementedError


@dataclass
class ConstantScheduler(Scheduler):
    def get_lr(self, initial_lr, current, t_max):
        return initial_lr


@dataclass
class ConstantWithWarmup(Scheduler):
    warmup: int | None = None
    warmup_fraction: float | None = None
    warmup_min_lr: float = 0.0

    def check(self):
        super().check()
        _check_warmup(self, quoted=True)

    def get_lr(self, initial_lr, current, t_max):
        warmup = _warmup_of(self, t_max)
        if current <= warmup:
            return _linear_warmup(initial_lr, current, warmup, self.warmup_min_lr)
        return initial_lr


@dataclass
class WSD(Scheduler):
    warmup: int | None = None
    warmup_fraction: float | None = None
    decay: int | None = None
    decay_fraction: float | None = 0.1
    warmup_min_lr: float = 0.0
    decay_min_lr: float = 0.0

    def check(self):
        super().check()
        _check_warmup(self)
        _check_decay(self, quoted=False)

    def get_lr(self, initial_lr, current, t_max):
        warmup = _warmup_of(self, t_max)
        if current <= warmup:
            return _linear_warmup(initial_lr, current, warmup, self.warmup_min_lr)
        decay = _decay_of(self, t_max)
        if current >= t_max - decay:
            return _linear_decay(initial_lr, t_max - current, decay, self.decay_min_lr)
        return initial_lr


@dataclass
class PowerLR(Scheduler):
    b: float = -0.51
    warmup: int | None = None
    warmup_fraction: float | None = None
    warmup_min_lr: float = 0.0
    decay: int | None = None
    decay_fraction: float | None = 0.1
    decay_min_lr: float = 0.0

    def check(self):
        super().check()
        _check_warmup(self, quoted=True)
        _check_decay(self)
        if self.b >= 0:
            raise _err("'b' must be negative for a decaying power-law.")

    def get_lr(self, initial_lr, current, t_max):
        warmup, decay = _warmup_of(self, t_max), _decay_of(self, t_max)
        if current <= warmup:
            return _linear_warmup(initial_lr, current, warmup, self.warmup_min_lr)
        if current >= t_max - decay:
            lr_start_tail = initial_lr * ((t_max - decay) / warmup) ** self.b
            return _linear_decay(lr_start_tail, t_max - current, decay, self.decay_min_lr)
        return initial_lr * (current / warmup) ** self.b


@dataclass
class LinearWithWarmup(Scheduler):
    alpha_f: float = 0.1
    t_max: int | None = None
    warmup: int | None = None
    warmup_fraction: float | None = None
    warmup_min_lr: float = 0.0

    def check(self):
        super().check()
        _check_warmup(self)

    def get_lr(self, initial_lr, current, t_max):
        t_max = t_max if self.t_max is None else self.t_max
        eta_min = initial_lr * self.alpha_f
        warmup = _warmup_of(self, t_max)
        if current < warmup:
            return _linear_warmup(initial_lr, current, warmup, self.warmup_min_lr)
        if current >= t_max:
            return eta_min
        return initial_lr - (initial_lr - eta_min) * ((current - warmup) / (t_max - warmup))


@dataclass
class InvSqrtWithWarmup(Scheduler):
    alpha_f: float = 0.1
    warmup: int | None = None
    warmup_fraction: float | None = None
    warmup_min_lr: float = 0.0

    def check(self):
        super().check()
        _check_warmup(self)

    def get_lr(self, initial_lr, current, t_max):
        warmup = _warmup_of(self, t_max)
        if current < warmup:
            return _linear_warmup(initial_lr, current, warmup, self.warmup_min_lr)
        eta_min = initial_lr * self.alpha_f
        return eta_min + (initial_lr - eta_min) * math.sqrt(warmup / current)


@dataclass
class CosWithWarmup(Scheduler):
    warmup: int | None = None
    warmup_fraction: float | None = None
    alpha_f: float = 0.1
    t_max: int | None = None
    warmup_min_lr: float = 0.0

    def check(self):
        super().check()
        _check_warmup(self)

    def get_lr(self, initial_lr, current, t_max):
        t_max = t_max if self.t_max is None else self.t_max
        eta_min = initial_lr * self.alpha_f
        warmup = _warmup_of(self, t_max)
        if current < warmup:
            return _linear_warmup(initial_lr, current, warmup, self.warmup_min_lr)
        if current >= t_max:
            return eta_min
        current, t_max = current - warmup, t_max - warmup
        return eta_min + (initial_lr - eta_min) * (1 + math.cos(math.pi * current / t_max)) / 2


@dataclass
class HalfCosWithWarmup(CosWithWarmup):
    def get_lr(self, initial_lr, current, t_max):
        t_max = t_max if self.t_max is None else self.t_max
        eta_min = initial_lr * self.alpha_f
        warmup = _warmup_of(self, t_max)
        if current < warmup:
            max_lr = eta_min + (initial_lr - eta_min) / 2
            return _linear_warmup(max_lr, current, warmup, self.warmup_min_lr)
        if current >= t_max:
            return eta_min
        current, t_max = current - warmup, t_max - warmup
        current += t_max
        t_max *= 2
        return eta_min + (initial_lr - eta_min) * (1 + math.cos(math.pi * current / t_max)) / 2


@dataclass
class CosWithWarmupAndLinearDecay(CosWithWarmup):
    decay: int | None = None
    decay_fraction: float | None = 0.1
    decay_min_lr: float = 0.0

    def check(self):
        super().check()
        _check_decay(self, never_both=False)

    def get_lr(self, initial_lr, current, t_max):
        decay = _decay_of(self, t_max)
        if current >= t_max - decay:
            final_cosine_lr = super().get_lr(initial_lr, t_max - decay, t_max)
            return _linear_decay(final_cosine_lr, t_max - current, decay, self.decay_min_lr)
        return super().get_lr(initial_lr, current, t_max)


@dataclass
class ComposableSchedulerStage:
    duration: int = 0
    shape: str = "linear"
    start_lr: float | None = None
    start_lr_fraction: float | None = None
    end_lr: float | None = None
    end_lr_fraction: float | None = None

    def check(self):
        if self.shape not in SHAPES:
            raise _err(f"stage shape={self.shape!r}: choose one of {', '.join(SHAPES)}")
        if self.duration <= 0:
            raise _err("'duration' must be > 0 for every stage.")
        if self.start_lr is not None and self.start_lr_fraction is not None:
            raise _err("Specify at most one of 'start_lr' or 'start_lr_fraction' for a stage.")
        for name in ("start_lr", "start_lr_fraction", "end_lr", "end_lr_fraction"):
            if getattr(self, name) is not None and getattr(self, name) < 0:
                raise _err(f"'{name}' must be >= 0.")
        if (self.end_lr is None) == (self.end_lr_fraction is None):
            raise _err("Specify exactly one of 'end_lr' or 'end_lr_fraction' for each stage.")


@dataclass
class OverrideDecay:
    start: int = -1
    duration: int = 0
    shape: str = "linear"
    end_lr: float | None = None
    end_lr_fraction: float | None = None

    def check(self):
        if self.shape not in SHAPES:
            raise _err(f"override_decay shape={self.shape!r}: choose one of {', '.join(SHAPES)}")
        if self.start < 0:
            raise _err("'start' must be >= 0 for override decay.")
        if self.duration <= 0:
            raise _err("'duration' must be > 0 for override decay.")
        if (self.end_lr is None) == (self.end_lr_fraction is None):
            raise _err("Specify exactly one of 'end_lr' or 'end_lr_fraction' for override decay.")
        for name in ("end_lr", "end_lr_fraction"):
            if getattr(self, name) is not None and getattr(self, name) < 0:
                raise _err(f"'{name}' must be >= 0 for override decay.")

    def apply(self, main_lr, initial_lr: float, current: int) -> float:
        """The LR from `start` on: `main_lr(start)` decaying to the end LR over `duration`."""
        start_lr = main_lr(self.start)
        end_lr = _resolve_lr_from_initial(initial_lr, self.end_lr, self.end_lr_fraction)
        if current - self.start < self.duration:
            return _interpolate_lr(self.shape, start_lr, end_lr, current - self.start, self.duration)
        return end_lr


@dataclass
class ComposableScheduler(Scheduler):
    stages: list = field(default_factory=list)
    override_decay: OverrideDecay | None = None

    def check(self):
        super().check()
        if not self.stages:
            raise _err("'stages' must be specified and non-empty.")
        for stage in self.stages:
            if not isinstance(stage, ComposableSchedulerStage):
                raise _err("composable(stages=[...]) takes stage(duration=..., ...) entries")
            stage.check()
        _check_override(self.override_decay)

    def _main_schedule_lr(self, initial_lr, current):
        current = max(current, 0)
        stage_start, previous_end_lr = 0, initial_lr
        for stage in self.stages:
            if stage.start_lr is None and stage.start_lr_fraction is None:
                start_lr = previous_end_lr
            else:
                start_lr = _resolve_lr_from_initial(initial_lr, stage.start_lr, stage.start_lr_fraction)
            end_lr = _resolve_lr_from_initial(initial_lr, stage.end_lr, stage.end_lr_fraction)
            stage_end = stage_start + stage.duration
            if current < stage_end:
                return _interpolate_lr(stage.shape, start_lr, end_lr, current - stage_start,
                                       stage.duration)
            previous_end_lr, stage_start = end_lr, stage_end
        return previous_end_lr

    def get_lr(self, initial_lr, current, t_max):
        current = max(current, 0)
        if self.override_decay is None or current < self.override_decay.start:
            return self._main_schedule_lr(initial_lr, current)
        return self.override_decay.apply(lambda c: self._main_schedule_lr(initial_lr, c),
                                         initial_lr, current)


def _check_override(override) -> None:
    if override is None:
        return
    if not isinstance(override, OverrideDecay):
        raise _err("override_decay= takes override_decay(start=..., duration=..., ...)")
    override.check()


@dataclass
class SequentialScheduler(Scheduler):
    schedulers: list = field(default_factory=list)
    schedulers_max: list | None = None
    override_decay: OverrideDecay | None = None

    def check(self):
        super().check()
        if not self.schedulers:
            raise _err("sequential(schedulers=[...]) needs at least one scheduler")
        for s in self.schedulers:
            if not isinstance(s, Scheduler):
                raise _err("sequential(schedulers=[...]) takes schedulers, e.g. cos_with_warmup(warmup=0)")
            s.check()
        if self.schedulers_max is None:
            raise _err("'schedulers_max' must be specified")
        if len(self.schedulers_max) == len(self.schedulers):  # the last one runs to the end
            self.schedulers_max = list(self.schedulers_max[:-1])
        if len(self.schedulers_max) + 1 != len(self.schedulers):
            raise _err("Max steps must be set for all schedulers except the last when using "
                       "'SequentialScheduler'")
        _check_override(self.override_decay)

    def _sequential_lr(self, initial_lr, current, t_max):
        for scheduler, scheduler_max in zip(self.schedulers[:-1], self.schedulers_max, strict=True):
            if current <= scheduler_max:
                return scheduler.get_lr(initial_lr, current, min(t_max, scheduler_max))
            # The next scheduler starts from this one's final LR.
            initial_lr = scheduler.get_lr(initial_lr, scheduler_max, scheduler_max)
            current -= scheduler_max
            t_max -= scheduler_max
        if t_max <= 0:
            raise _err(f"the run ends before the last scheduler starts (schedulers_max="
                       f"{self.schedulers_max}); lengthen the run or shorten schedulers_max")
        return self.schedulers[-1].get_lr(initial_lr, current, t_max)

    def get_lr(self, initial_lr, current, t_max):
        if self.override_decay is None or current < self.override_decay.start:
            return self._sequential_lr(initial_lr, current, t_max)
        return self.override_decay.apply(lambda c: self._sequential_lr(initial_lr, c, t_max),
                                         initial_lr, current)


@dataclass
class WSDS(Scheduler):
    period_lengths: list = field(default_factory=list)
    period_lr_multipliers: list | None = None
    warmup: int | None = None
    warmup_fraction: float | None = None
    decay: int | None = None
    decay_fraction: float | None = None
    warmup_min_lr: float = 0.0
    decay_min_lr: float = 0.0

    def check(self):
        super().check()
        if not self.period_lengths:
            raise _err("'period_lengths' must be provided and non-empty.")
        if any(p <= 0 for p in self.period_lengths):
            raise _err("All entries in 'period_lengths' must be > 0.")
        if self.period_lr_multipliers is not None:
            if len(self.period_lr_multipliers) != len(self.period_lengths):
                raise _err("'period_lr_multipliers' length must match 'period_lengths' length.")
            if any(m <= 0.0 for m in self.period_lr_multipliers):
                raise _err("All entries in 'period_lr_multipliers' must be > 0.")
        if (self.warmup is None) == (self.warmup_fraction is None):
            raise _err("Exactly one of 'warmup' or 'warmup_fraction' must be specified.")
        if self.warmup_fraction is not None and not 0.0 <= self.warmup_fraction <= 1.0:
            raise _err("'warmup_fraction' must be in [0, 1].")
        if (self.decay is None) == (self.decay_fraction is None):
            raise _err("Exactly one of 'decay' or 'decay_fraction' must be specified.")
        if self.decay_fraction is not None and not 0.0 <= self.decay_fraction <= 1.0:
            raise _err("'decay_fraction' must be in [0, 1].")
        if self.decay_min_lr < 0.0:
            raise _err("'decay_min_lr' must be >= 0.")
        L0 = self.period_lengths[0]
        w = int(self.warmup) if self.warmup is not None else int(round(self.warmup_fraction * L0))
        D0 = self._resolve_decay(L0)
        if w + D0 > L0:
            raise _err(f"First period: warmup ({w}) + decay ({D0}) = {w + D0} exceeds period "
                       f"length ({L0}).")
        for i, Li in enumerate(self.period_lengths[1:], start=1):
            if self._resolve_decay(Li) > Li:
                raise _err(f"Period {i}: decay ({self._resolve_decay(Li)}) exceeds period length ({Li}).")

    def _resolve_decay(self, Li: int) -> int:
        return int(self.decay) if self.decay is not None else int(round(self.decay_fraction * Li))

    def get_lr(self, initial_lr, current, t_max):
        L = self.period_lengths
        w = int(self.warmup) if self.warmup is not None else int(round(self.warmup_fraction * L[0]))
        adjusted = [L[0] - w] + list(L[1:])
        cum_end = np.cumsum(adjusted).tolist()

        def peak(pidx):
            m = self.period_lr_multipliers
            return initial_lr if m is None else initial_lr * m[pidx]

        if current < w:
            return _linear_warmup(peak(0), current, w, self.warmup_min_lr)
        x = current - w
        if x >= cum_end[-1]:
            return self.decay_min_lr
        pidx = next((i for i, end in enumerate(cum_end) if x <= end), len(cum_end) - 1)
        start = 0 if pidx == 0 else cum_end[pidx - 1]
        Li = adjusted[pidx]
        pos = min(max(x - start, 0), Li)
        D = self._resolve_decay(L[pidx])
        if pos < Li - D:
            return peak(pidx)
        return _linear_decay(peak(pidx), D - (pos - (Li - D)), D, self.decay_min_lr)


@dataclass
class ExponentialScheduler(Scheduler):
    lr_min: float = 1e-9

    def check(self):
        super().check()
        if self.lr_min <= 0:
            raise _err("'lr_min' must be positive.")

    def get_lr(self, initial_lr, current, t_max):
        if current >= t_max:
            return initial_lr
        if current == 0:
            return self.lr_min
        return self.lr_min * (initial_lr / self.lr_min) ** (current / t_max)


# OLMo-core's registry names (Scheduler.register), and the two building blocks.
SCHEDULERS = {
    "constant": ConstantScheduler,
    "constant_with_warmup": ConstantWithWarmup,
    "linear_with_warmup": LinearWithWarmup,
    "inv_sqrt_with_warmup": InvSqrtWithWarmup,
    "cos_with_warmup": CosWithWarmup,
    "half_cos_with_warmup": HalfCosWithWarmup,
    "cos_with_warmup_and_linear_decay": CosWithWarmupAndLinearDecay,
    "wsd": WSD,
    "wsds": WSDS,
    "power_lr": PowerLR,
    "exponential": ExponentialScheduler,
    "sequential": SequentialScheduler,
    "composable": ComposableScheduler,
}
_PARTS = {"stage": ComposableSchedulerStage, "override_decay": OverrideDecay}


# ----------------------------------------------------------------------------- parsing


def _build(node: ast.AST, spec: str):
    if isinstance(node, ast.Name) and (node.id in SCHEDULERS or node.id in _PARTS):  # defaults
        node = ast.Call(func=node, args=[], keywords=[])
    if isinstance(node, ast.Call):
        name = node.func.id if isinstance(node.func, ast.Name) else None
        cls = SCHEDULERS.get(name) or _PARTS.get(name)
        if cls is None:
            raise _err(f"{spec!r}: unknown scheduler {name!r}; choose one of "
                       f"{', '.join(SCHEDULERS)} (and stage(...), override_decay(...) inside them)")
        if node.args:
            raise _err(f"{spec!r}: {name}(...) takes keyword arguments only, e.g. {name}(warmup=100)")
        known = {f.name for f in dataclasses.fields(cls)}
        kwargs = {}
        for kw in node.keywords:
            if kw.arg not in known:
                raise _err(f"{spec!r}: {name} has no field {kw.arg!r}; its fields: "
                           f"{', '.join(sorted(known))}")
            kwargs[kw.arg] = _build(kw.value, spec)
        return cls(**kwargs)
    if isinstance(node, ast.List | ast.Tuple):
        return [_build(x, spec) for x in node.elts]
    try:
        return ast.literal_eval(node)
    except ValueError:
        raise _err(f"{spec!r}: {ast.unparse(node)!r} is not a literal, list or scheduler call") from None


def parse(spec: str) -> Scheduler:
    """The scheduler of an `optim.scheduler` spec (module docstring), checked as OLMo-core's
    __post_init__ checks it; ConfigError naming the field otherwise."""
    try:
        tree = ast.parse(spec.strip(), mode="eval")
    except SyntaxError:
        raise _err(f"{spec!r} is not a scheduler call, e.g. cos_with_warmup(warmup=2000)") from None
    sched = _build(tree.body, spec)
    if not isinstance(sched, Scheduler):
        raise _err(f"{spec!r}: the top level must be a scheduler ({', '.join(SCHEDULERS)})")
    sched.check()
    return sched


# ----------------------------------------------------------------------------- the run


def current_and_t_max(units: str, step: int, total_steps: int, tokens_per_step: int,
                      max_tokens: int = 0) -> tuple[int, int]:
    """OLMo-core's (current, t_max) at the run's 0-based optimizer step `step`: its trainer
    counts step `step + 1` (and the tokens of its batch) before it sets the learning rate.
    max_tokens: the run's token budget (0 = total_steps * tokens_per_step)."""
    if units == "steps":
        return step + 1, total_steps
    return (step + 1) * tokens_per_step, max_tokens or total_steps * tokens_per_step


@dataclass(frozen=True)
class StepBatches:
    """A run whose batch size changes (trainer.batch_size_schedule) as the schedule sees
    it: `tokens`, int64[total_steps], the tokens of each step's batch, and
    `initial_lrs(lr)`, float64[total_steps], the learning rate the schedule starts from at
    each step (OLMo-core's BatchSizeSchedulerCallback rescales it at each change)."""
    tokens: np.ndarray
    initial_lrs: Callable[[float], np.ndarray]


def _varying_current_and_t_max(units: str, tokens_S: np.ndarray, max_tokens: int):
    """(current, t_max) per step as OLMo-core's trainer has them when the batch size
    changes: after step k, T_k tokens seen and a batch of B_k tokens; a run of N steps
    (max_tokens = 0) has max_tokens T_k + (N - k) B_k, a run of max_tokens M has max_steps
    k + ceil((M - T_k) / B_k) (Trainer._get_max_steps / _get_max_tokens, with the current
    batch size)."""
    n = len(tokens_S)
    k = np.arange(1, n + 1)
    seen = np.cumsum(tokens_S)
    if units == "steps":
        if not max_tokens:
            return [(int(x), n) for x in k]
        return [(int(x), int(x) + -(-max(max_tokens - int(t), 0) // int(b)))
                for x, t, b in zip(k, seen, tokens_S, strict=True)]
    if max_tokens:
        return [(int(t), max_tokens) for t in seen]
    return [(int(t), int(t) + (n - int(x)) * int(b)) for x, t, b in zip(k, seen, tokens_S, strict=True)]


def lr_table(sched: Scheduler, lr: float, total_steps: int, tokens_per_step: int,
             max_tokens: int = 0, batches: StepBatches | None = None) -> np.ndarray:
    """float64[total_steps]: the learning rate OLMo-core applies at each optimizer step.
    With `batches` (a batch-size schedule), max_tokens is the budget only when it ends the
    run (0: the run is max_steps long)."""
    if batches is not None:
        pairs = _varying_current_and_t_max(sched.units, batches.tokens, max_tokens)
        return np.array([sched.get_lr(float(initial), current, t_max) for initial, (current, t_max)
                         in zip(batches.initial_lrs(lr), pairs, strict=True)], np.float64)
    if sched.units == "tokens" and tokens_per_step < 1:
        raise _err("units='tokens' needs the run's tokens per step")
    return np.array([sched.get_lr(lr, *current_and_t_max(sched.units, s, total_steps,
                                                         tokens_per_step, max_tokens))
                     for s in range(total_steps)], np.float64)


def keeps_t_max(sched: Scheduler) -> bool:
    """Whether `sched` keeps its end point when OLMo-core's max_steps moves with the batch
    size (BatchSizeSchedulerCallback.post_attach): a constant or WSD scheduler, one with
    its own t_max, or one counted in tokens."""
    return (isinstance(sched, ConstantScheduler | WSD) or getattr(sched, "t_max", None) is not None
            or sched.units == "tokens")


def table_schedule(table: np.ndarray):
    """The optax schedule reading `table` (as float32) at the optimizer's step count; a step
    past its end reads the last entry."""
    values = np.asarray(table, np.float32)

    def schedule(count):
        return jnp.asarray(values)[jnp.clip(count, 0, len(values) - 1)]

    return schedule
