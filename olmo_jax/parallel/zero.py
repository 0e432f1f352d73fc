"""Data-parallel sharding of stored parameters and optimizer state (ZeRO-1 and FSDP),
and the collectives that move between stored and compute placements.

A parameter replicated over some token axes in its compute placement (its data-parallel
axes: data x context x expert for non-expert weights, data x context for experts; a mesh
axis of size 1 drops out) is stored split over those
axes on one dimension (`ParamLayout.dim`).

Compute copies in the compute dtype. A weight the model casts to the compute dtype at
every use (model/params.py CAST_AT_USE; `ParamLayout.dtype`, set by the plan for a
bfloat16 model) is cast from its float32 shard before it is gathered (`cast`), so the
gather moves bf16 and the gathered copy is bf16; the model's own cast is then a no-op and
every value is the same. The float32 master weights and AdamW moments stay sharded.
Gradients w.r.t. such a copy are summed over the microbatches in float32 (the trainer's
step, the pipeline's stage buffers) and reduced in float32. With dtype None (a float32
model, or a weight used in float32) nothing is cast.

Inside the step's shard_map:
  ZeRO-1 (ddp): `gather` all-gathers the (cast) shards once per step; gradients w.r.t.
         the gathered copy stay per-device partial float32 sums through the microbatch
         loop and `reduce` reduce-scatters them once; AdamW then updates only the local
         shard (outside the shard_map, elementwise), and the next step's gather is the
         all-gather of the updated shards.
  DDP without ZeRO: `gather` only marks the replicated copy per-device (no
         communication); `reduce` all-reduces the gradients.
  FSDP:  `gather_for_use` all-gathers inside every microbatch's loss; autodiff turns
         the gather into the reduce-scatter of that microbatch's gradients (a cast copy's:
         in float32, `_cast_gather`'s VJP).
Each collective runs under a named scope "zero/<param path>" so the HLO accounting
(comms.py) can attribute it.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec

from olmo_jax.model.params import path_name
from olmo_jax.parallel.mesh import TOKEN_AXES


@dataclasses.dataclass(frozen=True)
class ParamLayout:
    compute: PartitionSpec  # placement the model sees inside shard_map
    storage: PartitionSpec  # placement in the TrainState (and of the AdamW moments)
    axes: tuple[str, ...]  # data-parallel axes (size > 1) the compute copy is replicated over
    dim: int | None  # the dimension split over `axes` in storage (None = kept replicated)
    dtype: str | None = None  # the compute copy's dtype, cast before the gather (None: stored)


def _used_axes(spec: PartitionSpec) -> set[str]:
    used = set()
    for entry in spec:
        if entry is None:
            continue
        used.update(entry if isinstance(entry, tuple) else (entry,))
    return used


def param_layout(shape: tuple[int, ...], compute: PartitionSpec, mesh: Mesh,
                 shard: bool) -> ParamLayout:
    """Storage placement: `compute` plus, when `shard`, its data-parallel axes on the first
    free dimension they divide."""
    spec = tuple(compute) + (None,) * (len(shape) - len(compute))
    axes = tuple(a for a in TOKEN_AXES if a not in _used_axes(compute) and mesh.shape[a] > 1)
    dp = math.prod(mesh.shape[a] for a in axes)
    dim = None
    if shard and axes:
        free = [d for d, (n, e) in enumerate(zip(shape, spec, strict=True))
                if e is None and n % dp == 0]
        dim = free[0] if free else None
    storage = list(spec)
    if dim is not None:
        storage[dim] = axes if len(axes) > 1 else axes[0]
    return ParamLayout(PartitionSpec(*spec), PartitionSpec(*storage), axes, dim)


def _scoped(prefix: str, fn):
    def apply(path, x, lay):
        with jax.named_scope(f"{prefix}/{path_name(path)}"):
            return fn(x, lay)

    return apply


def _map(fn, prefix, tree, layouts):
    return jax.tree_util.tree_map_with_path(_scoped(prefix, fn), tree, layouts)


def _gather(x, lay: ParamLayout):
    if lay.dim is not None:
        return jax.lax.all_gather(x, lay.axes, axis=lay.dim, tiled=True)
    return jax.lax.pcast(x, lay.axes, to="varying") if lay.axes else x


def _reduce(g, lay: ParamLayout):
    if lay.dim is not None:
        return jax.lax.psum_scatter(g, lay.axes, scatter_dimension=lay.dim, tiled=True)
    return jax.lax.psum(g, lay.axes) if lay.axes else g


def _cast(x, lay: ParamLayout):
    return x if lay.dtype is None else x.astype(lay.dtype)


def _gather_for_use(x, lay: ParamLayout):
    if lay.dtype is not None:
        return _cast_gather(x, lay)
    return jax.lax.all_gather(x, lay.axes, axis=lay.dim, tiled=True) if lay.dim is not None else x


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _cast_gather(x, lay: ParamLayout):
    """FSDP's gather of a compute copy in lay.dtype (cast first: the gather moves it), whose
    VJP reduces the gradient in x's dtype (float32), not in the copy's."""
    y = _cast(x, lay)
    if lay.dim is not None:
        return jax.lax.all_gather(y, lay.axes, axis=lay.dim, tiled=True)
    return jax.lax.pcast(y, lay.axes, to="varying") if lay.axes else y


def _cast_gather_fwd(x, lay):
    return _cast_gather(x, lay), jnp.zeros((0,), x.dtype)  # the residual: x's dtype only


def _cast_gather_bwd(lay, res, ct):
    ct = ct.astype(res.dtype)
    if lay.dim is not None:
        return (jax.lax.psum_scatter(ct, lay.axes, scatter_dimension=lay.dim, tiled=True),)
    return (jax.lax.psum(ct, lay.axes) if lay.axes else ct,)


_cast_gather.defvjp(_cast_gather_fwd, _cast_gather_bwd)


def cast(params, layouts):
    """Stored shards -> the same shards in their compute copies' dtypes (before a gather)."""
    return jax.tree.map(_cast, params, layouts)


def gather(params, layouts):
    """Stored shards -> per-device compute copies whose gradients stay partial (ddp); cast
    to the copies' dtypes first."""
    return _map(_gather, "zero_gather", cast(params, layouts), layouts)


def reduce(grads, layouts):
    """Per-device partial gradients -> stored placement (reduce-scatter or all-reduce)."""
    return _map(_reduce, "zero_reduce", grads, layouts)


def gather_for_use(params, layouts):
    """FSDP: stored shards -> whole parameters, inside the loss (autodiff reduce-scatters)."""
    return _map(_gather_for_use, "fsdp_gather", params, layouts)


def per_device_bytes(tree, shardings) -> int:
    """Bytes one device holds of `tree` (arrays or ShapeDtypeStructs) under `shardings`."""
    leaves = jax.tree.leaves(tree)
    shs = jax.tree.leaves(shardings, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))
    assert len(leaves) == len(shs), (len(leaves), len(shs))
    return sum(math.prod(sh.shard_shape(x.shape)) * np.dtype(x.dtype).itemsize
               for x, sh in zip(leaves, shs, strict=True))
