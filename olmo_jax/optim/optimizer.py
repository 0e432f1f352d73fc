"""The optimizer: global-norm clipping, then AdamW (optax) with weight decay on matrices
only (norm weights are not decayed), or (`optim.name=muon`) Muon on the weight matrices
(optim/muon.py) and that AdamW on everything else (embeddings, LM head, norms, router)."""

from __future__ import annotations

import jax
import optax

from olmo_jax.optim.muon import muon_labels, scale_by_muon
from olmo_jax.optim.schedules import lr_schedule

OPTIMIZERS = ("adamw", "muon")  # optim.name


def decay_mask(params):
    return jax.tree.map(lambda p: p.ndim >= 2, params)


def _adamw(o, schedule):
    return optax.adamw(schedule, b1=o.b1, b2=o.b2, eps=o.eps, weight_decay=o.weight_decay,
                       mask=decay_mask)


def _muon(o, schedule):
    """Muon's update scaled by the schedule times muon_lr / lr (1 by default: with the RMS
    matching scale rule both halves share the learning rate), decoupled weight decay."""
    ratio = (o.muon_lr or o.lr) / o.lr
    return optax.chain(
        scale_by_muon(beta=o.muon_beta, ns_steps=o.muon_ns_steps, eps=o.eps, rms=o.muon_rms),
        optax.add_decayed_weights(o.weight_decay),
        optax.scale_by_learning_rate(lambda step: schedule(step) * ratio),
    )


def build_optimizer(optim_cfg, total_steps: int) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """(tx, schedule). Muon's `tx.update` takes the extra argument `orthogonalize` (a
    ParallelPlan's, passed by the train step); without it every matrix is done locally."""
    o = optim_cfg
    schedule = lr_schedule(
        o.schedule, o.lr, total_steps, o.warmup_steps, o.min_lr_ratio, o.decay_fraction
    )
    parts = []
    if o.clip_grad_norm > 0:
        parts.append(optax.clip_by_global_norm(o.clip_grad_norm))
    if o.name == "muon":
        parts.append(optax.partition({"muon": _muon(o, schedule), "adamw": _adamw(o, schedule)},
                                     muon_labels))
    else:
        parts.append(_adamw(o, schedule))
    return optax.chain(*parts), schedule
