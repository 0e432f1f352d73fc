"""Which layers each pipeline stage runs, where every parameter is stored under a
pipeline, and the per-step collectives between storage and the stages' compute copies.

Chunks. The MoE blocks (the stacked `moe_blocks`, L of them) are split into K = P * V
contiguous chunks (P = parallel.pipe, V = parallel.virtual_stages); chunk k = v * P + s
runs on stage s as its virtual stage v. Every chunk has c = ceil(L / K) layer slots:
  uneven counts  each chunk gets floor(L / K) layers and the remainder goes one each to
                 chunks 1, 2, ... (chunk 0 also runs the embedding and the dense-first
                 blocks, chunk K - 1 the head); the slots left over are padding: masked
                 identity layers, computed and discarded (all stages run one program,
                 so a tick lasts as long as the fullest chunk either way);
  impossible     fewer MoE blocks than chunks (L < K) -> ConfigError.
The embedding and the dense-first blocks (`dense_blocks`, a differently shaped stack)
run on stage 0 before chunk 0's MoE layers; the final norm, LM head and loss on stage
P - 1 after chunk K - 1.

Storage. Parameters stay in the model's natural layer order, so checkpoints, conversion
and sampling never see the pipeline. Sharding the `layers` axis itself over `pipe` cannot
express either case above (an interleaved stage holds chunks s, s + P, ...; 61 blocks do
not split over 8 stages), so each parameter is split over `pipe` on another dimension,
with the ZeRO-1 data-parallel split on the same one when both divide (`pipe` innermost):
per device that is the same 1/(pipe x data-parallel) share of every weight a layer-axis
split would give. Once per step, inside the step's shard_map (`gather`), after the cast
of the weights whose compute copies are bf16 (zero.py: both steps below move bf16):
  MoE-block weights   an all_to_all over `pipe` hands every stage the rows of its own
                      chunks ([V * c] slots, chunk by chunk; padding rows hold layer 0),
                      then the ZeRO-1 all-gather over the data axes;
  everything else     all-gathered over `pipe` (the first / last stage use them), then
                      the ZeRO-1 all-gather;
and `reduce` sends the gradients back the same way (reduce-scatter over the data axes,
then the all_to_all back and a scatter into the natural layer rows / a reduce-scatter
over `pipe`). The all_to_all moves the stored shards only: 1/(data-parallel size) of the
bytes of the ZeRO-1 gather that follows it. A dimension that `pipe` does not divide
leaves the parameter whole on every stage (its gradient then all-reduced over `pipe`).
Gradients travel in float32 (the stages sum them in float32 buffers, run.py).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec

from olmo_jax.errors import ConfigError
from olmo_jax.kernels.vma import varying_axes
from olmo_jax.model.params import path_name
from olmo_jax.parallel import zero
from olmo_jax.parallel.mesh import TOKEN_AXES

PIPE = "pipe"
STAGE_KEY = "moe_blocks"  # the stacked layers split into chunks


@dataclasses.dataclass(frozen=True)
class Chunking:
    stages: int  # P
    virtual: int  # V
    n_layers: int  # L: MoE blocks
    sizes: tuple[int, ...]  # layers in chunk k (K entries)

    @property
    def chunks(self) -> int:
        return self.stages * self.virtual

    @property
    def slots(self) -> int:
        """c: layer slots per chunk."""
        return max(self.sizes)

    def chunk_layers(self, k: int) -> list[int]:
        start = sum(self.sizes[:k])
        return list(range(start, start + self.sizes[k]))

    @property
    def rows(self) -> np.ndarray:
        """[P, V * c] int32: the MoE layer in each of a stage's slots (chunk v's slots at
        v * c .. v * c + c - 1); padding slots hold 0."""
        P, V, c = self.stages, self.virtual, self.slots
        rows = np.zeros((P, V * c), np.int32)
        for s in range(P):
            for v in range(V):
                ids = self.chunk_layers(v * P + s)
                rows[s, v * c: v * c + len(ids)] = ids
        return rows

    @property
    def keep(self) -> np.ndarray:
        """[P, V * c] bool: real layer (True) or padding."""
        P, V, c = self.stages, self.virtual, self.slots
        keep = np.zeros((P, V * c), bool)
        for s in range(P):
            for v in range(V):
                keep[s, v * c: v * c + self.sizes[v * P + s]] = True
        return keep

    @property
    def offsets(self) -> np.ndarray:
        """[K] int32: the first MoE layer of chunk k (its rows in the statistics buffer)."""
        return np.cumsum((0,) + self.sizes[:-1]).astype(np.int32)


def chunking(n_moe_layers: int, stages: int, virtual: int) -> Chunking:
    K = stages * virtual
    if n_moe_layers < 1:
        raise ConfigError(
            "parallel.pipe > 1 splits the MoE blocks into stages, but the model has none "
            "(model.n_layers == model.n_dense_layers); use parallel.pipe=1")
    if n_moe_layers < K:
        raise ConfigError(
            f"parallel.pipe x parallel.virtual_stages = {stages} x {virtual} = {K} chunks, "
            f"but the model has only {n_moe_layers} MoE blocks (model.n_layers - "
            f"model.n_dense_layers): every chunk needs at least one; lower parallel.pipe or "
            f"parallel.virtual_stages")
    base, extra = divmod(n_moe_layers, K)
    sizes = [base] * K
    for i in range(extra):  # chunks 1, 2, ...: not chunk 0 (embedding, dense blocks)
        sizes[1 + i] += 1
    return Chunking(stages, virtual, n_moe_layers, tuple(sizes))


@dataclasses.dataclass(frozen=True)
class StageLayout(zero.ParamLayout):
    """zero.ParamLayout (compute / storage specs; `axes`, `dim`: the ZeRO-1 part) plus the
    pipeline's split: `pipe_dim` is the dimension split over `pipe` in storage (None =
    whole on every stage); `stage` marks MoE-block weights (regrouped into chunks)."""

    stage: bool = False
    pipe_dim: int | None = None


def _free_dims(spec, skip_layers: bool) -> list[int]:
    """Dimensions not split in compute (for stacked MoE weights: not the layers axis)."""
    return [d for d, e in enumerate(spec) if e is None and not (skip_layers and d == 0)]


def param_layout(shape: tuple[int, ...], compute: PartitionSpec, mesh: Mesh, shard: bool,
                 stage: bool) -> StageLayout:
    """`compute`: the model's placement (experts over `expert`); `shard`: ZeRO-1."""
    spec = tuple(compute) + (None,) * (len(shape) - len(compute))
    used = zero._used_axes(compute)
    dp_axes = tuple(a for a in TOKEN_AXES if a not in used and mesh.shape[a] > 1)
    dp = math.prod(mesh.shape[a] for a in dp_axes)
    P = mesh.shape[PIPE]
    free = _free_dims(spec, stage)
    storage = list(spec)
    zero_dim = pipe_dim = None
    both = [d for d in free if shard and dp_axes and shape[d] % (dp * P) == 0]
    if both:
        zero_dim = pipe_dim = both[0]
        storage[pipe_dim] = (*dp_axes, PIPE)
    else:
        pipe_dims = [d for d in free if shape[d] % P == 0]
        pipe_dim = pipe_dims[0] if pipe_dims else None
        if pipe_dim is not None:
            storage[pipe_dim] = PIPE
        zero_dims = [d for d in free if d != pipe_dim and shard and dp_axes and shape[d] % dp == 0]
        if zero_dims:
            zero_dim = zero_dims[0]
            storage[zero_dim] = dp_axes if len(dp_axes) > 1 else dp_axes[0]
    return StageLayout(PartitionSpec(*spec), PartitionSpec(*storage), dp_axes, zero_dim,
                       stage=stage, pipe_dim=pipe_dim)


