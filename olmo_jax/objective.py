"""The training objective: the loss of a (micro)batch, as parts that sum over the devices
the batch is split across, and the interface of the parallel plan it runs under.

    parts = forward_losses(graphdef, params, model_state, batch_BX, cfg, rng, plan)
    loss = total_loss(parts, cfg)     # CE mean + lb_loss_coef * LB + z_loss_coef * z

`LossParts` holds sums (cross-entropy, tokens) and the router losses and counts of every
MoE layer, so microbatches and pipeline stages add them up and the step divides once.
`plan.allsum` / `plan.allgather` sum / stack over the devices holding other parts of the
batch, so every loss is the one a single device computes on the whole batch; with
`model.moe.lb_granularity = local` each device's load-balancing loss comes from its own
tokens and the losses are averaged. Per-shard expert counts (`counts_LPE`, one row per
device's batch slice) feed the local imbalance metrics. `token_shard` is what a device
computes on of a batch's rows (inputs, targets, document masking's segment ids and RoPE
positions, a context rank's zig-zag shard of each): the step and every pipeline stage
use it.

The plan, as the objective and the train / eval steps (trainer/step.py) see it, is a
`typing.Protocol`: `BatchReduction` (what the objective needs) and `Plan` (what the
steps need besides: parameter use, the shard_map wrappers, the optimizer's extra
arguments, and `pipeline`, None when unpipelined). `olmo_jax.parallel.strategy.
ParallelPlan` satisfies `Plan` on a mesh, `SingleDevice` without one. This module sits
below parallel/ and trainer/ (docs/ARCHITECTURE.md): both import it, it imports neither.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple, Protocol, runtime_checkable

import jax
import jax.numpy as jnp
from flax import nnx

from olmo_jax.kernels.ring_attention import CONTEXT_AXIS, zigzag_positions, zigzag_shard
from olmo_jax.labels import FILTERED
from olmo_jax.model import TransformerConfig
from olmo_jax.model.moe.losses import (
    RouterStats,
    load_balancing_loss,
    load_balancing_per_layer,
    z_loss_per_layer,
)
from olmo_jax.model.rope import document_positions


class LossParts(NamedTuple):
    ce_sum: jax.Array  # summed token cross-entropy over the labelled targets
    n_tokens: jax.Array  # labels counted in the denominator (olmo_jax/labels.py)
    lb_loss: jax.Array
    z_loss: jax.Array
    lb_L: jax.Array  # per MoE layer: OLMo-core LB loss (at the configured granularity)
    z_L: jax.Array  # per MoE layer: z-loss
    counts_LPE: jax.Array  # routed assignments per MoE layer, batch shard and expert
    dropped_L: jax.Array  # per MoE layer: assignments dropped at capacity
    lm_z_sum: jax.Array  # summed logsumexp(logits)^2 over the labelled tokens (LM z-loss)

    @property
    def counts_LE(self) -> jax.Array:
        return jnp.sum(self.counts_LPE, axis=1)


# ---- the parallel plan, as the objective and the steps see it ------------------------------
@runtime_checkable
class BatchReduction(Protocol):
    """Reductions over the devices holding the parts of one batch (inside the step's
    shard_map on a mesh; identities on one device)."""

    def allsum(self, tree):
        """The tree summed over the batch's devices (replicated)."""
        ...

    def allgather(self, x: jax.Array) -> jax.Array:
        """x stacked over the batch's devices, in batch order: [devices, ...]."""
        ...


@runtime_checkable
class PipelineRunner(Protocol):
    """What the steps use of a pipeline (olmo_jax.parallel.pipeline.Pipeline)."""

    @property
    def bubble(self) -> float: ...

    def grad_fn(self, graphdef, cfg: TransformerConfig, ops: Plan) -> Callable: ...

    def eval_fn(self, graphdef, cfg: TransformerConfig, ops: Plan) -> Callable: ...

    def rows_fn(self, graphdef, cfg: TransformerConfig, ops: Plan, row_head: Callable) -> Callable: ...


