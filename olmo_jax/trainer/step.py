"""The pure training and evaluation steps.

    train_step(state, batch_BT1) -> (state, metrics)

`batch_BT1` holds token windows of seq_len + 1 (inputs = [:, :-1], targets = [:, 1:]).
Gradient accumulation splits the batch into `grad_accum` microbatches inside the step
(a `lax.scan`, gradients summed in float32). Metrics stay on the device; the host reads
them only when it logs. Training randomness comes from TrainState.rng folded with the step;
auxiliary-loss-free balancing updates the router biases in model_state after the update.

On a device mesh, `parallel` (an `olmo_jax.parallel.strategy.ParallelPlan`) runs the loss
and gradients per device inside `shard_map`: its `allsum` / `allgather` sum / stack over
the devices the batch is split across (so the losses equal the single-device ones and
per-shard routing metrics see every shard), and `parallel.shard_grads` owns parameter
gathering and gradient reduction (DDP all-reduce, ZeRO-1 reduce-scatter, FSDP).
Without a mesh, `row_shards` > 1 splits the batch rows into that many shards instead (the
same per-shard metrics and `local` load-balancing loss, on one device).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from olmo_jax.model import TransformerConfig
from olmo_jax.model.moe.bias_balancing import update_router_bias
from olmo_jax.model.moe.losses import (
    RouterStats,
    load_balancing_loss,
    load_balancing_per_layer,
    shard_sums,
    z_loss_per_layer,
)
from olmo_jax.trainer.routing_metrics import routing_metrics
from olmo_jax.trainer.state import TrainState


class LossParts(NamedTuple):
    ce_sum: jax.Array  # summed token cross-entropy
    n_tokens: jax.Array
    lb_loss: jax.Array
    z_loss: jax.Array
    lb_L: jax.Array  # per MoE layer: OLMo-core LB loss (at the configured granularity)
    z_L: jax.Array  # per MoE layer: z-loss
    counts_LGE: jax.Array  # routed assignments per MoE layer, batch shard and expert
    dropped_L: jax.Array  # per MoE layer: assignments dropped at capacity

    @property
    def counts_LE(self) -> jax.Array:
        return jnp.sum(self.counts_LGE, axis=1)


class SingleDevice:
    """The batch-reduction interface of a ParallelPlan, for a batch on one device."""

    @staticmethod
    def allsum(tree):
        return tree

    @staticmethod
    def allgather(x):
        return x[None]

    @staticmethod
    def use_params(params):
        return params


def cross_entropy_sum(logits_BTV: jax.Array, targets_BT: jax.Array) -> jax.Array:
    logits_BTV = logits_BTV.astype(jnp.float32)
    lse_BT = jax.nn.logsumexp(logits_BTV, axis=-1)
    target_logit_BT = jnp.take_along_axis(logits_BTV, targets_BT[..., None], axis=-1)[..., 0]
    return jnp.sum(lse_BT - target_logit_BT)


def forward_losses(graphdef, params, model_state, batch_BT1, cfg: TransformerConfig,
                   rng=None, row_shards: int = 1, parallel=SingleDevice) -> LossParts:
    """`rng`: a key in training (router jitter, random routing). `row_shards`: shards the
    local batch rows are split into; `parallel.allsum` sums over the devices holding other
    parts of the batch, so every loss is the one a single device computes on the whole
    batch."""
    model = nnx.merge(graphdef, params, model_state)
    inputs_BT, targets_BT = batch_BT1[:, :-1], batch_BT1[:, 1:]
    out = model(inputs_BT, rng=rng)
    return loss_parts(out.logits_BTV, targets_BT, out.router_stats, cfg, row_shards, parallel)


def loss_parts(logits_BTV, targets_BT, stats: RouterStats | None, cfg: TransformerConfig,
               row_shards: int = 1, parallel=SingleDevice) -> LossParts:
    """LossParts of one (micro)batch from the model's logits and stacked RouterStats
    (the pipeline's last stage calls this with the statistics of every stage)."""
    ce_sum = parallel.allsum(cross_entropy_sum(logits_BTV, targets_BT))
    n = parallel.allsum(jnp.asarray(targets_BT.size, jnp.float32))
    return LossParts(ce_sum, n, **routing_parts(stats, cfg, row_shards, parallel))


def routing_parts(stats: RouterStats | None, cfg: TransformerConfig, row_shards: int = 1,
                  parallel=SingleDevice) -> dict:
    """The routing fields of LossParts from the model's stacked (local) RouterStats.

    Shards are the devices' batch slices, each split into `row_shards` row groups. The
    summed stats (`allsum`, tokens_per_row included) describe the whole batch, so
    row-summed quantities from them are global."""
    m = cfg.moe
    if stats is None:
        zero, none = jnp.zeros((), jnp.float32), jnp.zeros((0,), jnp.float32)
        return dict(lb_loss=zero, z_loss=zero, lb_L=none, z_L=none, dropped_L=none,
                    counts_LGE=jnp.zeros((0, row_shards, m.num_experts), jnp.float32))
    global_stats = parallel.allsum(stats)
    if m.lb_granularity in ("local", "instance"):  # each shard's (row's) loss, averaged
        shards = row_shards if m.lb_granularity == "local" else stats.counts_BE.shape[-2]
        devices = parallel.allsum(jnp.ones((), jnp.float32))
        lb = parallel.allsum(load_balancing_loss(stats, m.top_k, m.lb_loss_type, shards)) / devices
        lb_L = parallel.allsum(load_balancing_per_layer(stats, m.top_k, shards)) / devices
    else:
        lb = load_balancing_loss(global_stats, m.top_k, m.lb_loss_type)
        lb_L = load_balancing_per_layer(global_stats, m.top_k)
    z_L = z_loss_per_layer(global_stats)
    counts_GLSE = parallel.allgather(shard_sums(stats.counts_BE, row_shards))
    G, L, S, E = counts_GLSE.shape
    return dict(
        lb_loss=lb,
        z_loss=jnp.sum(z_L),
        lb_L=lb_L,
        z_L=z_L,
        counts_LGE=counts_GLSE.transpose(1, 0, 2, 3).reshape(L, G * S, E),
        dropped_L=global_stats.dropped,
    )


def total_loss(parts: LossParts, cfg: TransformerConfig) -> jax.Array:
    return (
        parts.ce_sum / parts.n_tokens
        + cfg.moe.lb_loss_coef * parts.lb_loss
        + cfg.moe.z_loss_coef * parts.z_loss
    )


def make_grads_fn(graphdef, cfg: TransformerConfig, grad_accum: int = 1, parallel=None,
                  row_shards: int = 1):
    """grads_fn(params, model_state, batch, rng) -> (grads, LossParts), gradients of the
    total loss averaged over `grad_accum` microbatches (what one train step applies)."""
    ops = parallel if parallel is not None else SingleDevice

    def loss_fn(params, model_state, batch, rng):
        parts = forward_losses(graphdef, ops.use_params(params), model_state, batch, cfg, rng,
                               row_shards, ops)
        return total_loss(parts, cfg), parts

    pipeline = getattr(parallel, "pipeline", None)
    grad_fn = (jax.value_and_grad(loss_fn, has_aux=True) if pipeline is None  # else: the
               else pipeline.grad_fn(graphdef, cfg, row_shards, ops))  # stages' schedule

    def grads_and_parts(params, model_state, batch_BT1, rng):
        if grad_accum == 1:
            (_, parts), grads = grad_fn(params, model_state, batch_BT1, rng)
            return grads, parts
        micro = batch_BT1.reshape(grad_accum, -1, batch_BT1.shape[-1])
        keys = jax.random.split(rng, grad_accum)

        def body(acc, xs):
            mb, key = xs
            (_, parts), grads = grad_fn(params, model_state, mb, key)
            return jax.tree.map(jnp.add, acc, (grads, parts)), None

        parts_shape = jax.eval_shape(grad_fn, params, model_state, micro[0], keys[0])[0][1]
        # zeros_like(params): inside shard_map a gradient varies over the same mesh axes
        # as its parameter, and a scan carry must keep its type.
        zeros = (jax.tree.map(jnp.zeros_like, params),
                 jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), parts_shape))
        (grads, parts), _ = jax.lax.scan(body, zeros, (micro, keys))
        grads = jax.tree.map(lambda g: g / grad_accum, grads)
        parts = parts._replace(**{f: getattr(parts, f) / grad_accum
                                  for f in ("lb_loss", "z_loss", "lb_L", "z_L")})
        return grads, parts

    return grads_and_parts if parallel is None else parallel.shard_grads(grads_and_parts)