def param_layouts(abstract_params, compute_specs, mesh: Mesh, shard: bool):
    """A tree of StageLayout, the params' structure."""

    def one(path, x, spec):
        stage = path_name(path).split("/")[0] == STAGE_KEY
        return param_layout(x.shape, spec, mesh, shard, stage)

    return jax.tree_util.tree_map_with_path(one, abstract_params, compute_specs)


# ---- per step, inside the shard_map ------------------------------------------------------
def _take_stage_rows(x, rows_PL, pipe_dim):
    """Stored stage weight -> this stage's [V * c] chunk rows (compute layout over pipe)."""
    P, N = rows_PL.shape
    if pipe_dim is None:  # whole on every stage: pick the own rows locally
        mine = jnp.asarray(rows_PL)[jax.lax.axis_index(PIPE)]
        return jnp.take(_varying(x, PIPE), mine, axis=0)
    send = jnp.take(x, jnp.asarray(rows_PL.reshape(-1)), axis=0)  # [P * N, ...]: rows per destination
    recv = jax.lax.all_to_all(send, PIPE, 0, 0, tiled=True)  # [P * N, ...]: pieces per source
    recv = recv.reshape((P, N) + recv.shape[1:])
    # Sources hold consecutive pieces of pipe_dim (pipe innermost): put them side by side.
    recv = jnp.moveaxis(recv, 0, pipe_dim)  # [N, ..., P, piece, ...]
    shape = list(recv.shape)
    shape[pipe_dim: pipe_dim + 2] = [shape[pipe_dim] * shape[pipe_dim + 1]]
    return recv.reshape(shape)


