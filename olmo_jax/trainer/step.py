"""The pure training and evaluation steps.

    train_step(state, batch_BT1) -> (state, metrics)

`batch_BT1` holds token windows of seq_len + 1 (inputs = [:, :-1], targets = [:, 1:]).
Gradient accumulation splits the batch into `grad_accum` microbatches inside the step
(a `lax.scan`, gradients summed in float32). Metrics stay on the device; the host reads
them only when it logs.
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


def forward_losses(graphdef, params, model_state, batch_BT1, cfg: TransformerConfig) -> LossParts:
    model = nnx.merge(graphdef, params, model_state)
    inputs_BT, targets_BT = batch_BT1[:, :-1], batch_BT1[:, 1:]
    out = model(inputs_BT)
    ce_sum = cross_entropy_sum(out.logits_BTV, targets_BT)
    n = jnp.asarray(targets_BT.size, jnp.float32)
    stats = out.router_stats
    if stats is None:
        zero = jnp.zeros((), jnp.float32)
        return LossParts(ce_sum, n, zero, zero, jnp.zeros((0, cfg.moe.num_experts)), zero)
    return LossParts(
        ce_sum=ce_sum,
        n_tokens=n,
        lb_loss=load_balancing_loss(stats, cfg.moe.top_k, cfg.moe.lb_loss_type),
        z_loss=z_loss(stats),
        counts_LE=stats.counts_E,
        dropped=jnp.sum(stats.dropped),
    )


def total_loss(parts: LossParts, cfg: TransformerConfig) -> jax.Array:
    return (
        parts.ce_sum / parts.n_tokens
        + cfg.moe.lb_loss_coef * parts.lb_loss
        + cfg.moe.z_loss_coef * parts.z_loss
    )


def make_train_step(graphdef, cfg: TransformerConfig, tx: optax.GradientTransformation,
                    schedule: optax.Schedule, grad_accum: int = 1):
    def loss_fn(params, model_state, batch):
        parts = forward_losses(graphdef, params, model_state, batch, cfg)
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

        first = jax.eval_shape(grad_fn, params, model_state, micro[0])
        zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), (first[1], first[0][1]))
        (grads, parts), _ = jax.lax.scan(body, zeros, micro)
        grads = jax.tree.map(lambda g: g / grad_accum, grads)
        parts = parts._replace(lb_loss=parts.lb_loss / grad_accum, z_loss=parts.z_loss / grad_accum)
        return grads, parts

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


def make_eval_step(graphdef, cfg: TransformerConfig):
    def eval_step(params, model_state, batch_BT1):
        parts = forward_losses(graphdef, params, model_state, batch_BT1, cfg)
        return parts.ce_sum, parts.n_tokens

    return eval_step
