"""The optimizer: global-norm clipping then AdamW (optax), with weight decay on matrices
only (norm weights are not decayed)."""

from __future__ import annotations

import jax
import optax

from olmo_jax.optim.schedules import lr_schedule


def decay_mask(params):
    return jax.tree.map(lambda p: p.ndim >= 2, params)


def build_optimizer(optim_cfg, total_steps: int) -> tuple[optax.GradientTransformation, optax.Schedule]:
    o = optim_cfg
    schedule = lr_schedule(
        o.schedule, o.lr, total_steps, o.warmup_steps, o.min_lr_ratio, o.decay_fraction
    )
    parts = []
    if o.clip_grad_norm > 0:
        parts.append(optax.clip_by_global_norm(o.clip_grad_norm))
    parts.append(
        optax.adamw(schedule, b1=o.b1, b2=o.b2, eps=o.eps, weight_decay=o.weight_decay, mask=decay_mask)
    )
    return optax.chain(*parts), schedule