def _put_stage_rows(g, rows_PL, keep_PL, pipe_dim, n_layers):
    """The transpose of _take_stage_rows: this stage's chunk-row gradients -> the stored
    weight's natural rows (summed over the stages that hold them)."""
    P, N = rows_PL.shape
    if pipe_dim is None:
        me = jax.lax.axis_index(PIPE)
        mine, keep = jnp.asarray(rows_PL)[me], jnp.asarray(keep_PL)[me]
        g = g * keep.reshape((N,) + (1,) * (g.ndim - 1)).astype(g.dtype)
        out = jnp.zeros((n_layers,) + g.shape[1:], g.dtype).at[mine].add(g)
        return jax.lax.psum(out, PIPE)
    shape = list(g.shape)
    shape[pipe_dim: pipe_dim + 1] = [P, shape[pipe_dim] // P]
    g = jnp.moveaxis(g.reshape(shape), pipe_dim, 0)  # [P(dest), N, ..., piece, ...]
    g = g.reshape((P * N,) + g.shape[2:])
    back = jax.lax.all_to_all(g, PIPE, 0, 0, tiled=True)  # [P * N]: this device's piece per stage row
    keep = jnp.asarray(keep_PL.reshape(-1)).reshape((P * N,) + (1,) * (back.ndim - 1))
    back = back * keep.astype(back.dtype)
    return jnp.zeros((n_layers,) + back.shape[1:], back.dtype).at[
        jnp.asarray(rows_PL.reshape(-1))].add(back)


def _varying(x, axis: str):
    """x typed as differing over mesh axis `axis` (its gradient stays per device)."""
    return x if axis in varying_axes(x) else jax.lax.pcast(x, axis, to="varying")


def _gather_over_pipe(x, lay: StageLayout, rows_PL):
    if lay.stage:
        return _take_stage_rows(x, rows_PL, lay.pipe_dim)
    if lay.pipe_dim is None:
        return _varying(x, PIPE)
    return jax.lax.all_gather(x, PIPE, axis=lay.pipe_dim, tiled=True)


def _reduce_over_pipe(g, lay: StageLayout, rows_PL, keep_PL, n_layers):
    if lay.stage:
        return _put_stage_rows(g, rows_PL, keep_PL, lay.pipe_dim, n_layers)
    if lay.pipe_dim is None:
        return jax.lax.psum(g, PIPE)
    return jax.lax.psum_scatter(g, PIPE, scatter_dimension=lay.pipe_dim, tiled=True)


def gather(params, layouts, chunks: Chunking):
    """Stored shards -> this stage's compute copies (MoE-block weights: its chunk rows),
    cast to the copies' dtypes first (zero.py), so the pipe step moves them too."""
    rows = chunks.rows
    params = zero.cast(params, layouts)

    def one(path, x, lay):
        with jax.named_scope(f"pipe_gather/{path_name(path)}"):
            return _gather_over_pipe(x, lay, rows)

    return zero.gather(jax.tree_util.tree_map_with_path(one, params, layouts), layouts)


def reduce(grads, layouts, chunks: Chunking):
    """Per-device partial gradients of the compute copies -> the stored placement."""
    rows, keep = chunks.rows, chunks.keep
    grads = zero.reduce(grads, layouts)

    def one(path, g, lay):
        with jax.named_scope(f"pipe_reduce/{path_name(path)}"):
            return _reduce_over_pipe(g, lay, rows, keep, chunks.n_layers)

    return jax.tree_util.tree_map_with_path(one, grads, layouts)