@runtime_checkable
class Plan(BatchReduction, Protocol):
    """A run's parallel plan as the train / eval steps see it."""

    @property
    def pipeline(self) -> PipelineRunner | None:
        """The pipeline over `pipe` the gradients and evaluation run through; None when the
        run is not pipelined."""
        ...

    def use_params(self, params):
        """The parameters as one microbatch's loss uses them (FSDP gathers here)."""
        ...

    def shard_grads(self, grads_and_parts: Callable) -> Callable:
        """grads_and_parts(params, model_state, batch, rng) written for one device -> the same
        over the stored (global) arrays."""
        ...

    def shard_eval(self, eval_step: Callable) -> Callable:
        """eval_step(params, model_state, batch) for one device -> the same over the mesh."""
        ...

    def optimizer_args(self) -> dict[str, Any]:
        """Extra arguments of the optimizer's update (Muon's orthogonalize on a mesh)."""
        ...


class SingleDevice:
    """The Plan of a batch on one device: no collectives, no pipeline, no wrappers."""

    pipeline = None

    def allsum(self, tree):
        return tree

    def allgather(self, x):
        return x[None]

    def use_params(self, params):
        return params

    def shard_grads(self, grads_and_parts):
        return grads_and_parts

    def shard_eval(self, eval_step):
        return eval_step

    def optimizer_args(self) -> dict[str, Any]:
        return {}


SINGLE_DEVICE = SingleDevice()


# ---- the losses ------------------------------------------------------------------------------
def labelled(targets_BT: jax.Array, row_end_B1: jax.Array | None = None
             ) -> tuple[jax.Array, jax.Array]:
    """(loss_BT, counted_BT) masks of a batch's targets (olmo_jax/labels.py): a target is
    counted in the loss's denominator when it is a token id, and adds to the loss unless its
    row ends in FILTERED (an instance the repetition filter dropped, counted as OLMo-core
    does). `row_end_B1`: each row's last target when `targets_BT` holds only a shard of the
    row's positions (context parallelism); default its last column."""
    counted_BT = targets_BT >= 0
    end_B1 = targets_BT[:, -1:] if row_end_B1 is None else row_end_B1
    return counted_BT & (end_B1 != FILTERED), counted_BT


def cross_entropy_sums(logits_BTV: jax.Array, targets_BT: jax.Array, row_end_B1=None
                       ) -> tuple[jax.Array, jax.Array]:
    """(summed cross-entropy, summed logsumexp^2) over the labelled targets (`row_end_B1`:
    as `labelled`)."""
    logits_BTV = logits_BTV.astype(jnp.float32)
    loss_BT, _ = labelled(targets_BT, row_end_B1)
    lse_BT = jax.nn.logsumexp(logits_BTV, axis=-1)
    target_logit_BT = jnp.take_along_axis(
        logits_BTV, jnp.maximum(targets_BT, 0)[..., None], axis=-1)[..., 0]
    return (jnp.sum(jnp.where(loss_BT, lse_BT - target_logit_BT, 0.0)),
            jnp.sum(jnp.where(loss_BT, jnp.square(lse_BT), 0.0)))


def cross_entropy_sum(logits_BTV: jax.Array, targets_BT: jax.Array) -> jax.Array:
    return cross_entropy_sums(logits_BTV, targets_BT)[0]


def document_segments(inputs_BT: jax.Array, cfg: TransformerConfig) -> jax.Array | None:
    """The segment ids of document masking (model.doc_mask_eos >= 0), int32 [B, T]: each
    position's document, the number of EOS tokens before it in its row (a document ends
    with its EOS, as OLMo-core's `get_document_lengths` cuts them: data/loader.py's
    `document_lengths` on the host). None when document masking is off. A pure function of
    the row's tokens, so the batch stays one int32 array and its shapes never change."""
    if cfg.doc_mask_eos < 0:
        return None
    eos_BT = (inputs_BT == cfg.doc_mask_eos).astype(jnp.int32)
    return jnp.cumsum(eos_BT, axis=1, dtype=jnp.int32) - eos_BT


