"""Bad steps: non-finite losses or gradients, loss spikes, and when training must stop.

A step's update is discarded ON THE DEVICE (a `jnp.where` between the old and the new
state inside the jitted step; no host round trip) when
  - its loss or gradient norm is not finite (inf / nan), or
  - the spike rule fires (OLMo-core's SkipStepOptimizer): `trainer.spike_sigma` > 0 and the
    loss or the gradient norm is more than spike_sigma standard deviations (unbiased)
    above the mean of the last `trainer.spike_window` finite values, once at least
    max(2, spike_window // 2) of them are known. Every finite step's values enter the
    window, skipped or not (a lasting level shift stops being a spike), so the window
    follows the data, not the decisions.
A skipped step still consumes its batch and advances `step` (and the learning-rate
schedule). The running counts live in `TrainState.guard` (checkpointed with the state):
`skipped` in total and `in_row`, consecutive.

Halting (`halt_step` > 0, its causes in `halt_reason`) happens on the device too:
`trainer.nan_policy=halt` halts at the first non-finite step; with `skip`, after
`trainer.max_skipped` skipped steps in a row (0 = never). From then on every step is a
no-op, so the state stays the last good one. The host learns of it when it next reads
the metrics (a log step) or before it saves a checkpoint, whichever comes first: it then
stops with `TrainingHalted` without saving, so the last checkpoint stays the last good
state. Nothing in a step waits for the host.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

from olmo_jax.trainer.config import POLICIES

# halt_reason / skip_reason bits
LOSS_NONFINITE, GRAD_NONFINITE, LOSS_SPIKE, GRAD_SPIKE, TOO_MANY = 1, 2, 4, 8, 16


class TrainingHalted(RuntimeError):
    """Training stopped on a non-finite step (nan_policy=halt) or too many skipped steps."""


@dataclasses.dataclass(frozen=True)
class GuardConfig:
    nan_policy: str = "skip"  # skip | halt
    max_skipped: int = 10  # halt after this many skipped steps in a row (0 = never)
    spike_sigma: float = 0.0  # 0 = no spike rule (OLMo-core uses 6)
    spike_window: int = 128

    @classmethod
    def from_trainer(cls, t) -> GuardConfig:
        return cls(t.nan_policy, t.max_skipped, t.spike_sigma, t.spike_window)


class GuardState(NamedTuple):
    skipped: jax.Array  # int32: steps skipped so far
    in_row: jax.Array  # int32: consecutive skipped steps, ending at the last step
    halt_step: jax.Array  # int32: the (1-based) step that halted training; 0 = running
    halt_reason: jax.Array  # int32: bits LOSS_NONFINITE .. TOO_MANY of the halting step
    appended: jax.Array  # int32: finite (loss, grad_norm) pairs seen so far
    loss_W: jax.Array  # float32 [spike_window]: ring buffer of recent finite losses
    grad_norm_W: jax.Array  # float32 [spike_window]: ... and gradient norms


def init_guard(cfg: GuardConfig) -> GuardState:
    """All zeros (each leaf its own buffer: the state is donated leaf by leaf)."""
    def zero():
        return jnp.zeros((), jnp.int32)

    def window():
        return jnp.zeros((cfg.spike_window,), jnp.float32)

    return GuardState(zero(), zero(), zero(), zero(), zero(), window(), window())


def _above(x, window_W, n, sigma):
    """x more than sigma unbiased standard deviations above the mean of the first n entries."""
    valid_W = jnp.arange(window_W.shape[0]) < n
    nf = jnp.maximum(n, 2).astype(jnp.float32)
    mean = jnp.sum(jnp.where(valid_W, window_W, 0.0)) / nf
    var = jnp.sum(jnp.where(valid_W, (window_W - mean) ** 2, 0.0)) / (nf - 1)
    return (x - mean) > sigma * jnp.sqrt(var)


def judge(guard: GuardState, loss, grad_norm, step, cfg: GuardConfig):
    """(apply this step's update?, skip_reason bits, the new GuardState). `step` is the
    1-based number of the step being judged."""
    loss, grad_norm = jnp.asarray(loss, jnp.float32), jnp.asarray(grad_norm, jnp.float32)
    loss_bad, grad_bad = ~jnp.isfinite(loss), ~jnp.isfinite(grad_norm)
    finite = ~(loss_bad | grad_bad)
    reason = jnp.where(loss_bad, LOSS_NONFINITE, 0) | jnp.where(grad_bad, GRAD_NONFINITE, 0)
    W = cfg.spike_window
    n = jnp.minimum(guard.appended, W)
    if cfg.spike_sigma > 0:
        active = finite & (n >= max(2, W // 2))
        reason |= jnp.where(active & _above(loss, guard.loss_W, n, cfg.spike_sigma), LOSS_SPIKE, 0)
        reason |= jnp.where(active & _above(grad_norm, guard.grad_norm_W, n, cfg.spike_sigma),
                            GRAD_SPIKE, 0)
    halted = guard.halt_step > 0
    skip = halted | (reason != 0)
    in_row = jnp.where(skip, guard.in_row + 1, 0)
    halt_now = ~halted & (
        (~finite if cfg.nan_policy == "halt" else False)
        | ((in_row >= cfg.max_skipped) if cfg.max_skipped > 0 else False)
    )
    too_many = jnp.where((cfg.max_skipped > 0) & (in_row >= cfg.max_skipped), TOO_MANY, 0)
    record = finite & ~halted
    pos = guard.appended % W
    new = GuardState(
        skipped=guard.skipped + skip.astype(jnp.int32),
        in_row=in_row,
        halt_step=jnp.where(halt_now, jnp.asarray(step, jnp.int32), guard.halt_step),
        halt_reason=jnp.where(halt_now, reason | too_many, guard.halt_reason),
        appended=guard.appended + record.astype(jnp.int32),
        loss_W=jnp.where(record, guard.loss_W.at[pos].set(loss), guard.loss_W),
        grad_norm_W=jnp.where(record, guard.grad_norm_W.at[pos].set(grad_norm), guard.grad_norm_W),
    )
    return ~skip, reason, new


def guarded(train_step, cfg: GuardConfig):
    """train_step(state, batch) -> (state, metrics) with this module's rules: the returned
    state is the new one, or the old one (params, opt_state, model_state) if the step is
    skipped; metrics gain `skipped` (0/1), `skipped_steps` (total) and `halted` (the
    halting step, 0 = running)."""
    if cfg.nan_policy not in POLICIES:
        raise ValueError(f"nan_policy={cfg.nan_policy!r}: choose one of {', '.join(POLICIES)}")

    def step(state, batch):
        new, metrics = train_step(state, batch)
        apply, _, guard = judge(state.guard, metrics["loss"], metrics["grad_norm"],
                                state.step + 1, cfg)
        keep = lambda n, o: jax.tree.map(lambda a, b: jnp.where(apply, a, b), n, o)
        new = new._replace(
            params=keep(new.params, state.params),
            opt_state=keep(new.opt_state, state.opt_state),
            model_state=keep(new.model_state, state.model_state),
            guard=guard,
        )
        metrics = {**metrics, "skipped": (~apply).astype(jnp.int32),
                   "skipped_steps": guard.skipped, "halted": guard.halt_step}
        return new, metrics

    return step


def _causes(reason: int) -> str:
    parts = []
    if reason & (LOSS_NONFINITE | GRAD_NONFINITE):
        parts.append(
            "loss is " + ("non-finite" if reason & LOSS_NONFINITE else "finite")
            + " and grad_norm is " + ("non-finite" if reason & GRAD_NONFINITE else "finite")
        )
    if reason & LOSS_SPIKE:
        parts.append("the loss spiked (trainer.spike_sigma)")
    if reason & GRAD_SPIKE:
        parts.append("the gradient norm spiked (trainer.spike_sigma)")
    return "; ".join(parts)


def halt_message(halt_step: int, reason: int, cfg: GuardConfig, last_checkpoint: int | None,
                 where: str) -> str:
    """The user's message for a halted run (read from the metrics or the guard state)."""
    if reason & TOO_MANY:
        what = (f"{cfg.max_skipped} steps in a row were skipped (trainer.max_skipped="
                f"{cfg.max_skipped}); the last one because {_causes(reason)}")
    else:
        what = f"{_causes(reason)} (trainer.nan_policy={cfg.nan_policy})"
    kept = (f"the last checkpoint, step {last_checkpoint} in {where}, is kept and resuming "
            "starts from it" if last_checkpoint is not None else "no checkpoint was saved")
    return (
        f"training halted at step {halt_step}: {what}; its update was discarded and {kept}. "
        "To go on: lower optim.lr or raise optim.warmup_steps / optim.clip_grad_norm, check "
        "the data of that step, or set trainer.nan_policy=skip / raise trainer.max_skipped "
        "(a resumed run with changed settings needs --config.trainer.overwrite=True)"
    )
