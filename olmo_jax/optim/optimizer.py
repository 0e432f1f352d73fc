"""The optimizer: global-norm clipping, then AdamW (optax) with weight decay on matrices
only (norm weights are not decayed; the token embedding too unless optim.decay_embeddings
is False, as in OLMo-core's reference runs), or (`optim.name=muon`) Muon on the weight matrices
(optim/muon.py) and that AdamW on everything else (embeddings, LM head, norms, router)."""

from __future__ import annotations

import dataclasses
import functools

import jax
import optax

from olmo_jax.model.params import path_name
from olmo_jax.optim import groups, schedulers
from olmo_jax.optim.muon import muon_labels, scale_by_muon
from olmo_jax.optim.schedules import lr_schedule

OPTIMIZERS = ("adamw", "muon")  # optim.name


def decay_mask(params, decay_embeddings: bool = True):
    """True for the weights AdamW decays: matrices, the token embedding only if asked."""
    def decays(path, p):
        embedding = path_name(path).split("/")[-1] == "embedding"
        return p.ndim >= 2 and (decay_embeddings or not embedding)

    return jax.tree_util.tree_map_with_path(decays, params)


def _adamw(o, schedule):
    return optax.adamw(schedule, b1=o.b1, b2=o.b2, eps=o.eps, weight_decay=o.weight_decay,
                       mask=functools.partial(decay_mask, decay_embeddings=o.decay_embeddings))


def _muon(o, schedule):
    """Muon's update scaled by the schedule times muon_lr / lr (1 by default: with the RMS
    matching scale rule both halves share the learning rate), decoupled weight decay."""
    ratio = (o.muon_lr or o.lr) / o.lr
    return optax.chain(
        scale_by_muon(beta=o.muon_beta, ns_steps=o.muon_ns_steps, eps=o.eps, rms=o.muon_rms),
        optax.add_decayed_weights(o.weight_decay),
        optax.scale_by_learning_rate(lambda step: schedule(step) * ratio),
    )


def _grouped_adamw(o, default_tx, *duration):
    """AdamW per group of optim.group_overrides (groups.py), each with its own lr x lr_mult
    schedule and weight_decay x wd_mult; the other parameters take `default_tx`."""
    overrides = groups.parse(o.group_overrides)
    txs = {groups.DEFAULT: default_tx}
    for g in overrides:
        og = dataclasses.replace(o, lr=o.lr * g.lr_mult, weight_decay=o.weight_decay * g.wd_mult)
        txs[g.label] = optax.set_to_zero() if og.lr == 0 else _adamw(og, run_schedule(og, *duration))
    return optax.partition(txs, functools.partial(groups.labels, groups=overrides))


def run_schedule(optim_cfg, total_steps: int, tokens_per_step: int = 0,
                 max_tokens: int = 0, batches: schedulers.StepBatches | None = None) -> optax.Schedule:
    """The learning rate at the optimizer's step count: OLMo-core's scheduler of
    optim.scheduler (schedulers.py; units "tokens" need tokens_per_step, and max_tokens, the
    run's token budget, when trainer.max_tokens sets it), else optim.schedule. `batches`: a
    batch-size schedule's steps (schedulers.StepBatches): the scheduler starts each step
    from its rescaled learning rate (optim.schedule: scaled by the same factor)."""
    o = optim_cfg
    if o.scheduler:
        sched = schedulers.parse(o.scheduler)
        return schedulers.table_schedule(
            schedulers.lr_table(sched, o.lr, total_steps, tokens_per_step, max_tokens, batches))
    schedule = lr_schedule(o.schedule, o.lr, total_steps, o.warmup_steps, o.min_lr_ratio,
                           o.decay_fraction)
    if batches is None:
        return schedule
    factors = schedulers.table_schedule(batches.initial_lrs(1.0))
    return lambda count: schedule(count) * factors(count)


def build_optimizer(optim_cfg, total_steps: int, *, tokens_per_step: int = 0,
                    max_tokens: int = 0, batches: schedulers.StepBatches | None = None
                    ) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """(tx, schedule) for a run of `total_steps` (run_schedule). Muon's `tx.update` takes the
    extra argument `orthogonalize` (a ParallelPlan's, passed by the train step); without it
    every matrix is done locally."""
    o = optim_cfg
    schedule = run_schedule(o, total_steps, tokens_per_step, max_tokens, batches)
    parts = []
    if o.clip_grad_norm > 0:
        parts.append(optax.clip_by_global_norm(o.clip_grad_norm))
    if o.name == "muon":
        parts.append(optax.partition({"muon": _muon(o, schedule), "adamw": _adamw(o, schedule)},
                                     muon_labels))
    elif o.group_overrides:
        parts.append(_grouped_adamw(o, _adamw(o, schedule), total_steps, tokens_per_step, max_tokens,
                                    batches))
    else:
        parts.append(_adamw(o, schedule))
    return optax.chain(*parts), schedule