class TokenShard(NamedTuple):
    """This device's share of a batch's token windows, and what the model needs besides the
    tokens to compute on it as on the whole rows (`token_shard`)."""

    inputs_BT: jax.Array
    targets_BT: jax.Array
    segment_ids_BT: jax.Array | None  # document masking (None: off)
    positions_T: jax.Array | None  # RoPE positions shared by the rows (None: 0 .. T-1)
    positions_BT: jax.Array | None  # per row (document masking: restarting at each document)
    row_end_B1: jax.Array | None  # the rows' last targets when targets_BT is a context shard

    def model_args(self) -> dict:
        """The keyword arguments of `Transformer.blocks` / `__call__` besides the tokens."""
        return dict(segment_ids_BT=self.segment_ids_BT, positions_T=self.positions_T,
                    positions_BT=self.positions_BT)


def token_shard(batch_BX: jax.Array, cfg: TransformerConfig) -> TokenShard:
    """Inputs [:, :-1] and targets [:, 1:] of token windows `batch_BX`, with document
    masking's segment ids and per-row RoPE positions (model.doc_mask_eos >= 0) computed on
    the whole rows. With context parallelism (model.context_parallel = C > 1, inside the
    step's shard_map) every context rank holds the whole rows and takes its zig-zag shard
    of each [B, T] array (olmo_jax/kernels/ring_attention.py): documents may cross the
    shards' boundaries, the attention masks by segment id, and the RoPE positions are the
    shard's global indices, or with document masking its share of the rows' in-document
    positions (a shard's segment ids are not contiguous, so positions are not derived from
    them there)."""
    inputs_BT, targets_BT = batch_BX[:, :-1], batch_BX[:, 1:]
    segment_ids_BT = document_segments(inputs_BT, cfg)  # None without document masking
    positions_BT = None if segment_ids_BT is None else document_positions(segment_ids_BT)
    C = cfg.context_parallel
    if C == 1:
        return TokenShard(inputs_BT, targets_BT, segment_ids_BT, None, positions_BT, None)
    rank = jax.lax.axis_index(CONTEXT_AXIS)

    def shard(x_BT):
        return None if x_BT is None else zigzag_shard(x_BT, C, rank)

    return TokenShard(shard(inputs_BT), shard(targets_BT), shard(segment_ids_BT),
                      zigzag_positions(inputs_BT.shape[1], C, rank), shard(positions_BT),
                      targets_BT[:, -1:])


def forward_losses(graphdef, params, model_state, batch_BX, cfg: TransformerConfig,
                   rng=None, parallel: BatchReduction = SINGLE_DEVICE) -> LossParts:
    """LossParts of token windows `batch_BX` (inputs [:, :-1], targets [:, 1:]). `rng`: a
    key in training (router jitter, random routing). With model.doc_mask_eos the
    documents of a row are masked from each other (`document_segments`); with context
    parallelism each device computes on its zig-zag shard of the rows (`token_shard`)."""
    model = nnx.merge(graphdef, params, model_state)
    s = token_shard(batch_BX, cfg)
    if cfg.lm_loss_chunk:  # the head and loss chunked, no [B, T, V] logits
        x_BTD, stats = model.blocks(model.embed(s.inputs_BT), rng=rng, **s.model_args())
        return loss_parts(None, s.targets_BT, stats, cfg, parallel, s.row_end_B1,
                          sums=head_loss_sums(model, x_BTD, s.targets_BT, cfg.lm_loss_chunk,
                                              s.row_end_B1))
    out = model(s.inputs_BT, rng=rng, **s.model_args())
    return loss_parts(out.logits_BTV, s.targets_BT, out.router_stats, cfg, parallel, s.row_end_B1)


def head_loss_sums(model, x_BTD, targets_BT, chunk: int,
                   row_end_B1=None) -> tuple[jax.Array, jax.Array]:
    """cross_entropy_sums of the model's head on the final hidden states, chunked over
    `chunk` tokens (model.lm_loss_chunk; Transformer.head_losses): what loss_parts takes
    instead of the logits (`row_end_B1`: as `labelled`)."""
    return model.head_losses(x_BTD, targets_BT, labelled(targets_BT, row_end_B1)[0], chunk)


