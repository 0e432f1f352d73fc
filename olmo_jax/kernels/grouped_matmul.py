"""Expert-grouped matmul: a Pallas Mosaic GPU kernel (Hopper wgmma) and its jnp reference.

Rows of the left operand are sorted by expert; `group_sizes_G` (on the device) says how
many consecutive rows belong to each expert. Three products, all with float32 accumulation:

    gmm(x_MK, w_GKN, gs)                      y_MN:  y[rows of g] = x[rows of g] @ w[g]
    gmm(dy_MN, w_GKN, gs, transpose_rhs=True) dx_MK: dx[rows of g] = dy[rows of g] @ w[g].T
    tgmm(x_MK, dy_MN, gs)                     dw_GKN: dw[g] = x[rows of g].T @ dy[rows of g]

`grouped_matmul` wires them into one `jax.custom_vjp` (forward, input gradient, weight
gradient). Rows past sum(group_sizes) give zeros and get zero gradient, as with
`jax.lax.ragged_dot`; an empty group's weight gradient is zero.

Tiling. Both kernels are persistent (one program per SM, `plgpu.nd_loop` strides over
the work) and stream operands through SMEM with `plgpu.emit_pipeline` (TMA copies,
`max_concurrent_steps` in flight) into `plgpu.wgmma` with a float32 register accumulator.
- gmm: the work is (row tile, column block) pairs. `tile_schedule` (pure jnp, computed on
  the device from the group sizes) lists the row tiles: each names a group, a row block
  of `block_m` rows and the row range [lo, hi) of that block the tile owns. A block that
  straddles a group boundary appears once per group it meets; each tile multiplies the
  whole block by its own group's weights and stores only its rows, with a ladder of
  power-of-two TMA stores (TMA boxes are static). The rows past sum(group_sizes) form
  one extra "tail" group whose tiles skip the matmul and store zeros. The tile count is
  static: ceil(M / block_m) + G covers every routing.
- tgmm: the work is (group, K block, N block) triples; the pipeline runs over the row
  blocks that meet the group, and on the first and last block rows outside the group are
  zeroed in SMEM (both operands, so non-finite values of a neighbouring group cannot
  leak in) before the wgmma. Empty groups store zeros.

Sender-major slots (`senders` S > 1, static): the rows are a capacity buffer as an
expert-parallel all_to_all delivers it, [S, G, c] (c = M / (S G) rows per sender and
group, a multiple of the row block): group g's rows are S slots of c rows, not one run.
gmm's tiles are then the row blocks themselves, each inside one slot (`slot_schedule`),
and tgmm's pipeline visits group g's S x c / block rows slot by slot; `group_sizes_G` is
not read (every slot is full: empty slots hold zero rows). The products are those of the
group-major buffer (`slot_layout.slots_to_groups`), summed in the same order, without the transposes
between the layouts.

Requirements: 16-bit floating inputs of one dtype; K and N multiples of the block sizes
(`TileConfig.for_shapes` picks blocks that divide them); M is padded to the row block
inside the wrappers. On CPU the kernels run in Pallas' GPU interpret mode (inside
`olmo_jax.kernels.platform.interpret()`), which executes wgmma as a matmul and TMA
copies as copies, so the tiling, the schedule, the masks and the store ladder are all
exercised there; it does not model register/SMEM layouts, swizzling, SMEM capacity or
asynchrony (wgmma_wait is a no-op), which only a GPU run checks (tools/gpu_check.sh).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from olmo_jax import compat, shapes
from olmo_jax.kernels import platform, vma
from olmo_jax.kernels.slot_layout import groups_to_slots, slot_rows, slots_to_groups

# ----------------------------------------------------------------------------- reference


@shapes.check("w_GKN: G * *", "-> M *")  # w [G, N, K] with transpose_rhs
def gmm_reference(x_MK, w_GKN, group_sizes_G, transpose_rhs: bool = False, senders: int = 1):
    """y[rows of g] = x[rows of g] @ w[g] (w[g].T when transpose_rhs), float32
    accumulation, a loop over groups with row masks; rows past sum(group_sizes) are 0.
    `senders` > 1: sender-major slots (module docstring), every slot full."""
    if senders > 1:
        G = w_GKN.shape[0]
        full_G = jnp.full((G,), x_MK.shape[0] // G, jnp.int32)
        y = gmm_reference(slots_to_groups(x_MK, G, senders), w_GKN, full_G, transpose_rhs)
        return groups_to_slots(y, G, senders)
    w = jnp.swapaxes(w_GKN, 1, 2) if transpose_rhs else w_GKN
    mask_GM = group_masks(group_sizes_G, x_MK.shape[0])
    y_MN = jnp.zeros((x_MK.shape[0], w.shape[2]), jnp.float32)
    for g in range(w.shape[0]):
        y_g = jnp.dot(x_MK, w[g], preferred_element_type=jnp.float32)
        y_MN = y_MN + jnp.where(mask_GM[g][:, None], y_g, 0.0)
    return y_MN.astype(x_MK.dtype)


@shapes.check("-> G K N")
def tgmm_reference(x_MK, dy_MN, group_sizes_G, senders: int = 1):
    """dw[g] = x[rows of g].T @ dy[rows of g], float32 accumulation (`senders`: as
    gmm_reference's)."""
    if senders > 1:
        G = group_sizes_G.shape[0]
        full_G = jnp.full((G,), x_MK.shape[0] // G, jnp.int32)
        return tgmm_reference(slots_to_groups(x_MK, G, senders),
                              slots_to_groups(dy_MN, G, senders), full_G)
    mask_GM = group_masks(group_sizes_G, x_MK.shape[0])
    xm_GMK = jnp.where(mask_GM[:, :, None], x_MK[None], 0)
    dw = jnp.einsum("gmk,mn->gkn", xm_GMK, dy_MN, preferred_element_type=jnp.float32)
    return dw.astype(x_MK.dtype)


@shapes.check("-> G *")
def group_masks(group_sizes_G, n_rows: int):
    """mask_GM[g, m]: row m belongs to group g (rows past the total belong to none)."""
    ends_G = jnp.cumsum(group_sizes_G.astype(jnp.int32))
    starts_G = ends_G - group_sizes_G.astype(jnp.int32)
    rows_M = jnp.arange(n_rows, dtype=jnp.int32)
    return (rows_M[None] >= starts_G[:, None]) & (rows_M[None] < ends_G[:, None])


# ----------------------------------------------------------------------------- schedule


class TileSchedule(NamedTuple):
    """Row tiles of gmm, each [lo, hi) of row block `block` for group `group`.

    group == G is the zero tail (rows past sum(group_sizes)); lo == hi marks padding
    entries of the static-length schedule (nothing computed, nothing stored)."""

    group_T: jax.Array
    block_T: jax.Array
    lo_T: jax.Array
    hi_T: jax.Array


def num_row_tiles(n_rows: int, num_groups: int, block_m: int) -> int:
    """Static upper bound on the row tiles: every block once, plus one extra per group
    boundary inside a block (G groups + the tail have at most G inner boundaries)."""
    return -(-n_rows // block_m) + num_groups


@shapes.check("-> *")
def tile_schedule(group_sizes_G, n_rows: int, block_m: int) -> TileSchedule:
    G = group_sizes_G.shape[0]
    sizes = group_sizes_G.astype(jnp.int32)
    ends = jnp.minimum(jnp.cumsum(sizes), n_rows)
    ends = jnp.concatenate([ends, jnp.array([n_rows], jnp.int32)])  # + the zero tail
    starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])
    n_tiles = jnp.where(ends > starts, (ends - 1) // block_m - starts // block_m + 1, 0)
    cum = jnp.cumsum(n_tiles)
    T = num_row_tiles(n_rows, G, block_m)
    t = jnp.arange(T, dtype=jnp.int32)
    group = jnp.minimum(jnp.searchsorted(cum, t, side="right"), G).astype(jnp.int32)
    valid = t < cum[-1]
    block = starts[group] // block_m + t - (cum[group] - n_tiles[group])
    lo = jnp.maximum(starts[group], block * block_m)
    hi = jnp.minimum(ends[group], (block + 1) * block_m)
    zero = jnp.zeros_like(t)
    return TileSchedule(
        group_T=jnp.where(valid, group, G),
        block_T=jnp.where(valid, block, zero),
        lo_T=jnp.where(valid, lo, zero),
        hi_T=jnp.where(valid, hi, zero),
    )


def slot_schedule(n_rows: int, num_groups: int, senders: int, block_m: int) -> TileSchedule:
    """gmm's row tiles over a sender-major slot buffer (module docstring): tile t is row
    block t whole, of group (t // blocks per slot) % G; padding entries up to
    num_row_tiles (static: no group sizes are read)."""
    per_slot = slot_rows(n_rows, num_groups, senders, block_m) // block_m
    n = n_rows // block_m
    t = np.arange(num_row_tiles(n_rows, num_groups, block_m))
    valid = t < n
    arrays = (np.where(valid, (t // per_slot) % num_groups, num_groups), np.where(valid, t, 0),
              np.where(valid, t * block_m, 0), np.where(valid, (t + 1) * block_m, 0))
    return TileSchedule(*(jnp.asarray(a, jnp.int32) for a in arrays))


def row_schedule(group_sizes_G, n_rows: int, block_m: int, senders: int = 1) -> TileSchedule:
    """gmm's row tiles: tile_schedule, or slot_schedule for sender-major slots."""
    if senders > 1:
        return slot_schedule(n_rows, group_sizes_G.shape[0], senders, block_m)
    return tile_schedule(group_sizes_G, n_rows, block_m)


def tgmm_rows(g, start, end, br: int, n_rows: int, num_groups: int, senders: int):
    """(row block of pipeline step r, the number of steps, whether a step's block may hold
    rows of other groups) of tgmm's group g: the blocks from `start` to `end` (its run),
    or for sender-major slots its senders' slots one after another (whole blocks)."""
    if senders > 1:
        nb = slot_rows(n_rows, num_groups, senders, br) // br
        return ((lambda r: (lax.div(r, nb) * num_groups + g) * nb + lax.rem(r, nb)),
                jnp.int32(senders * nb), jnp.bool_(False))
    first = lax.div(start, br)
    return ((lambda r: first + r), jnp.where(end > start, lax.div(end + br - 1, br) - first, 0),
            jnp.bool_(True))


# ----------------------------------------------------------------------------- tiling


@dataclasses.dataclass(frozen=True)
class TileConfig:
    block_m: int = 128  # rows per tile (a multiple of 64: one warpgroup's wgmma M)
    block_n: int = 128
    block_k: int = 64
    max_concurrent_steps: int = 4  # TMA stages in flight
    num_programs: int = 0  # persistent programs; 0 = the device's SM count
    # Rows the kernels declare their cost over (`priced`): the rows routed into the buffer
    # at balanced routing, where a dropless buffer is sized for the worst case; 0: all M.
    priced_rows: int = 0

    @staticmethod
    def for_shapes(k: int, n: int, **kw) -> TileConfig:
        """The config given by kw with block_k and block_n lowered to the largest powers of
        two (at most the given ones) dividing k and n."""
        base = TileConfig(**kw)
        bk = _largest_divisor(k, base.block_k, minimum=16)
        bn = _largest_divisor(n, base.block_n, minimum=8)
        return dataclasses.replace(base, block_k=bk, block_n=bn)


def _largest_divisor(dim: int, start: int, minimum: int) -> int:
    b = start
    while b >= minimum:
        if dim % b == 0:
            return b
        b //= 2
    raise ValueError(
        f"dimension {dim} has no power-of-two block in [{minimum}, {start}] dividing it; "
        f"the Pallas grouped matmul needs it a multiple of {minimum} (use gmm_impl=ragged_dot)"
    )


def _num_programs(cfg: TileConfig, work: int) -> int:
    n = cfg.num_programs or platform.num_sms()
    return max(1, min(n, work))


def _pad_rows(a, multiple: int):
    pad = -a.shape[0] % multiple
    return a if pad == 0 else jnp.pad(a, ((0, pad), (0, 0)))


def _check(x, w, what: str):
    """16-bit operands of one dtype (wgmma); in interpret mode float32 too, so the kernels'
    indexing and masking can be tested at float32 tolerances against the references."""
    allowed = (jnp.bfloat16, jnp.float16)
    if platform.interpret_params() is not None:
        allowed += (jnp.float32,)
    if x.dtype != w.dtype or x.dtype not in allowed:
        raise TypeError(
            f"{what}: the Pallas kernel takes bfloat16/float16 operands of one dtype, got "
            f"{x.dtype} and {w.dtype}"
        )


# ----------------------------------------------------------------------------- gmm


def _fill(o_smem, computed, acc):
    """o_smem <- the accumulator where this tile computed, else zeros (the zero tail and
    empty groups; the accumulator is never read there)."""

    @pl.when(computed)
    def _():
        o_smem[...] = acc.astype(o_smem.dtype)

    @pl.when(jnp.logical_not(computed))
    def _():
        o_smem[...] = jnp.zeros(o_smem.shape, o_smem.dtype)

    plgpu.commit_smem()


def _zero_rows_outside(ref, lo, hi):
    """ref[r] = 0 for the rows r of this SMEM tile outside [lo, hi)."""
    rows = plgpu.layout_cast(lax.broadcasted_iota(jnp.int32, ref.shape, 0), plgpu.Layout.WGMMA)
    inside = (rows >= lo) & (rows < hi)
    v = ref[...]
    ref[...] = jnp.where(inside, v, jnp.zeros_like(v))


def _store_rows(o_smem, o_gmem, src_row, dst_row, n_rows, col, block_m: int, block_n: int):
    """Copy rows [src_row, src_row + n_rows) of o_smem to o_gmem rows starting at dst_row
    (n_rows <= block_m, dynamic) with static power-of-two TMA boxes: one per set bit."""
    size = 1 << (block_m.bit_length() - 1)
    while size >= 1:

        @pl.when((n_rows & size) != 0)
        def _(size=size, src_row=src_row, dst_row=dst_row):
            plgpu.copy_smem_to_gmem(
                o_smem.at[pl.ds(src_row, size)],
                o_gmem.at[pl.ds(dst_row, size), pl.ds(col, block_n)],
            )

        step = n_rows & size
        src_row, dst_row = src_row + step, dst_row + step
        size //= 2


def priced(M: int, cfg: TileConfig) -> int:
    """The rows a kernel over an M-row buffer declares its cost over: cfg.priced_rows (at
    most M) when set, else M. The kernels skip the row tiles past the routed rows, so a
    worst-case dropless buffer costs its routed rows, not M; a declared cost is static, so
    it states the balanced-routing fill the dispatcher gives (olmo_jax/model/moe/buffer.py
    Runs.balanced_rows)."""
    return min(M, cfg.priced_rows) if cfg.priced_rows else M


def _cost(R, K, N, elements, dtype) -> pl.CostEstimate:
    """What a kernel declares to XLA (and the planner, planner/gpu_hlo.py): the grouped
    product's 2 R K N FLOPs over its R priced rows (`priced`; each row meets one group, the
    tiles of a block that straddles groups are not counted twice) and its operands and
    result read and written once."""
    return pl.CostEstimate(flops=int(flops(R, K, N)), transcendentals=0,
                           bytes_accessed=int(sum(elements) * jnp.dtype(dtype).itemsize))


@functools.cache
def _gmm_kernel(M, Mp, K, N, G, transpose_rhs, cfg, dtype, num_programs, interpret):
    """The gmm kernel for these static shapes (cached: one trace per configuration)."""
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
    T, grid_n = num_row_tiles(M, G, bm), N // bn
    work, R = T * grid_n, priced(M, cfg)

    def body(group_ref, block_ref, lo_ref, hi_ref, x_gmem, w_gmem, o_gmem):
        @plgpu.nd_loop((work,), collective_axes="sm")
        def _tile(info: plgpu.NDLoopInfo):
            t = lax.div(info.index[0], grid_n)
            ni = lax.rem(info.index[0], grid_n)
            g, blk, lo, hi = group_ref[t], block_ref[t], lo_ref[t], hi_ref[t]
            compute = (g < G) & (hi > lo)
            w_g = w_gmem.at[jnp.minimum(g, G - 1)]

            def acc_scope(acc_ref):
                @pl.when(compute)
                def _():
                    plgpu.emit_pipeline(
                        lambda _, x_smem, w_smem: plgpu.wgmma(
                            acc_ref, x_smem, w_smem.transpose((1, 0)) if transpose_rhs else w_smem
                        ),
                        grid=(K // bk,),
                        in_specs=[
                            plgpu.BlockSpec((bm, bk), lambda k: (blk, k), delay_release=1),
                            plgpu.BlockSpec(
                                (bn, bk) if transpose_rhs else (bk, bn),
                                (lambda k: (ni, k)) if transpose_rhs else (lambda k: (k, ni)),
                                delay_release=1,
                            ),
                        ],
                        max_concurrent_steps=cfg.max_concurrent_steps,
                    )(x_gmem, w_g)

                return acc_ref[...]

            acc = pl.run_scoped(acc_scope, plgpu.ACC((bm, bn), jnp.float32))

            def store_scope(o_smem):
                _fill(o_smem, compute, acc)
                _store_rows(o_smem, o_gmem, lo - blk * bm, lo, hi - lo, ni * bn, bm, bn)
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)

            pl.run_scoped(store_scope, plgpu.SMEM((bm, bn), o_gmem.dtype))

    return plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((Mp, N), dtype),
        **compat.gpu_kernel_cost(_cost(R, K, N, (R * K, G * K * N, Mp * N), dtype)),
        grid=(num_programs,),
        grid_names=("sm",),
        compiler_params=plgpu.CompilerParams(
            lowering_semantics=plgpu.LoweringSemantics.Warpgroup
        ),
        interpret=interpret,
    )


@shapes.check("w: G * *", "-> M *")  # w [G, K, N], or [G, N, K] with transpose_rhs
def gmm(x_MK, w, group_sizes_G, *, transpose_rhs: bool = False, config: TileConfig | None = None,
        senders: int = 1):
    """Grouped matmul (see module doc). w is [G, K, N], or [G, N, K] with transpose_rhs;
    `senders` > 1: the rows are sender-major slots."""
    _check(x_MK, w, "gmm")
    platform.require_kernel_platform("gmm")
    M, K = x_MK.shape
    G = w.shape[0]
    N = w.shape[1] if transpose_rhs else w.shape[2]
    if (w.shape[2] if transpose_rhs else w.shape[1]) != K:
        raise ValueError(f"gmm: x {x_MK.shape} and w {w.shape} (transpose_rhs={transpose_rhs})")
    cfg = config or TileConfig.for_shapes(K, N)
    if K % cfg.block_k or N % cfg.block_n or cfg.block_m % 64:
        raise ValueError(
            f"gmm: blocks (m={cfg.block_m}, k={cfg.block_k}, n={cfg.block_n}) must divide K={K}, "
            f"N={N} (block_m a multiple of 64); TileConfig.for_shapes(K, N) picks such blocks"
        )
    x_pad = _pad_rows(x_MK, cfg.block_m)
    sched = row_schedule(group_sizes_G, M, cfg.block_m, senders)
    kernel = _gmm_kernel(
        M, x_pad.shape[0], K, N, G, transpose_rhs, cfg, jnp.dtype(x_MK.dtype),
        _num_programs(cfg, num_row_tiles(M, G, cfg.block_m) * (N // cfg.block_n)),
        platform.interpret_params(),
    )
    y = kernel(sched.group_T, sched.block_T, sched.lo_T, sched.hi_T, x_pad, w)
    return vma.like(y[:M], x_MK, w, group_sizes_G)


# ----------------------------------------------------------------------------- tgmm


@functools.cache
def _tgmm_kernel(M, K, N, G, cfg, dtype, num_programs, interpret, senders=1):
    """The tgmm kernel for these static shapes (cached: one trace per configuration).
    The pipeline length is read from the group ends (sender-major slots: static); the row
    count M also sizes the cost estimate (over `priced` rows)."""
    br, bko, bn = cfg.block_m, cfg.block_k, cfg.block_n
    grid_k, grid_n = K // bko, N // bn
    work, R = G * grid_k * grid_n, priced(M, cfg)

    def body(starts_ref, ends_ref, x_gmem, dy_gmem, o_gmem):
        @plgpu.nd_loop((work,), collective_axes="sm")
        def _tile(info: plgpu.NDLoopInfo):
            idx = info.index[0]
            g = lax.div(idx, grid_k * grid_n)
            ki = lax.div(lax.rem(idx, grid_k * grid_n), grid_n)
            ni = lax.rem(idx, grid_n)
            start, end = starts_ref[g], ends_ref[g]
            block, n_blocks, may_straddle = tgmm_rows(g, start, end, br, M, G, senders)

            def acc_scope(acc_ref):
                def step(idxs, x_smem, dy_smem):
                    row0 = block(idxs[0]) * br

                    @pl.when(may_straddle & ((row0 < start) | (row0 + br > end)))
                    def _():
                        _zero_rows_outside(x_smem, start - row0, end - row0)
                        _zero_rows_outside(dy_smem, start - row0, end - row0)
                        plgpu.commit_smem()

                    plgpu.wgmma(acc_ref, x_smem.transpose((1, 0)), dy_smem)
                    plgpu.wgmma_wait(0)

                @pl.when(n_blocks > 0)
                def _():
                    plgpu.emit_pipeline(
                        step,
                        grid=(n_blocks,),
                        in_specs=[
                            plgpu.BlockSpec((br, bko), lambda r: (block(r), ki)),
                            plgpu.BlockSpec((br, bn), lambda r: (block(r), ni)),
                        ],
                        max_concurrent_steps=cfg.max_concurrent_steps,
                    )(x_gmem, dy_gmem)

                return acc_ref[...]

            acc = pl.run_scoped(acc_scope, plgpu.ACC((bko, bn), jnp.float32))

            def store_scope(o_smem):
                _fill(o_smem, n_blocks > 0, acc)
                plgpu.copy_smem_to_gmem(
                    o_smem, o_gmem.at[g, pl.ds(ki * bko, bko), pl.ds(ni * bn, bn)]
                )
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)

            pl.run_scoped(store_scope, plgpu.SMEM((bko, bn), o_gmem.dtype))

    return plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((G, K, N), dtype),
        **compat.gpu_kernel_cost(_cost(R, K, N, (R * K, R * N, G * K * N), dtype)),
        grid=(num_programs,),
        grid_names=("sm",),
        compiler_params=plgpu.CompilerParams(
            lowering_semantics=plgpu.LoweringSemantics.Warpgroup
        ),
        interpret=interpret,
    )


@shapes.check("-> G K N")
def tgmm(x_MK, dy_MN, group_sizes_G, *, config: TileConfig | None = None, senders: int = 1):
    """dw[g] = x[rows of g].T @ dy[rows of g]: [G, K, N] (see module doc; `senders`: as
    gmm's)."""
    _check(x_MK, dy_MN, "tgmm")
    platform.require_kernel_platform("tgmm")
    M, K = x_MK.shape
    N = dy_MN.shape[1]
    G = group_sizes_G.shape[0]
    base = config or TileConfig()
    # Here block_m is the row (contracting) block; the output tile is block_k x block_n.
    cfg = dataclasses.replace(
        base,
        block_k=_largest_divisor(K, max(base.block_k, 64), minimum=64),  # wgmma M >= 64
        block_n=_largest_divisor(N, base.block_n, minimum=8),
    )
    x_pad, dy_pad = _pad_rows(x_MK, cfg.block_m), _pad_rows(dy_MN, cfg.block_m)
    ends = jnp.minimum(jnp.cumsum(group_sizes_G.astype(jnp.int32)), M)
    starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])
    work = G * (K // cfg.block_k) * (N // cfg.block_n)
    kernel = _tgmm_kernel(
        M, K, N, G, cfg, jnp.dtype(x_MK.dtype), _num_programs(cfg, work),
        platform.interpret_params(), senders,
    )
    return vma.like(kernel(starts, ends, x_pad, dy_pad), x_MK, dy_MN, group_sizes_G)


# ----------------------------------------------------------------------------- custom VJP


def differentiable(gmm_fn, tgmm_fn):
    """The grouped matmul over a pair of kernels, one `jax.custom_vjp` with `config` static:
    forward gmm_fn, input gradient gmm_fn against w transposed (its tiles chosen for the
    transposed shapes), weight gradient tgmm_fn; `gmm_fn` and `tgmm_fn` take gmm's and
    tgmm's arguments. This module's kernels and the tcgen05 ones share it."""

    @functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
    def fn(x_MK, w_GKN, group_sizes_G, config, senders):
        return gmm_fn(x_MK, w_GKN, group_sizes_G, config=config, senders=senders)

    def fwd(x_MK, w_GKN, group_sizes_G, config, senders):
        return (gmm_fn(x_MK, w_GKN, group_sizes_G, config=config, senders=senders),
                (x_MK, w_GKN, group_sizes_G))

    def bwd(config, senders, res, dy_MN):
        x_MK, w_GKN, group_sizes_G = res
        dy_MN = dy_MN.astype(x_MK.dtype)
        base = config or TileConfig()
        K, N = w_GKN.shape[1:]
        kw = {f.name: getattr(base, f.name) for f in dataclasses.fields(base)}
        dgrad_cfg = TileConfig.for_shapes(N, K, **kw)  # contracts N, produces K columns
        dx_MK = gmm_fn(dy_MN, w_GKN, group_sizes_G, transpose_rhs=True, config=dgrad_cfg,
                       senders=senders)
        dw_GKN = tgmm_fn(x_MK, dy_MN, group_sizes_G, config=base, senders=senders)
        gs_ct = np.zeros(group_sizes_G.shape, dtype=jax.dtypes.float0)  # integer input
        return (vma.cotangent_like(dx_MK, x_MK),
                vma.cotangent_like(dw_GKN.astype(w_GKN.dtype), w_GKN), gs_ct)

    fn.defvjp(fwd, bwd)
    return fn


_grouped_matmul = differentiable(gmm, tgmm)


def with_priced_rows(config: TileConfig | None, priced_rows: int, K: int, N: int):
    """`config` (default: the one gmm picks for K, N) declaring its cost over priced_rows
    rows; `config` itself when priced_rows is 0."""
    if not priced_rows:
        return config
    return dataclasses.replace(config or TileConfig.for_shapes(K, N), priced_rows=priced_rows)


@shapes.check("-> M N")
def grouped_matmul(x_MK, w_GKN, group_sizes_G, config: TileConfig | None = None, *,
                   priced_rows: int = 0, senders: int = 1):
    """Differentiable grouped matmul on the Pallas kernels: forward gmm, input gradient
    gmm against w transposed, weight gradient tgmm. Same contract as
    jax.lax.ragged_dot(x_MK, w_GKN, group_sizes_G) for bf16/f16 inputs. `priced_rows`
    (static): the rows the three kernels declare their cost over (TileConfig.priced_rows);
    `senders` (static) > 1: the rows are sender-major slots (module docstring)."""
    config = with_priced_rows(config, priced_rows, *w_GKN.shape[1:])
    return _grouped_matmul(x_MK, w_GKN, group_sizes_G.astype(jnp.int32), config, senders)


def flops(n_rows: int, k: int, n: int) -> float:
    """FLOPs of one grouped product over n_rows rows (each row meets one group)."""
    return 2.0 * n_rows * k * n


__all__ = [
    "TileConfig",
    "TileSchedule",
    "flops",
    "gmm",
    "gmm_reference",
    "group_masks",
    "grouped_matmul",
    "num_row_tiles",
    "priced",
    "row_schedule",
    "slot_schedule",
    "tgmm",
    "tgmm_reference",
    "tile_schedule",
    "with_priced_rows",
]
