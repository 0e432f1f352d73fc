"""Expert-parallel dispatchers: experts stay resident on their `expert`-axis rank, tokens
travel to them. Each runs per device inside `shard_map` (the trainer's step runs the
whole model that way) and has the MoE layer's dispatcher signature

    dispatcher(x_SD, routing, experts, moe_cfg, dtype) -> (y_SD float32, dropped)

with x_SD / routing the device's own tokens, `experts` holding its E/ep local experts
(expert e lives on rank e // (E/ep) as local expert e % (E/ep)) and `dropped` the number
of this device's (token, choice) assignments dropped at capacity. Backends:

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

from olmo_jax.model.config import ConfigError
from olmo_jax.parallel.expert.allgather import allgather_dispatch
from olmo_jax.parallel.expert.ragged import ragged_dispatch
from olmo_jax.parallel.expert.rowwise import rowwise_dispatch, slots_per_expert

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


def _scoped(kind: str, fn, axis: str):
    """Runs fn under the named scope moe_<kind> (how comms.py attributes its collectives),
    after checking that it runs where mesh axis `axis` is bound."""

    @functools.wraps(fn)
    def dispatcher(*args, **kwargs):
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
            return fn(*args, **kwargs)

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


__all__ = [
    "BACKENDS", "DROPLESS", "EXPERT_AXIS", "ROWWISE_CAPACITY_FACTOR", "allgather_dispatch",
    "make_dispatcher", "ragged_dispatch", "rowwise_capacity_factor", "rowwise_dispatch", "slots_per_expert",
]
