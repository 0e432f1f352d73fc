"""The one table that maps logical axis names (on parameters and activations) to mesh
axes, per strategy, and the helpers that turn a parameter tree into specs/shardings.

Logical names come from the model (`olmo_jax/model/params.py`: embed, mlp, vocab,
q_heads, kv_heads, head_dim, expert, router_expert, layers); anything not in a table is
replicated. A parameter has two placements:
  compute  how the model sees it inside the step's shard_map (after any gather);
  storage  how it lives in the TrainState, with its AdamW moments (zero.py adds the
           data-parallel split of ZeRO-1 and FSDP to the compute placement).

Placement (mesh axes pipe x data x context x expert; rows split over data x expert, their
tokens over context; the data-parallel axes below include context when it is > 1):

  strategy          parameter        compute      storage (params + AdamW moments)
  ddp, zero1 on     routed experts   expert       expert, and data on one more dim
  ddp, zero1 on     everything else  replicated   data x expert on one dim
  ddp, zero1 off    routed experts   expert       expert (= compute)
  ddp, zero1 off    everything else  replicated   replicated (= compute)
  fsdp              every parameter  replicated   data x expert on one dim (experts too)

"one dim": the first dimension not already split whose size the data-parallel device
count divides (zero.py); a parameter with no such dimension stays replicated over those
devices. Gradients follow storage: all-reduced (ddp), reduce-scattered (zero1, fsdp).
The golden file tests/parallel/golden/placement.txt lists every leaf for a reference
config.
"""

from __future__ import annotations

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from olmo_jax.parallel.mesh import BATCH_AXES

DDP_RULES: dict[str, str | tuple[str, ...] | None] = {
    "expert": "expert",  # experts resident on their expert-axis rank
    "act_batch": BATCH_AXES,
}
FSDP_RULES: dict[str, str | tuple[str, ...] | None] = {
    "act_batch": BATCH_AXES,  # parameters (experts too) gathered whole for use
}
RULES = {"ddp": DDP_RULES, "fsdp": FSDP_RULES}
STRATEGIES = tuple(RULES)  # parallel.strategy: ddp | fsdp


def is_spec(x) -> bool:
    return isinstance(x, PartitionSpec)


def logical_to_spec(names: tuple[str | None, ...], rules=DDP_RULES) -> PartitionSpec:
    return PartitionSpec(*(rules.get(n) if n is not None else None for n in names))


def param_specs(state: nnx.State, rules=DDP_RULES):
    """Compute PartitionSpec per leaf of an nnx.State of Variables (from logical names)."""
    logical = nnx.get_partition_spec(state)
    return jax.tree.map(
        lambda p: logical_to_spec(tuple(p) if p is not None else (), rules),
        logical,
        is_leaf=lambda x: is_spec(x) or x is None,
    )


def param_shardings(state: nnx.State, mesh: Mesh, rules=DDP_RULES):
    specs = param_specs(state, rules)
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=is_spec)

