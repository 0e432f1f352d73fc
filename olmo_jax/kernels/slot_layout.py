"""Sender-major slot buffers: the rows an expert-parallel all_to_all delivers.

A rank's receive buffer of rowwise dispatch holds, from each of S senders, G slots of c
rows (one per local expert, the sender's assignments to it, zero-padded to the
capacity), sender by sender: rows [S, G, c], sender-major. Group g (a local expert) owns
slot g of every sender. The grouped-matmul kernels read that layout in place
(olmo_jax/kernels/grouped_matmul.py `senders`); every other expert FFN takes the rows in
group-major order [G, S, c] (`slots_to_groups`), which a transpose of the buffer gives.
"""

from __future__ import annotations

import jax


def slot_rows(n_rows: int, groups: int, senders: int, block: int = 1) -> int:
    """Rows c of one (sender, group) slot; a ValueError unless the buffer splits into
    senders x groups slots of whole `block`-row blocks."""
    c, rem = divmod(n_rows, senders * groups)
    if rem or c % block:
        raise ValueError(
            f"sender-major slots: {n_rows} rows do not split into {senders} senders x "
            f"{groups} groups of whole {block}-row blocks")
    return c


def slots_to_groups(x_MX: jax.Array, groups: int, senders: int) -> jax.Array:
    """Rows of a sender-major buffer [senders, groups, c] in group-major order [groups,
    senders, c]; senders 1: unchanged."""
    if senders == 1:
        return x_MX
    M = x_MX.shape[0]
    c = slot_rows(M, groups, senders)
    return x_MX.reshape(senders, groups, c, -1).swapaxes(0, 1).reshape(x_MX.shape)


def groups_to_slots(x_MX: jax.Array, groups: int, senders: int) -> jax.Array:
    """The inverse of slots_to_groups."""
    if senders == 1:
        return x_MX
    M = x_MX.shape[0]
    c = slot_rows(M, groups, senders)
    return x_MX.reshape(groups, senders, c, -1).swapaxes(0, 1).reshape(x_MX.shape)
