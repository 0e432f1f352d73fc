"""The routed SwiGLU as a loop of per-expert GEMMs over the padded sorted layout: the
dropless grouped matmul for CPUs (`model.moe.gmm_impl=tiled`; olmo_jax/kernels/select.py).

Layout (`dispatch.padded_plan`): rows sorted by expert, each expert's run padded with
zero rows to a multiple of TILE_MULTIPLE (8), so padding is at most 7 rows per expert.

Compute: a loop over the experts, and inside it over tiles of the expert's own run: as
many full tiles of MAX_TILE rows as fit, then the remainder (a multiple of 8) as at most
one tile of each smaller power of two (256, 128, ..., 8; `lax.cond` skips the others).
Every tile is a dense GEMM of its rows against the expert's weights (gate and up joined
once per expert, a cache-sized copy): no weight is gathered per block and nothing is
expanded over the experts. The trip counts
are the routing's own, so the rows that run are the routed ones plus their padding,
whatever the static buffer size (the expert-parallel backends size theirs for the worst
case: those rows cost memory, not GEMMs). Rows outside every expert's run come out zero.

The SwiGLU's element-wise work runs inside the tile, between its GEMMs. Forward saves x
and the gate/up activations; backward runs the same loop: per tile dh = dy w_down^T,
dx = [dg | du] [w_gate | w_up]^T, and the expert's weight gradients accumulate over its
tiles in the loop carry, written once per expert (no scatter, no one-hot sum).
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

from olmo_jax import shapes
from olmo_jax.kernels import vma
from olmo_jax.kernels.vma import cotangent_like

TILE_MULTIPLE = 8  # each expert's run is padded to a multiple of this many rows
MAX_TILE = 512  # rows of the largest tile (large experts run as many of these)


def tile_sizes(max_tile: int = MAX_TILE, multiple: int = TILE_MULTIPLE) -> tuple[int, ...]:
    """The tile sizes, largest first: max_tile, max_tile / 2, ..., multiple (powers of two)."""
    if max_tile & (max_tile - 1) or multiple & (multiple - 1) or multiple > max_tile:
        raise ValueError(f"tile sizes {max_tile} and {multiple}: powers of two, multiple <= max")
    sizes = [max_tile]
    while sizes[-1] > multiple:
        sizes.append(sizes[-1] // 2)
    return tuple(sizes)


def padded_runs(group_sizes_E: jax.Array, multiple: int = TILE_MULTIPLE):
    """(starts_E, padded_E): where each expert's run begins and its padded length."""
    gs = group_sizes_E.astype(jnp.int32)
    padded_E = (gs + multiple - 1) // multiple * multiple
    return jnp.cumsum(padded_E) - padded_E, padded_E


