"""Muon's Newton-Schulz on a mesh: every matrix orthogonalized whole, once, by the
data-parallel rank that owns it.

Muon (olmo_jax/optim/muon.py) orthogonalizes each [d, h] matrix of a weight leaf (one per
stacked layer and per local expert). Its momentum is stored like the parameter (zero.py):
under ZeRO-1 split over the leaf's data-parallel axes on `ParamLayout.dim`. The plan
(`ownership`, static, from shapes and layouts) sorts the matrices of each data-parallel
group by size and deals them round-robin to its ranks, so no rank runs Newton-Schulz on
the whole model. Matrices of one shape and split form a group, stacked so each rank's
owned slots are contiguous (the last slots padded with zeros, whose orthogonalization is
zero). Inside one shard_map over the mesh, per group:

  split  (stored split on a matrix axis): all-to-all over the group's axes sends every
         rank's slice of each matrix to its owner ("muon_gather": the owner receives its
         matrices whole), the owner runs Newton-Schulz on them (batched), and the reverse
         all-to-all ("muon_return") gives every rank its slice of every result: the
         all-gather of the results, each rank keeping the slice it stores.
  whole  (replicated over the axes: ZeRO-1 off, or no dimension divides): each rank takes
         its owned slots, orthogonalizes them and the results are all-gathered
         ("muon_return").
  local  (stored split on a batch axis, e.g. layers, or no data-parallel axes: the
         experts of an expert rank with data=1): every rank already holds whole
         matrices, and orthogonalizes exactly those; no communication.

Routed experts are resident on their expert rank, so their matrices are owned among the
data-parallel ranks of that expert rank only (the `data` axis). `expected_collectives`
is what the compiled step must contain (tests/parallel/test_parallel_muon.py), and
`ns_flops_per_device` the Newton-Schulz matmul FLOPs each rank runs (the planner).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec

from olmo_jax.errors import ConfigError
from olmo_jax.optim.muon import MatrixDims, leaf_name, matrix_dims, ns_flops
from olmo_jax.parallel.zero import ParamLayout


@dataclasses.dataclass(frozen=True)
class Leaf:
    name: str
    dims: MatrixDims
    layout: ParamLayout
    local_shape: tuple[int, ...]  # the stored block one device holds
    kind: str  # split | whole | local

    @property
    def order(self) -> tuple[int, ...]:
        return self.dims.batch + self.dims.reduction + self.dims.output

    @property
    def units(self) -> int:  # matrices in the local block
        return math.prod(self.local_shape[a] for a in self.dims.batch)

    @property
    def unit_shape(self) -> tuple[int, ...]:  # one matrix's local block, axes red + out
        return tuple(self.local_shape[a] for a in self.dims.reduction + self.dims.output)

    @property
    def split_axis(self) -> int | None:  # the split axis in a [units, *unit_shape] stack
        if self.kind != "split":
            return None
        return 1 + (self.dims.reduction + self.dims.output).index(self.layout.dim)


@dataclasses.dataclass(frozen=True)
class Group:
    """Matrices of one local shape and split form, owned round-robin over `axes`."""
    kind: str
    axes: tuple[str, ...]
    dp: int
    unit_shape: tuple[int, ...]  # local block of one matrix (split: the stored slice)
    split_axis: int | None
    leaves: tuple[Leaf, ...]
    owner: tuple[int, ...]  # per matrix (leaves' matrices in order): its owning rank
    slots: int  # matrices each rank orthogonalizes (padded)

    @property
    def label(self) -> str:
        shape = "x".join(map(str, self.full_shape))
        return f"{self.kind}_{shape}_{'_'.join(self.axes) or 'none'}"

    @property
    def full_shape(self) -> tuple[int, ...]:
        shape = list(self.unit_shape)
        if self.split_axis is not None:
            shape[self.split_axis - 1] *= self.dp
        return tuple(shape)

    @property
    def matrix(self) -> tuple[int, int]:
        lay = self.leaves[0]
        n_red = len(lay.dims.reduction)
        return math.prod(self.full_shape[:n_red]), math.prod(self.full_shape[n_red:])

    @property
    def n(self) -> int:
        return len(self.owner)

    def positions(self) -> np.ndarray:
        """Slot of each matrix in the rank-major stack [dp * slots] (rank r: r*slots...)."""
        seen = [0] * self.dp
        pos = []
        for r in self.owner:
            pos.append(r * self.slots + seen[r])
            seen[r] += 1
        return np.asarray(pos, np.int32)


@dataclasses.dataclass(frozen=True)
class Ownership:
    groups: tuple[Group, ...]

    def matrices_per_rank(self) -> dict[tuple[str, ...], list[int]]:
        out: dict[tuple[str, ...], list[int]] = {}
        for g in self.groups:
            if g.kind == "local":
                continue
            counts = out.setdefault(g.axes, [0] * g.dp)
            for r in g.owner:
                counts[r] += 1
        return out

    def ns_flops_per_device(self, steps: int) -> int:
        """Newton-Schulz matmul FLOPs one device runs per step (padded slots included)."""
        return sum(g.slots * ns_flops(*g.matrix, steps) for g in self.groups)

    def expected_collectives(self) -> list[tuple[str, str, int]]:
        """(kind, scope, bytes per device) of every collective Muon's step adds, float32."""
        out = []
        for g in self.groups:
            whole = g.slots * math.prod(g.full_shape) * 4  # the owned matrices, whole
            if g.kind == "split":
                out.append(("all-to-all", "muon_gather", whole))
                out.append(("all-to-all", "muon_return", whole))
            elif g.kind == "whole":
                out.append(("all-gather", "muon_return", whole * g.dp))
        return sorted(out)


