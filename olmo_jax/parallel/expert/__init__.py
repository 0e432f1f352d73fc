"""Expert-parallel dispatch backends: experts stay resident on their `expert`-axis rank,
tokens travel to them. Each runs per device inside `shard_map` (the trainer's step runs
the whole model that way) and is a MoE layer dispatch backend (olmo_jax/model/moe/layer.py):

    backend(x_SD, routing, moe_cfg, padding) -> buffer.Dispatched(x_RD, layout, combine, dropped)

with x_SD / routing the device's own tokens; the buffer's groups are the rank's E/ep
local experts (expert e lives on rank e // (E/ep) as local expert e % (E/ep)), whose FFN
the MoE layer runs; `dropped` counts this device's (token, choice) assignments dropped
at capacity. Backends move tokens only; each has a `buffer_rows` (its static sizing, the
planner's too, from olmo_jax/model/moe/sizing.py):

  rowwise    (rowwise.py) fixed receive slots, one dense all_to_all each way; overflow
             dropped by the choice-major rule of olmo_jax.model.moe.dispatch.
  ragged     (ragged.py) dropless; offsets computed on device; jax.lax.ragged_all_to_all
             on GPU/TPU, an exact dense emulation elsewhere (ragged_a2a.py).
  allgather  (allgather.py) dropless; tokens all-gathered over `expert`, local experts
             applied, partial outputs reduce-scattered back.
"""

from __future__ import annotations

import functools

import jax

from olmo_jax.errors import ConfigError
from olmo_jax.model.moe import sizing
from olmo_jax.model.moe.buffer import Dispatched
from olmo_jax.parallel.expert import allgather, ragged, rowwise
from olmo_jax.parallel.expert.allgather import allgather_dispatch
from olmo_jax.parallel.expert.ragged import ragged_dispatch
from olmo_jax.parallel.expert.rowwise import rowwise_dispatch

EXPERT_AXIS = "expert"
BACKENDS = ("rowwise", "ragged", "allgather")  # parallel.dispatch
DROPLESS = ("ragged", "allgather")  # the backends without a capacity
# Rowwise receive slots when model.moe.capacity_factor is 0 (dropless elsewhere): rowwise
# has fixed buffers, and OLMo-core's capacity factor is 1.25.
ROWWISE_CAPACITY_FACTOR = 1.25


def rowwise_capacity_factor(capacity_factor: float) -> float:
    """The capacity factor rowwise dispatch sizes its receive slots with, for
    model.moe.capacity_factor = `capacity_factor` (0 = ROWWISE_CAPACITY_FACTOR)."""
    return capacity_factor or ROWWISE_CAPACITY_FACTOR


def _in_scope(scope: str, fn):
    @functools.wraps(fn)
    def scoped(*args):
        with jax.named_scope(scope):
            return fn(*args)

    return scoped


def _scoped(kind: str, fn, axis: str):
    """Runs fn and its combine under the named scope moe_<kind> (how comms.py attributes
    its collectives), after checking that it runs where mesh axis `axis` is bound."""

    @functools.wraps(fn)
    def dispatcher(*args, **kwargs) -> Dispatched:
        try:
            jax.lax.axis_size(axis)
        except NameError as e:
            raise ValueError(
                f"the {kind} expert-parallel dispatcher runs per device inside jax.shard_map "
                f"over a mesh with axis {axis!r} (olmo_jax.parallel.strategy.ParallelPlan "
                f"does this for the train/eval steps); outside one, build the model without "
                f"a dispatcher"
            ) from e
        with jax.named_scope(f"moe_{kind}"):
            d = fn(*args, **kwargs)
        return d._replace(combine=_in_scope(f"moe_{kind}", d.combine))

    return dispatcher


def make_dispatcher(kind: str, capacity_factor: float = 0.0, axis: str = EXPERT_AXIS,
                    emulate_ragged: bool | None = None):
    """The dispatcher for `parallel.dispatch` (kind), communicating over mesh axis `axis`;
    `capacity_factor` is model.moe.capacity_factor: rowwise's receive slots (0 =
    ROWWISE_CAPACITY_FACTOR); the dropless backends have none."""
    if capacity_factor < 0:
        raise ConfigError(
            f"model.moe.capacity_factor must be >= 0 (0 = dropless), got {capacity_factor}")
    if kind == "rowwise":
        fn = functools.partial(rowwise_dispatch, capacity_factor=rowwise_capacity_factor(capacity_factor),
                               axis=axis)
    elif kind == "ragged":
        fn = functools.partial(ragged_dispatch, axis=axis, emulate=emulate_ragged)
    elif kind == "allgather":
        fn = functools.partial(allgather_dispatch, axis=axis)
    else:
        raise ConfigError(f"parallel.dispatch={kind!r}: choose one of {', '.join(BACKENDS)}")
    return _scoped(kind, fn, axis)


def buffer_rows(kind: str, n_tokens: int, cfg, padding: str, ep: int = 1) -> int:
    """Rows of the buffer the experts run on, per device, for `parallel.dispatch` = kind
    ("local": the MoE layer's own dispatch), n_tokens tokens per device; `cfg` the MoE
    config (rowwise sizes its slots with rowwise_capacity_factor(cfg.capacity_factor));
    `padding` how the expert FFN wants each dropless run padded (a KernelChoice's
    run_padding, olmo_jax/kernels/select.py)."""
    if kind == "rowwise":
        return rowwise.buffer_rows(n_tokens, cfg, padding, ep,
                                   rowwise_capacity_factor(cfg.capacity_factor))
    if kind == "ragged":
        return ragged.buffer_rows(n_tokens, cfg, padding, ep)
    if kind == "allgather":
        return allgather.buffer_rows(n_tokens, cfg, padding, ep)
    if kind == "local":
        return sizing.local_rows(n_tokens, cfg, padding)
    raise ConfigError(f"parallel.dispatch={kind!r}: choose one of {', '.join(BACKENDS)}")


__all__ = [
    "BACKENDS", "DROPLESS", "EXPERT_AXIS", "ROWWISE_CAPACITY_FACTOR", "allgather_dispatch",
    "buffer_rows", "make_dispatcher", "ragged_dispatch", "rowwise_capacity_factor",
    "rowwise_dispatch",
]
