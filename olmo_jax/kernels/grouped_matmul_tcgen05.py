"""Expert-grouped matmul for Blackwell (sm_100a, sm_103a): tcgen05 MMA into TMEM.

The same three products, contract, row-tile schedule and custom VJP as the Hopper kernel
(olmo_jax/kernels/grouped_matmul.py, whose docstring defines them): each expert's rows
run without padding to a block or to a capacity, bf16/f16 inputs, float32 accumulation;
rows past sum(group_sizes) give zeros; sender-major slot buffers (`senders`) are read in
place, as there. Only the tensor-core step differs:

- gmm: persistent programs over (row tile, column block) pairs of `row_schedule`. The
  K loop is `plgpu.emit_pipeline` (TMA copies into SMEM, `max_concurrent_steps` in
  flight, each slot released one step late) into `plgpu.tcgen05_mma` accumulating in a
  [block_m, block_n] float32 TMEM accumulator. The MMAs are asynchronous: step k arrives
  on barrier k % 2 when its MMA completes and waits for step k - 1's on the other one, so
  one MMA overlaps the next step's TMA wait and no SMEM slot is overwritten while an MMA
  reads it. The epilogue loads TMEM into registers, stores them to SMEM and copies the
  tile's own rows [lo, hi) to HBM with the Hopper kernel's ladder of power-of-two TMA
  boxes. Zero-tail tiles skip the MMA and store zeros.
- tgmm: programs over (group, K block, N block) triples; the pipeline runs over the row
  blocks that meet the group; on a block that straddles the group's ends the rows outside
  it are zeroed in SMEM (both operands) before the MMA of x_block.T @ dy_block.

Requirements as the Hopper kernel's (16-bit operands of one dtype, K and N multiples of
64; `TileConfig.for_shapes`). On a CPU the kernels run in Pallas' GPU interpret mode
(`olmo_jax.kernels.platform.interpret()`): it executes tcgen05_mma as a matmul into a
TMEM buffer, TMEM loads as copies and tracks the barriers, so the schedule, the K
pipeline's barrier protocol, masks and store ladder run there; it does not model TMEM or
SMEM layouts, swizzling or capacity, which the deviceless Blackwell compile
(tests/gpu) checks by lowering the kernel through Mosaic GPU and ptxas for sm_100a and
sm_103a; it has not run on a Blackwell GPU.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from olmo_jax import compat, shapes
from olmo_jax.kernels import grouped_matmul as gm
from olmo_jax.kernels import platform, vma

TileConfig = gm.TileConfig


def _transforms(dtype, minor: int):
    """SMEM tiling and swizzle for a tile whose minor dimension has `minor` elements."""
    itemsize = jnp.dtype(dtype).itemsize
    swizzle = plgpu.find_swizzle(minor * itemsize * 8)
    return (plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle))


def _mma_pipeline(acc_tmem, mma_bar, n_steps, in_specs, operands, lhs, rhs, prologue=None,
                  max_concurrent_steps: int = 4):
    """acc_tmem = sum over the pipeline's steps of lhs(a_smem) @ rhs(b_smem), tcgen05 MMAs
    chained on the two barriers of `mma_bar` (module docstring); returns when the last MMA
    has completed. `prologue(idx, a_smem, b_smem)` runs on each step's SMEM before its MMA."""

    def step(idxs, a_smem, b_smem):
        (k,) = idxs
        if prologue is not None:
            prologue(k, a_smem, b_smem)
        slot = lax.rem(k, 2)
        plgpu.tcgen05_mma(acc_tmem, lhs(a_smem), rhs(b_smem), mma_bar.at[slot],
                          accumulate=k > 0)
        plgpu.barrier_wait(mma_bar.at[1 - slot])

    plgpu.barrier_arrive(mma_bar.at[1])  # step 0 waits on it
    plgpu.emit_pipeline(step, grid=(n_steps,), in_specs=in_specs,
                        max_concurrent_steps=max_concurrent_steps)(*operands)
    plgpu.barrier_wait(mma_bar.at[lax.rem(n_steps - 1, 2)])


