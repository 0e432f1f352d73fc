"""The one table that maps logical axis names (on parameters and activations) to mesh
axes, and the helpers that turn a parameter tree into shardings.

Placement plan (strategy `ddp`, the default: experts resident, tokens travel):
  logical name    mesh axis     meaning
  expert          expert        routed experts are split over the expert axis
  act_batch       data, expert  a batch's rows (tokens) are split over data x expert
  everything else replicated    non-expert weights are replicated (data parallel)
"""

from __future__ import annotations

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from olmo_jax.parallel.mesh import BATCH_AXES

DDP_RULES: dict[str, str | tuple[str, ...] | None] = {
    "expert": "expert",
    "act_batch": BATCH_AXES,
}


def logical_to_spec(names: tuple[str | None, ...], rules=DDP_RULES) -> PartitionSpec:
    return PartitionSpec(*(rules.get(n) if n is not None else None for n in names))


def param_specs(state: nnx.State, rules=DDP_RULES):
    """PartitionSpec per leaf of an nnx.State of Variables (from their logical names)."""
    logical = nnx.get_partition_spec(state)
    return jax.tree.map(
        lambda p: logical_to_spec(tuple(p) if p is not None else (), rules),
        logical,
        is_leaf=lambda x: isinstance(x, PartitionSpec) or x is None,
    )


def param_shardings(state: nnx.State, mesh: Mesh, rules=DDP_RULES):
    return jax.tree.map(
        lambda s: NamedSharding(mesh, s),
        param_specs(state, rules),
        is_leaf=lambda x: isinstance(x, PartitionSpec),
    )


def batch_sharding(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, logical_to_spec(("act_batch", None)))
