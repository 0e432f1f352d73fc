"""The pure training and evaluation steps.

    train_step(state, batch_BX) -> (state, metrics)

`batch_BX` holds rows of seq_len + 1 ints (inputs = [:, :-1], targets = [:, 1:]; a target < 0
is a label sentinel, olmo_jax/labels.py).
Gradient accumulation splits the batch into `grad_accum` microbatches inside the step
(a `lax.scan`, gradients summed in float32, also those of the bf16 compute copies a
parallel plan gathers: parallel/zero.py). Metrics stay on the device; the host reads
them only when it logs. Training randomness comes from TrainState.rng folded with the step;
auxiliary-loss-free balancing updates the router biases in model_state after the update.

The loss is the objective's (olmo_jax/objective.py). `parallel` is the run's plan as the
steps see it (`objective.Plan`): on a device mesh an `olmo_jax.parallel.strategy.
ParallelPlan` runs the loss and gradients per device inside `shard_map`: its `allsum` /
`allgather` sum / stack over the devices the batch is split across (so the losses equal
the single-device ones and per-shard routing metrics see every shard), and
`parallel.shard_grads` owns parameter gathering and gradient reduction (DDP all-reduce,
ZeRO-1 reduce-scatter, FSDP); with `parallel.pipeline` set the gradients and evaluation
run through the pipeline's stages. The default, `objective.SINGLE_DEVICE`, is one device.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from olmo_jax.model import TransformerConfig
from olmo_jax.model.moe.bias_balancing import update_router_bias
from olmo_jax.objective import SINGLE_DEVICE, Plan, forward_losses, total_loss
from olmo_jax.trainer.routing_metrics import routing_metrics
from olmo_jax.trainer.state import TrainState


def make_grads_fn(graphdef, cfg: TransformerConfig, grad_accum: int = 1,
                  parallel: Plan = SINGLE_DEVICE):
    """grads_fn(params, model_state, batch, rng) -> (grads, LossParts), gradients of the
    total loss averaged over `grad_accum` microbatches (what one train step applies)."""

    def loss_fn(params, model_state, batch, rng):
        parts = forward_losses(graphdef, parallel.use_params(params), model_state, batch, cfg,
                               rng, parallel)
        return total_loss(parts, cfg), parts

    pipeline = parallel.pipeline
    grad_fn = (jax.value_and_grad(loss_fn, has_aux=True) if pipeline is None  # else: the
               else pipeline.grad_fn(graphdef, cfg, parallel))  # stages' schedule

    def grads_and_parts(params, model_state, batch_BX, rng):
        if grad_accum == 1:
            (_, parts), grads = grad_fn(params, model_state, batch_BX, rng)
            return jax.tree.map(_float32, grads), parts
        micro = batch_BX.reshape(grad_accum, -1, batch_BX.shape[-1])
        keys = jax.random.split(rng, grad_accum)

        def body(acc, xs):
            mb, key = xs
            (_, parts), grads = grad_fn(params, model_state, mb, key)
            return jax.tree.map(lambda a, x: a + x.astype(a.dtype), acc, (grads, parts)), None

        parts_shape = jax.eval_shape(grad_fn, params, model_state, micro[0], keys[0])[0][1]
        # zeros_like(params): inside shard_map a gradient varies over the same mesh axes
        # as its parameter, and a scan carry must keep its type; float32 also for a bf16
        # compute copy (parallel/zero.py), whose gradients are summed in float32.
        zeros = (jax.tree.map(lambda p: jnp.zeros_like(p, jnp.float32), params),
                 jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), parts_shape))
        (grads, parts), _ = jax.lax.scan(body, zeros, (micro, keys))
        grads = jax.tree.map(lambda g: g / grad_accum, grads)
        parts = parts._replace(**{f: getattr(parts, f) / grad_accum
                                  for f in ("lb_loss", "z_loss", "lb_L", "z_L")})
        return grads, parts

    return parallel.shard_grads(grads_and_parts)


def _float32(g):
    return g.astype(jnp.float32)


def make_train_step(graphdef, cfg: TransformerConfig, tx: optax.GradientTransformation,
                    schedule: optax.Schedule, grad_accum: int = 1, *,
                    parallel: Plan = SINGLE_DEVICE, expert_ranks: int = 1):
    """`parallel`: the run's plan (a ParallelPlan on a mesh); `expert_ranks`: expert-parallel
    ranks (rank_imbalance)."""
    grads_and_parts = make_grads_fn(graphdef, cfg, grad_accum, parallel)

    def train_step(state: TrainState, batch_BX: jax.Array):
        # Training randomness (router jitter, random routing): the state's key and the step.
        rng = jax.random.fold_in(jax.random.wrap_key_data(state.rng), state.step)
        grads, parts = grads_and_parts(state.params, state.model_state, batch_BX, rng)
        grad_norm = optax.tree.norm(grads)
        extra = parallel.optimizer_args()  # Muon's owners on a mesh
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
        if cfg.lm_z_loss_coef > 0:  # the LM head's z-loss, unweighted (OLMo-core's "Z loss")
            metrics["lm_z_loss"] = parts.lm_z_sum / parts.n_tokens
        if parallel.pipeline is not None:  # idle share of the schedule table
            metrics["pipeline_bubble"] = jnp.asarray(parallel.pipeline.bubble, jnp.float32)
        new_state = state._replace(step=state.step + 1, params=params, opt_state=opt_state,
                                   model_state=model_state)
        return new_state, metrics

    return train_step


def make_eval_step(graphdef, cfg: TransformerConfig, parallel: Plan = SINGLE_DEVICE):
    """eval_step(params, model_state, batch_BX) -> (ce_sum, n_tokens) of the batch."""

    def eval_step(params, model_state, batch_BX):
        parts = forward_losses(graphdef, parallel.use_params(params), model_state, batch_BX,
                               cfg, parallel=parallel)
        return parts.ce_sum, parts.n_tokens

    if parallel.pipeline is not None:  # forwards through the stages
        eval_step = parallel.pipeline.eval_fn(graphdef, cfg, parallel)
    return parallel.shard_eval(eval_step)