def _epilogue(acc_tmem, o_smem, computed):
    """o_smem <- the TMEM accumulator where this tile computed, else zeros."""

    @pl.when(computed)
    def _():
        o_smem[...] = plgpu.async_load_tmem(acc_tmem).astype(o_smem.dtype)
        plgpu.wait_load_tmem()

    @pl.when(jnp.logical_not(computed))
    def _():
        o_smem[...] = jnp.zeros(o_smem.shape, o_smem.dtype)

    plgpu.commit_smem()


def _kernel(body, out_shape, cost, num_programs, interpret, scratch):
    return plgpu.kernel(
        body,
        out_type=out_shape,
        **compat.gpu_kernel_cost(cost),
        grid=(num_programs,),
        grid_names=("sm",),
        scratch_types=scratch,
        compiler_params=plgpu.CompilerParams(
            lowering_semantics=plgpu.LoweringSemantics.Warpgroup
        ),
        interpret=interpret,
    )


# Blackwell's SMEM per block (227 KiB), less room for the barriers and Mosaic's own scratch.
SMEM_BUDGET = 227 * 1024 - 4096


def _stages(want: int, per_step_elems: int, fixed_elems: int, dtype) -> int:
    """The K pipeline's depth: `want` TMA stages, fewer where their SMEM would not fit."""
    item = jnp.dtype(dtype).itemsize
    fit = (SMEM_BUDGET - fixed_elems * item) // (per_step_elems * item)
    return max(2, min(want, fit))


def _mma_barriers():
    return plgpu.Barrier(num_arrivals=1, num_barriers=2, orders_tensor_core=True)


# ----------------------------------------------------------------------------- gmm


@functools.cache
def _gmm_kernel(M, Mp, K, N, G, transpose_rhs, cfg, dtype, num_programs, interpret):
    """The gmm kernel for these static shapes (cached: one trace per configuration)."""
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
    T, grid_n = gm.num_row_tiles(M, G, bm), N // bn
    work, R = T * grid_n, gm.priced(M, cfg)
    x_tf = _transforms(dtype, bk)
    stages = _stages(cfg.max_concurrent_steps, bm * bk + bk * bn, bm * bn, dtype)
    w_block = (bn, bk) if transpose_rhs else (bk, bn)
    w_tf = _transforms(dtype, w_block[1])

    def body(group_ref, block_ref, lo_ref, hi_ref, x_gmem, w_gmem, o_gmem,
             acc_tmem, o_smem, mma_bar):
        @plgpu.nd_loop((work,), collective_axes="sm")
        def _tile(info: plgpu.NDLoopInfo):
            t = lax.div(info.index[0], grid_n)
            ni = lax.rem(info.index[0], grid_n)
            g, blk, lo, hi = group_ref[t], block_ref[t], lo_ref[t], hi_ref[t]
            compute = (g < G) & (hi > lo)

            @pl.when(compute)
            def _():
                in_specs = [
                    plgpu.BlockSpec((bm, bk), lambda k: (blk, k), delay_release=1,
                                    transforms=x_tf),
                    plgpu.BlockSpec(w_block, (lambda k: (ni, k)) if transpose_rhs
                                    else (lambda k: (k, ni)), delay_release=1, transforms=w_tf),
                ]
                _mma_pipeline(
                    acc_tmem, mma_bar, K // bk, in_specs,
                    (x_gmem, w_gmem.at[jnp.minimum(g, G - 1)]),
                    lambda a: a,
                    (lambda b: b.transpose((1, 0))) if transpose_rhs else (lambda b: b),
                    max_concurrent_steps=stages,
                )

            _epilogue(acc_tmem, o_smem, compute)
            gm._store_rows(o_smem, o_gmem, lo - blk * bm, lo, hi - lo, ni * bn, bm, bn)
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    return _kernel(
        body, jax.ShapeDtypeStruct((Mp, N), dtype),
        gm._cost(R, K, N, (R * K, G * K * N, Mp * N), dtype), num_programs, interpret,
        dict(acc_tmem=plgpu.TMEM((bm, bn), jnp.float32),
             o_smem=plgpu.SMEM((bm, bn), dtype), mma_bar=_mma_barriers()),
    )