def _local_shape(shape, spec: PartitionSpec, mesh: Mesh) -> tuple[int, ...]:
    out = []
    for n, entry in zip(shape, tuple(spec) + (None,) * (len(shape) - len(spec)), strict=True):
        axes = () if entry is None else (entry if isinstance(entry, tuple) else (entry,))
        out.append(n // math.prod(mesh.shape[a] for a in axes))
    return tuple(out)


def ownership(abstract_params, layouts, mesh: Mesh) -> Ownership:
    """The static plan for the matrices of `abstract_params` (those `matrix_dims` names)."""
    lays = {leaf_name(p): lay for p, lay in jax.tree_util.tree_leaves_with_path(
        layouts, is_leaf=lambda x: isinstance(x, ParamLayout))}
    leaves = []
    for path, x in jax.tree_util.tree_leaves_with_path(abstract_params):
        name = leaf_name(path)
        dims = matrix_dims(name, len(x.shape))
        if dims is None:
            continue
        lay = lays[name]
        for d, entry in enumerate(tuple(lay.compute) + (None,) * (len(x.shape) - len(lay.compute))):
            if entry is not None and d not in dims.batch:
                raise ConfigError(
                    f"optim.name=muon: parameter {name} is split over {entry} on a matrix axis "
                    f"(compute placement {lay.compute}); Muon needs whole matrices per rank")
        if not lay.axes or lay.dim in dims.batch:
            kind = "local"
        else:
            kind = "whole" if lay.dim is None else "split"
        leaves.append(Leaf(name, dims, lay, _local_shape(x.shape, lay.storage, mesh), kind))
    keyed: dict[tuple, list[Leaf]] = {}
    for leaf in leaves:
        axes = leaf.layout.axes if leaf.kind != "local" else ()
        keyed.setdefault((leaf.kind, axes, leaf.unit_shape, leaf.split_axis), []).append(leaf)
    def full_size(key) -> int:  # elements of one whole matrix of the group
        kind, axes, unit_shape, _ = key
        return math.prod(unit_shape) * (math.prod(mesh.shape[a] for a in axes)
                                        if kind == "split" else 1)

    # Round-robin by size: largest matrices first, dealt on from where the last group ended.
    order = sorted(keyed, key=lambda k: (-full_size(k), k[0], k[1], k[2], k[3] or 0))
    next_rank: dict[tuple[str, ...], int] = {}
    groups = []
    for key in order:
        kind, axes, unit_shape, split_axis = key
        members = tuple(sorted(keyed[key], key=lambda lf: lf.name))
        n = sum(lf.units for lf in members)
        dp = math.prod(mesh.shape[a] for a in axes)
        if kind == "local":
            owner, slots = (0,) * n, n
        else:
            start = next_rank.get(axes, 0)
            owner = tuple((start + i) % dp for i in range(n))
            next_rank[axes] = (start + n) % dp
            slots = max(np.bincount(owner, minlength=dp))
        groups.append(Group(kind, axes, dp, unit_shape, split_axis, members, owner, int(slots)))
    return Ownership(tuple(groups))


def _stack(x, leaf: Leaf):
    """A stored block -> [units, *unit_shape] (matrix axes as red + out)."""
    return jnp.transpose(x, leaf.order).reshape((leaf.units,) + leaf.unit_shape)


def _unstack(y, leaf: Leaf):
    order = leaf.order
    y = y.reshape(tuple(leaf.local_shape[a] for a in order))
    return jnp.transpose(y, tuple(order.index(a) for a in range(len(order))))


def _run_group(g: Group, blocks: dict, ns) -> dict:
    """Inside the shard_map: the group's stored blocks -> their orthogonalized blocks."""
    stack = jnp.concatenate([_stack(blocks[lf.name], lf) for lf in g.leaves], axis=0)
    M, N = g.matrix

    def orthogonalize(x):
        with jax.named_scope(f"muon_ns/{g.label}"):
            return ns(x.reshape(x.shape[0], M, N)).reshape(x.shape)

    if g.kind == "local":
        out = orthogonalize(stack)
    else:
        pos = g.positions()
        slot_of = np.full(g.dp * g.slots, g.n, np.int32)  # pads read the zero row
        slot_of[pos] = np.arange(g.n)
        padded = jnp.concatenate([stack, jnp.zeros((1,) + stack.shape[1:], stack.dtype)])
        ranked = padded[slot_of]  # [dp * slots, ...], rank-major
        if g.kind == "split":
            with jax.named_scope(f"muon_gather/{g.label}"):
                mine = jax.lax.all_to_all(ranked, g.axes, 0, g.split_axis, tiled=True)
            done = orthogonalize(mine)
            with jax.named_scope(f"muon_return/{g.label}"):
                back = jax.lax.all_to_all(done, g.axes, g.split_axis, 0, tiled=True)
        else:
            rank = jax.lax.axis_index(g.axes)
            mine = jax.lax.dynamic_slice_in_dim(ranked, rank * g.slots, g.slots, axis=0)
            done = orthogonalize(mine)
            with jax.named_scope(f"muon_return/{g.label}"):
                back = jax.lax.all_gather(done, g.axes, axis=0, tiled=True)
        out = back[pos]
    results, at = {}, 0
    for lf in g.leaves:
        results[lf.name] = _unstack(out[at:at + lf.units], lf)
        at += lf.units
    return results


def make_orthogonalize(plan: Ownership, mesh: Mesh):
    """orthogonalize(mats, dims, ns) for optim/muon.py's `scale_by_muon`: `mats` (leaf name
    -> momentum in its storage placement) orthogonalized per the ownership plan."""
    leaves = {lf.name: lf for g in plan.groups for lf in g.leaves}

    def orthogonalize(mats: dict, dims: dict, ns) -> dict:
        missing = sorted(set(mats) ^ set(leaves))
        if missing:
            raise ValueError(f"Muon's matrices and the ownership plan differ: {missing}")
        assert all(dims[k] == leaves[k].dims for k in mats), "matrix layouts differ"
        names = sorted(mats)
        specs = tuple(leaves[k].layout.storage for k in names)

        def local(*blocks):
            by_name = dict(zip(names, blocks, strict=True))
            out = {}
            for g in plan.groups:
                out.update(_run_group(g, by_name, ns))
            return tuple(out[k] for k in names)

        # Not differentiated; replicated results come from all-gathers (check_vma off).
        run = jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=specs, check_vma=False)
        return dict(zip(names, run(*(mats[k] for k in names)), strict=True))

    return orthogonalize