def make_train_step(graphdef, cfg: TransformerConfig, tx: optax.GradientTransformation,
                    schedule: optax.Schedule, grad_accum: int = 1, *, parallel=None,
                    row_shards: int = 1, expert_ranks: int = 1):
    """`parallel`: a ParallelPlan (None: one device); `row_shards`: without a mesh, the
    shards the batch rows are split into (local LB granularity and imbalance);
    `expert_ranks`: expert-parallel ranks (rank_imbalance)."""
    grads_and_parts = make_grads_fn(graphdef, cfg, grad_accum, parallel, row_shards)

    def train_step(state: TrainState, batch_BT1: jax.Array):
        # Training randomness (router jitter, random routing): the state's key and the step.
        rng = jax.random.fold_in(jax.random.wrap_key_data(state.rng), state.step)
        grads, parts = grads_and_parts(state.params, state.model_state, batch_BT1, rng)
        grad_norm = optax.tree.norm(grads)
        extra = parallel.optimizer_args() if parallel is not None else {}  # Muon's owners
        with jax.named_scope("optimizer"):
            updates, opt_state = optax.with_extra_args_support(tx).update(
                grads, state.opt_state, state.params, **extra)
        params = optax.apply_updates(state.params, updates)
        model_state = state.model_state
        if cfg.moe.bias_rate > 0:  # aux-loss-free balancing, from the step's global counts
            model_state = update_router_bias(model_state, parts.counts_LE, cfg.moe.bias_rate)
        metrics = {
            "loss": parts.ce_sum / parts.n_tokens,
            "grad_norm": grad_norm,
            "lr": schedule(state.step),
            **routing_metrics(parts, expert_ranks=expert_ranks, first_block=cfg.n_dense_layers),
        }
        if getattr(parallel, "pipeline", None) is not None:  # idle share of the schedule table
            metrics["pipeline_bubble"] = jnp.asarray(parallel.pipeline.bubble, jnp.float32)
        new_state = state._replace(step=state.step + 1, params=params, opt_state=opt_state,
                                   model_state=model_state)
        return new_state, metrics

    return train_step


def make_eval_step(graphdef, cfg: TransformerConfig, parallel=None):
    ops = parallel if parallel is not None else SingleDevice

    def eval_step(params, model_state, batch_BT1):
        parts = forward_losses(graphdef, ops.use_params(params), model_state, batch_BT1, cfg,
                               parallel=ops)
        return parts.ce_sum, parts.n_tokens

    if getattr(parallel, "pipeline", None) is not None:  # forwards through the stages
        eval_step = parallel.pipeline.eval_fn(graphdef, cfg, ops)
    return eval_step if parallel is None else parallel.shard_eval(eval_step)