@shapes.check("w: G * *", "-> M *")  # w [G, K, N], or [G, N, K] with transpose_rhs
def gmm(x_MK, w, group_sizes_G, *, transpose_rhs: bool = False, config: TileConfig | None = None,
        senders: int = 1):
    """Grouped matmul (grouped_matmul.gmm's contract). w is [G, K, N], or [G, N, K] with
    transpose_rhs; `senders` > 1: sender-major slots."""
    gm._check(x_MK, w, "gmm")
    platform.require_kernel_platform("gmm")
    M, K = x_MK.shape
    G = w.shape[0]
    N = w.shape[1] if transpose_rhs else w.shape[2]
    if (w.shape[2] if transpose_rhs else w.shape[1]) != K:
        raise ValueError(f"gmm: x {x_MK.shape} and w {w.shape} (transpose_rhs={transpose_rhs})")
    cfg = config or TileConfig.for_shapes(K, N)
    if K % cfg.block_k or N % cfg.block_n or cfg.block_m not in (64, 128):
        raise ValueError(
            f"gmm: blocks (m={cfg.block_m}, k={cfg.block_k}, n={cfg.block_n}) must divide K={K}, "
            f"N={N}, block_m 64 or 128 (tcgen05 M); TileConfig.for_shapes(K, N) picks such blocks"
        )
    x_pad = gm._pad_rows(x_MK, cfg.block_m)
    sched = gm.row_schedule(group_sizes_G, M, cfg.block_m, senders)
    kernel = _gmm_kernel(
        M, x_pad.shape[0], K, N, G, transpose_rhs, cfg, jnp.dtype(x_MK.dtype),
        gm._num_programs(cfg, gm.num_row_tiles(M, G, cfg.block_m) * (N // cfg.block_n)),
        platform.interpret_params(),
    )
    y = kernel(sched.group_T, sched.block_T, sched.lo_T, sched.hi_T, x_pad, w)
    return vma.like(y[:M], x_MK, w, group_sizes_G)


# ----------------------------------------------------------------------------- tgmm


def _zero_rows_outside(ref, lo, hi):
    """ref[r] = 0 for the rows r of this SMEM tile outside [lo, hi)."""
    rows = lax.broadcasted_iota(jnp.int32, ref.shape, 0)
    v = ref[...]
    ref[...] = jnp.where((rows >= lo) & (rows < hi), v, jnp.zeros_like(v))


@functools.cache
def _tgmm_kernel(M, K, N, G, cfg, dtype, num_programs, interpret, senders=1):
    """The tgmm kernel for these static shapes (cached). The output tile is
    [block_k, block_n] (tcgen05 M = block_k); block_m is the contracting row block."""
    br, bko, bn = cfg.block_m, cfg.block_k, cfg.block_n
    grid_k, grid_n = K // bko, N // bn
    work, R = G * grid_k * grid_n, gm.priced(M, cfg)
    x_tf, dy_tf = _transforms(dtype, bko), _transforms(dtype, bn)
    stages = _stages(cfg.max_concurrent_steps, br * bko + br * bn, bko * bn, dtype)

    def body(starts_ref, ends_ref, x_gmem, dy_gmem, o_gmem, acc_tmem, o_smem, mma_bar):
        @plgpu.nd_loop((work,), collective_axes="sm")
        def _tile(info: plgpu.NDLoopInfo):
            idx = info.index[0]
            g = lax.div(idx, grid_k * grid_n)
            ki = lax.div(lax.rem(idx, grid_k * grid_n), grid_n)
            ni = lax.rem(idx, grid_n)
            start, end = starts_ref[g], ends_ref[g]
            block, n_blocks, may_straddle = gm.tgmm_rows(g, start, end, br, M, G, senders)

            def mask(r, x_smem, dy_smem):
                row0 = block(r) * br

                @pl.when(may_straddle & ((row0 < start) | (row0 + br > end)))
                def _():
                    _zero_rows_outside(x_smem, start - row0, end - row0)
                    _zero_rows_outside(dy_smem, start - row0, end - row0)
                    plgpu.commit_smem()

            @pl.when(n_blocks > 0)
            def _():
                in_specs = [
                    plgpu.BlockSpec((br, bko), lambda r: (block(r), ki), delay_release=1,
                                    transforms=x_tf),
                    plgpu.BlockSpec((br, bn), lambda r: (block(r), ni), delay_release=1,
                                    transforms=dy_tf),
                ]
                _mma_pipeline(acc_tmem, mma_bar, n_blocks, in_specs, (x_gmem, dy_gmem),
                              lambda a: a.transpose((1, 0)), lambda b: b,
                              prologue=mask, max_concurrent_steps=stages)

            _epilogue(acc_tmem, o_smem, n_blocks > 0)
            plgpu.copy_smem_to_gmem(o_smem, o_gmem.at[g, pl.ds(ki * bko, bko), pl.ds(ni * bn, bn)])
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    return _kernel(
        body, jax.ShapeDtypeStruct((G, K, N), dtype),
        gm._cost(R, K, N, (R * K, R * N, G * K * N), dtype), num_programs, interpret,
        dict(acc_tmem=plgpu.TMEM((bko, bn), jnp.float32),
             o_smem=plgpu.SMEM((bko, bn), dtype), mma_bar=_mma_barriers()),
    )


@shapes.check("-> G K N")
def tgmm(x_MK, dy_MN, group_sizes_G, *, config: TileConfig | None = None, senders: int = 1):
    """dw[g] = x[rows of g].T @ dy[rows of g]: [G, K, N] (grouped_matmul.tgmm's contract)."""
    gm._check(x_MK, dy_MN, "tgmm")
    platform.require_kernel_platform("tgmm")
    M, K = x_MK.shape
    N = dy_MN.shape[1]
    G = group_sizes_G.shape[0]
    base = config or TileConfig()
    cfg = dataclasses.replace(
        base,
        block_k=gm._largest_divisor(K, max(base.block_k, 128), minimum=64),  # tcgen05 M
        block_n=gm._largest_divisor(N, base.block_n, minimum=8),
    )
    x_pad, dy_pad = gm._pad_rows(x_MK, cfg.block_m), gm._pad_rows(dy_MN, cfg.block_m)
    ends = jnp.minimum(jnp.cumsum(group_sizes_G.astype(jnp.int32)), M)
    starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])
    work = G * (K // cfg.block_k) * (N // cfg.block_n)
    kernel = _tgmm_kernel(M, K, N, G, cfg, jnp.dtype(x_MK.dtype), gm._num_programs(cfg, work),
                          platform.interpret_params(), senders)
    return vma.like(kernel(starts, ends, x_pad, dy_pad), x_MK, dy_MN, group_sizes_G)


# ----------------------------------------------------------------------------- custom VJP


_grouped_matmul = gm.differentiable(gmm, tgmm)


@shapes.check("-> M N")
def grouped_matmul(x_MK, w_GKN, group_sizes_G, config: TileConfig | None = None, *,
                   priced_rows: int = 0, senders: int = 1):
    """Differentiable grouped matmul on the tcgen05 kernels: forward gmm, input gradient gmm
    against w transposed, weight gradient tgmm; jax.lax.ragged_dot's contract (bf16/f16).
    `priced_rows`, `senders`: as grouped_matmul.grouped_matmul's."""
    config = gm.with_priced_rows(config, priced_rows, *w_GKN.shape[1:])
    return _grouped_matmul(x_MK, w_GKN, group_sizes_G.astype(jnp.int32), config, senders)


__all__ = ["TileConfig", "gmm", "grouped_matmul", "tgmm"]