def _for_tiles(start, n, sizes, tile, carry):
    """carry = tile(carry, row0, size) over the tiles covering rows [start, start + n);
    n is a multiple of sizes[-1]."""
    big = sizes[0]
    carry = jax.lax.fori_loop(0, n // big, lambda t, c: tile(c, start + t * big, big), carry)
    row0, rest = start + n // big * big, n % big
    for s in sizes[1:]:
        hit = (rest & s) != 0
        carry = jax.lax.cond(hit, lambda c, r=row0, s=s: tile(c, r, s), lambda c: c, carry)
        row0 = row0 + jnp.where(hit, s, 0)
    return carry


def _rows(a, row0, size):
    return jax.lax.dynamic_slice_in_dim(a, row0, size, axis=0)


def _put(a, rows, row0):
    return jax.lax.dynamic_update_slice_in_dim(a, rows, row0, axis=0)


def _fwd_loop(x_RD, starts_E, padded_E, wg_EDF, wu_EDF, wd_EFD, sizes):
    R, D = x_RD.shape
    E, F, _ = wd_EFD.shape

    def expert(e, carry):
        # [w_gate | w_up] of this expert only (cache-sized; no [E, D, 2F] copy)
        wgu_DJ, wd_FD = jnp.concatenate([wg_EDF[e], wu_EDF[e]], axis=-1), wd_EFD[e]

        def tile(c, row0, size):
            y_RD, gu_RJ = c
            gu_tJ = _rows(x_RD, row0, size) @ wgu_DJ
            h_tF = jax.nn.silu(gu_tJ[:, :F]) * gu_tJ[:, F:]
            return _put(y_RD, h_tF @ wd_FD, row0), _put(gu_RJ, gu_tJ, row0)

        return _for_tiles(starts_E[e], padded_E[e], sizes, tile, carry)

    ops = (x_RD, starts_E, padded_E, wg_EDF, wu_EDF, wd_EFD)  # carries vary like all of them
    init = (jnp.zeros((R, D), x_RD.dtype), jnp.zeros((R, 2 * F), x_RD.dtype))
    return jax.lax.fori_loop(0, E, expert, tuple(vma.like(a, *ops) for a in init))


def _bwd_loop(x_RD, gu_RJ, dy_RD, starts_E, padded_E, wg_EDF, wu_EDF, wd_EFD, sizes):
    E, F, _ = wd_EFD.shape
    ops = (x_RD, gu_RJ, dy_RD, starts_E, padded_E, wg_EDF, wu_EDF, wd_EFD)

    def expert(e, carry):
        dx_RD, dwg_EDF, dwu_EDF, dwd_EFD = carry
        wgu_DJ, wd_FD = jnp.concatenate([wg_EDF[e], wu_EDF[e]], axis=-1), wd_EFD[e]

        def tile(c, row0, size):
            dx_RD, dwgu_DJ, dwd_FD = c
            x_tD, dy_tD = _rows(x_RD, row0, size), _rows(dy_RD, row0, size)
            gu_tJ = _rows(gu_RJ, row0, size)
            g_tF, u_tF = gu_tJ[:, :F], gu_tJ[:, F:]
            sig_tF = jax.nn.sigmoid(g_tF)
            act_tF = g_tF * sig_tF
            dh_tF = dy_tD @ wd_FD.T
            dwd_FD = dwd_FD + (act_tF * u_tF).T @ dy_tD
            dgu_tJ = jnp.concatenate(
                [dh_tF * u_tF * (sig_tF * (1 + g_tF * (1 - sig_tF))), dh_tF * act_tF], axis=-1)
            dwgu_DJ = dwgu_DJ + x_tD.T @ dgu_tJ
            return _put(dx_RD, dgu_tJ @ wgu_DJ.T, row0), dwgu_DJ, dwd_FD

        acc = tuple(vma.like(jnp.zeros_like(w), *ops) for w in (wgu_DJ, wd_FD))
        dx_RD, dwgu_DJ, dwd_FD = _for_tiles(starts_E[e], padded_E[e], sizes, tile, (dx_RD, *acc))
        put = jax.lax.dynamic_update_index_in_dim
        return (dx_RD, put(dwg_EDF, dwgu_DJ[:, :F], e, 0), put(dwu_EDF, dwgu_DJ[:, F:], e, 0),
                put(dwd_EFD, dwd_FD, e, 0))

    init = (jnp.zeros_like(x_RD), jnp.zeros_like(wg_EDF), jnp.zeros_like(wu_EDF),
            jnp.zeros_like(wd_EFD))
    return jax.lax.fori_loop(0, E, expert, tuple(vma.like(a, *ops) for a in init))


@partial(jax.custom_vjp, nondiff_argnums=(5,))
def _ffn_tiled(x_RD, group_sizes_E, w_gate_EDF, w_up_EDF, w_down_EFD, sizes):
    return _ffn_tiled_fwd(x_RD, group_sizes_E, w_gate_EDF, w_up_EDF, w_down_EFD, sizes)[0]


def _ffn_tiled_fwd(x_RD, group_sizes_E, w_gate_EDF, w_up_EDF, w_down_EFD, sizes):
    starts_E, padded_E = padded_runs(group_sizes_E, sizes[-1])
    y_RD, gu_RJ = _fwd_loop(x_RD, starts_E, padded_E, w_gate_EDF, w_up_EDF, w_down_EFD, sizes)
    return y_RD, (x_RD, gu_RJ, group_sizes_E, w_gate_EDF, w_up_EDF, w_down_EFD)


def _ffn_tiled_bwd(sizes, res, dy_RD):
    x_RD, gu_RJ, group_sizes_E, w_gate_EDF, w_up_EDF, w_down_EFD = res
    starts_E, padded_E = padded_runs(group_sizes_E, sizes[-1])
    dx_RD, dwg_EDF, dwu_EDF, dwd_EFD = _bwd_loop(
        x_RD, gu_RJ, dy_RD.astype(x_RD.dtype), starts_E, padded_E, w_gate_EDF, w_up_EDF,
        w_down_EFD, sizes)
    return (cotangent_like(dx_RD, x_RD), None, cotangent_like(dwg_EDF, w_gate_EDF),
            cotangent_like(dwu_EDF, w_up_EDF), cotangent_like(dwd_EFD, w_down_EFD))


_ffn_tiled.defvjp(_ffn_tiled_fwd, _ffn_tiled_bwd)


@shapes.check("-> R D")
def ffn_tiled(x_RD, group_sizes_E, w_gate_EDF, w_up_EDF, w_down_EFD,
              sizes: tuple[int, ...] | None = None):
    """SwiGLU over the padded sorted layout: expert e's group_sizes_E[e] rows start at
    row sum_{e' < e} pad8(group_sizes_E[e']); rows outside the runs give zeros. `sizes`:
    the tile sizes (default tile_sizes()); the last is the padding multiple."""
    sizes = tile_sizes() if sizes is None else tuple(sizes)
    # Tiles larger than the buffer never fit a run: the largest that does leads the loop.
    sizes = tuple(s for s in sizes[:-1] if s <= x_RD.shape[0]) + sizes[-1:]
    return _ffn_tiled(x_RD, group_sizes_E.astype(jnp.int32), w_gate_EDF, w_up_EDF,
                      w_down_EFD, sizes)
