"""The grouped matmuls (Hopper and Blackwell kernels) over sender-major slot buffers, the
layout rowwise expert-parallel dispatch receives ([senders, groups, c] rows): in Pallas'
GPU interpret mode, float32, forward, input gradient and weight gradient against
jax.lax.ragged_dot and its autodiff on the same rows in group-major order, within 1e-5 of
each result's largest magnitude (float32 sums of 384 rows in another order). The
slots hold distinct values (none is zero), so a tile that read another group's slot, a
weight gradient that missed a sender's slot or counted one twice, would fail. The
schedule's static tiles are checked row by row, and a buffer that does not split into
whole row blocks per slot is refused."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from olmo_jax.kernels import grouped_matmul as gm
from olmo_jax.kernels import grouped_matmul_tcgen05 as bw
from olmo_jax.kernels import platform
from olmo_jax.kernels.slot_layout import groups_to_slots, slots_to_groups

# 3 senders x 4 groups x 128 rows (two 64-row blocks a slot), K = N = 64 (two K steps,
# two column blocks).
S, G, C, K, N = 3, 4, 128, 64, 64
CFG = gm.TileConfig(block_m=64, block_n=32, block_k=32, max_concurrent_steps=2, num_programs=3)
KERNELS = {"hopper": gm.grouped_matmul, "tcgen05": bw.grouped_matmul}


def _close(got, want):
    got, want = np.asarray(got), np.asarray(want)
    assert np.max(np.abs(got - want)) <= 1e-5 * np.max(np.abs(want))


@pytest.mark.jax011
@pytest.mark.parametrize("kernel", list(KERNELS))
def test_slot_buffers_match_ragged_dot_in_group_major_order(kernel):
    M = S * G * C
    keys = jax.random.split(jax.random.key(7), 3)
    x = jax.random.normal(keys[0], (M, K), jnp.float32)
    w = jax.random.normal(keys[1], (G, K, N), jnp.float32)
    dy = jax.random.normal(keys[2], (M, N), jnp.float32)
    full = jnp.full((G,), S * C, jnp.int32)
    with platform.interpret():
        y, vjp = jax.vjp(lambda a, b: KERNELS[kernel](a, b, full, CFG, senders=S), x, w)
        dx, dw = vjp(dy)

    def group_major(a, b):
        y_g = jax.lax.ragged_dot(slots_to_groups(a, G, S), b, full,
                                 precision=jax.lax.Precision.HIGHEST)
        return groups_to_slots(y_g, G, S)

    y_ref, vjp_ref = jax.vjp(group_major, x, w)
    dx_ref, dw_ref = vjp_ref(dy)
    _close(y, y_ref)
    _close(dx, dx_ref)
    _close(dw, dw_ref)
    _close(y, gm.gmm_reference(x, w, full, senders=S))
    _close(dw, gm.tgmm_reference(x, dy, full, senders=S))


def test_the_slot_schedule_gives_every_row_its_slots_group():
    M, bm = S * G * C, 64
    s = jax.tree.map(np.asarray, gm.slot_schedule(M, G, S, bm))
    assert s.group_T.shape == (gm.num_row_tiles(M, G, bm),)
    owner = np.tile(np.repeat(np.arange(G), C), S)  # row (s * G + g) * C + i -> g
    covered = np.zeros(M, int)
    for g, b, lo, hi in zip(s.group_T, s.block_T, s.lo_T, s.hi_T, strict=True):
        if lo == hi:
            assert g == G  # padding entries compute nothing
            continue
        assert (lo, hi) == (b * bm, (b + 1) * bm) and (owner[lo:hi] == g).all()
        covered[lo:hi] += 1
    assert (covered == 1).all()
    x = np.arange(M)[:, None]
    assert (np.asarray(groups_to_slots(slots_to_groups(x, G, S), G, S)) == x).all()


def test_slots_that_split_row_blocks_are_refused():
    with pytest.raises(ValueError, match="whole 64-row blocks"):
        gm.slot_schedule(S * G * 96, G, S, 64)
