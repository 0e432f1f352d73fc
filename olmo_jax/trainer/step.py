"""The pure training and evaluation steps.

    train_step(state, batch_BT1) -> (state, metrics)

`batch_BT1` holds token windows of seq_len + 1 (inputs = [:, :-1], targets = [:, 1:]).
Gradient accumulation splits the batch into `grad_accum` microbatches inside the step
(a `lax.scan`, gradients summed in float32). Metrics stay on the device; the host reads
them only when it logs.

On a device mesh, `parallel` (an `olmo_jax.parallel.strategy.ParallelPlan`) runs the loss
and gradients per device inside `shard_map`: `parallel.allsum` sums the loss parts and
router statistics over the devices the batch is split across (so the losses equal the
single-device ones), and `parallel.shard_grads` owns parameter gathering and gradient
reduction (DDP all-reduce, ZeRO-1 reduce-scatter, FSDP).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from olmo_jax.model import TransformerConfig
from olmo_jax.model.moe.losses import expert_imbalance, load_balancing_loss, z_loss
from olmo_jax.trainer.state import TrainState


class LossParts(NamedTuple):
    ce_sum: jax.Array  # summed token cross-entropy
    n_tokens: jax.Array
    lb_loss: jax.Array
    z_loss: jax.Array
    counts_LE: jax.Array  # routed assignments per MoE layer and expert
    dropped: jax.Array  # assignments dropped at capacity


def cross_entropy_sum(logits_BTV: jax.Array, targets_BT: jax.Array) -> jax.Array:
    logits_BTV = logits_BTV.astype(jnp.float32)
    lse_BT = jax.nn.logsumexp(logits_BTV, axis=-1)
    target_logit_BT = jnp.take_along_axis(logits_BTV, targets_BT[..., None], axis=-1)[..., 0]
    return jnp.sum(lse_BT - target_logit_BT)


def _no_sync(tree):
    return tree


def forward_losses(graphdef, params, model_state, batch_BT1, cfg: TransformerConfig,
                   allsum=_no_sync) -> LossParts:
    """`allsum` sums a pytree over the devices the batch is split across (identity on one
    device): cross-entropy and router statistics are global sums, so every loss is the
    one a single device would compute on the whole batch."""
    model = nnx.merge(graphdef, params, model_state)
    inputs_BT, targets_BT = batch_BT1[:, :-1], batch_BT1[:, 1:]
    out = model(inputs_BT)
    ce_sum = allsum(cross_entropy_sum(out.logits_BTV, targets_BT))
    n = allsum(jnp.asarray(targets_BT.size, jnp.float32))
    stats = out.router_stats
    if stats is None:
        zero = jnp.zeros((), jnp.float32)
        return LossParts(ce_sum, n, zero, zero, jnp.zeros((0, cfg.moe.num_experts)), zero)
    m = cfg.moe
    global_stats = allsum(stats)
    if m.lb_granularity == "local":  # each rank's loss from its own counts, then averaged
        lb = allsum(load_balancing_loss(stats, m.top_k, m.lb_loss_type)) / allsum(1.0)
    else:
        lb = load_balancing_loss(global_stats, m.top_k, m.lb_loss_type)
    return LossParts(
        ce_sum=ce_sum,
        n_tokens=n,
        lb_loss=lb,
        z_loss=z_loss(global_stats),
        counts_LE=global_stats.counts_E,
        dropped=jnp.sum(global_stats.dropped),
    )


def total_loss(parts: LossParts, cfg: TransformerConfig) -> jax.Array:
    return (
        parts.ce_sum / parts.n_tokens
        + cfg.moe.lb_loss_coef * parts.lb_loss
        + cfg.moe.z_loss_coef * parts.z_loss
    )


def make_grads_fn(graphdef, cfg: TransformerConfig, grad_accum: int = 1, parallel=None):
    """grads_fn(params, model_state, batch) -> (grads, LossParts), gradients of the total
    loss averaged over `grad_accum` microbatches (what one train step applies)."""
    allsum = parallel.allsum if parallel is not None else _no_sync
    use_params = parallel.use_params if parallel is not None else _no_sync

    def loss_fn(params, model_state, batch):
        parts = forward_losses(graphdef, use_params(params), model_state, batch, cfg, allsum)
        return total_loss(parts, cfg), parts

    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

    def grads_and_parts(params, model_state, batch_BT1):
        if grad_accum == 1:
            (_, parts), grads = grad_fn(params, model_state, batch_BT1)
            return grads, parts
        micro = batch_BT1.reshape(grad_accum, -1, batch_BT1.shape[-1])

        def body(acc, mb):
            (_, parts), grads = grad_fn(params, model_state, mb)
            return jax.tree.map(jnp.add, acc, (grads, parts)), None

        parts_shape = jax.eval_shape(grad_fn, params, model_state, micro[0])[0][1]
        # zeros_like(params): inside shard_map a gradient varies over the same mesh axes
        # as its parameter, and a scan carry must keep its type.
        zeros = (jax.tree.map(jnp.zeros_like, params),
                 jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), parts_shape))
        (grads, parts), _ = jax.lax.scan(body, zeros, micro)
        grads = jax.tree.map(lambda g: g / grad_accum, grads)
        parts = parts._replace(lb_loss=parts.lb_loss / grad_accum, z_loss=parts.z_loss / grad_accum)
        return grads, parts

    return grads_and_parts if parallel is None else parallel.shard_grads(grads_and_parts)


def make_train_step(graphdef, cfg: TransformerConfig, tx: optax.GradientTransformation,
                    schedule: optax.Schedule, grad_accum: int = 1, parallel=None):
    grads_and_parts = make_grads_fn(graphdef, cfg, grad_accum, parallel)

    def train_step(state: TrainState, batch_BT1: jax.Array):
        grads, parts = grads_and_parts(state.params, state.model_state, batch_BT1)
        grad_norm = optax.tree.norm(grads)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        routed = jnp.maximum(jnp.sum(parts.counts_LE), 1.0)
        metrics = {
            "loss": parts.ce_sum / parts.n_tokens,
            "lb_loss": parts.lb_loss,
            "z_loss": parts.z_loss,
            "grad_norm": grad_norm,
            "lr": schedule(state.step),
            "expert_imbalance": expert_imbalance(parts.counts_LE) if parts.counts_LE.size else 1.0,
            "dropped_frac": parts.dropped / routed,
        }
        new_state = state._replace(step=state.step + 1, params=params, opt_state=opt_state)
        return new_state, metrics

    return train_step


def make_eval_step(graphdef, cfg: TransformerConfig, parallel=None):
    allsum = parallel.allsum if parallel is not None else _no_sync
    use_params = parallel.use_params if parallel is not None else _no_sync

    def eval_step(params, model_state, batch_BT1):
        parts = forward_losses(graphdef, use_params(params), model_state, batch_BT1, cfg, allsum)
        return parts.ce_sum, parts.n_tokens

    return eval_step if parallel is None else parallel.shard_eval(eval_step)

