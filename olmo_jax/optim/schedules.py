"""Learning-rate schedules (optax): linear warmup, then cosine decay, WSD or constant."""

from __future__ import annotations

import optax

LR_SCHEDULES = ("cosine", "wsd", "constant")  # optim.schedule (lr_schedule)


def lr_schedule(
    kind: str, peak: float, total_steps: int, warmup_steps: int,
    min_lr_ratio: float = 0.1, decay_fraction: float = 0.2,
) -> optax.Schedule:
    """cosine: warmup -> cosine to min_lr_ratio*peak at total_steps.
    wsd: warmup -> stable at peak -> linear decay to min_lr_ratio*peak over the last
    `decay_fraction` of the steps (warmup-stable-decay).
    constant: warmup -> peak."""
    warmup_steps = min(warmup_steps, max(total_steps - 1, 0))
    floor = peak * min_lr_ratio
    warmup = optax.linear_schedule(peak / max(warmup_steps, 1), peak, max(warmup_steps, 1))
    rest = max(total_steps - warmup_steps, 1)
    if kind == "cosine":
        after = optax.cosine_decay_schedule(peak, rest, alpha=min_lr_ratio)
    elif kind == "wsd":
        decay = max(1, round(rest * decay_fraction))
        after = optax.join_schedules(
            [optax.constant_schedule(peak), optax.linear_schedule(peak, floor, decay)],
            [rest - decay],
        )
    elif kind == "constant":
        after = optax.constant_schedule(peak)
    else:
        raise ValueError(f"unknown schedule {kind!r}")
    if warmup_steps == 0:
        return after
    return optax.join_schedules([warmup, after], [warmup_steps])