def loss_parts(logits_BTV, targets_BT, stats: RouterStats | None, cfg: TransformerConfig,
               parallel: BatchReduction = SINGLE_DEVICE, row_end_B1=None, sums=None) -> LossParts:
    """LossParts of one (micro)batch from the model's logits and stacked RouterStats
    (the pipeline's last stage calls this with the statistics of every stage).
    `row_end_B1`: as `labelled` (a context-parallel shard of the rows). `sums`: the
    (cross-entropy, logsumexp^2) sums head_loss_sums gives with model.lm_loss_chunk,
    instead of the logits (then None)."""
    sums = cross_entropy_sums(logits_BTV, targets_BT, row_end_B1) if sums is None else sums
    # One all-reduce for the four sums: the losses, the labels counted, the positions.
    ce_sum, lm_z_sum, n, positions = parallel.allsum(jnp.stack([
        *sums,
        jnp.sum(labelled(targets_BT)[1], dtype=jnp.float32),
        jnp.asarray(targets_BT.size, jnp.float32)]))
    routing = routing_parts(stats, cfg, parallel)
    # The router losses are per-token means. OLMo-core divides them, like the LM loss, by the
    # label count (its train module's loss_div_factor) rather than the routed token count:
    # with OLMo-core instances (one unlabelled position each) that is T / (T - 1) more. (With
    # every position labelled the factor is exactly 1; Hugging Face's pooled LB loss is a
    # plain mean over the routed tokens and keeps it.)
    per_label = positions / n
    scaled = ["z_loss", "z_L", "lb_L"] + (["lb_loss"] if cfg.moe.lb_loss_type == "per_layer" else [])
    routing.update({f: routing[f] * per_label for f in scaled})
    return LossParts(ce_sum, n, lm_z_sum=lm_z_sum, **routing)


def routing_parts(stats: RouterStats | None, cfg: TransformerConfig,
                  parallel: BatchReduction = SINGLE_DEVICE) -> dict:
    """The routing fields of LossParts from the model's stacked (local) RouterStats.

    Shards are the devices' batch slices. The summed stats (`allsum`, tokens_per_row
    included) describe the whole batch, so row-summed quantities from them are global."""
    m = cfg.moe
    if stats is None:
        zero, none = jnp.zeros((), jnp.float32), jnp.zeros((0,), jnp.float32)
        return dict(lb_loss=zero, z_loss=zero, lb_L=none, z_L=none, dropped_L=none,
                    counts_LPE=jnp.zeros((0, 1, m.num_experts), jnp.float32))
    global_stats = parallel.allsum(stats)
    if m.lb_granularity in ("local", "instance"):  # each shard's (row's) loss, averaged
        rows = 1 if m.lb_granularity == "local" else stats.counts_LBE.shape[-2]
        devices = parallel.allsum(jnp.ones((), jnp.float32))
        lb = parallel.allsum(load_balancing_loss(stats, m.top_k, m.lb_loss_type, rows)) / devices
        lb_L = parallel.allsum(load_balancing_per_layer(stats, m.top_k, rows)) / devices
    else:
        lb = load_balancing_loss(global_stats, m.top_k, m.lb_loss_type)
        lb_L = load_balancing_per_layer(global_stats, m.top_k)
    z_L = z_loss_per_layer(global_stats)
    counts_PLE = parallel.allgather(stats.counts_E)
    return dict(
        lb_loss=lb,
        z_loss=jnp.sum(z_L),
        lb_L=lb_L,
        z_L=z_L,
        counts_LPE=jnp.swapaxes(counts_PLE, 0, 1),
        dropped_L=global_stats.dropped,
    )


def total_loss(parts: LossParts, cfg: TransformerConfig) -> jax.Array:
    return (
        parts.ce_sum / parts.n_tokens
        + cfg.lm_z_loss_coef * parts.lm_z_sum / parts.n_tokens
        + cfg.moe.lb_loss_coef * parts.lb_loss
        + cfg.moe.z_loss_coef * parts.z_loss
    )
