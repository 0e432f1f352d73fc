"""Static sizes of the expert buffers: the one place the MoE layer, the expert-parallel
dispatch backends (olmo_jax/parallel/expert) and the planner take them from.

A buffer holds n (token, choice) assignments for G groups (experts, or a rank's local
experts) in one of two layouts (olmo_jax/model/moe/buffer.py):
  slots  every group owns C = capacity(...) rows; assignments past C are dropped;
  runs   dropless: each group's assignments form one run, padded to a multiple of
         `run_multiple(padding, n, G)` rows (1: back to back, the sorted layout), in a
         static buffer of `runs_rows(n, G, multiple)` rows that fits any routing.
"""

from __future__ import annotations

import math

from olmo_jax.model.moe.tiled import TILE_MULTIPLE


def capacity(n_tokens: int, top_k: int, num_experts: int, capacity_factor: float) -> int:
    """C = ceil(capacity_factor * tokens * k / E), at least 1: rows per expert of a
    capacity buffer (the MoE layer), and receive slots per (sender, expert) of rowwise
    dispatch, n_tokens being the sender's tokens."""
    return max(1, math.ceil(capacity_factor * n_tokens * top_k / num_experts))


def block_size(n_assignments: int, groups: int) -> int:
    """Rows per block of the blocked dropless layout: large enough for efficient matmuls,
    small enough that padding (at most one block per group) stays a small fraction."""
    target = max(8, n_assignments // (4 * groups))
    return min(256, 1 << (target.bit_length() - 1))


def padded_rows(n_assignments: int, groups: int, multiple: int) -> int:
    """Static row count that fits any routing once each group's run is padded to a
    multiple of `multiple` rows."""
    return (-(-n_assignments // multiple) + groups - 1) * multiple


def run_multiple(padding: str, n_assignments: int, groups: int) -> int:
    """The multiple each group's run of the dropless layout is padded to, for the expert
    FFN's requirement `padding` (kernels.select.RUN_PADDINGS: a KernelChoice's
    run_padding): block_size rows ("blocks", the blocked einsum), TILE_MULTIPLE rows
    ("tiles", the tiled per-expert loop), 1 ("none", the grouped GEMMs)."""
    if padding == "blocks":
        return block_size(n_assignments, groups)
    if padding == "tiles":
        return TILE_MULTIPLE
    if padding == "none":
        return 1
    raise ValueError(f"unknown run padding {padding!r}: one of blocks, tiles, none")


def runs_rows(n_assignments: int, groups: int, multiple: int) -> int:
    """Rows of a dropless buffer whose runs are padded to `multiple` (1: n_assignments)."""
    return n_assignments if multiple == 1 else padded_rows(n_assignments, groups, multiple)


def local_rows(n_tokens: int, cfg, padding: str) -> int:
    """Rows of the MoE layer's own (single-device) buffer for n_tokens tokens: E capacity
    buffers when cfg.capacity_factor > 0, else E dropless runs padded as `padding` says."""
    E, n = cfg.num_experts, n_tokens * cfg.top_k
    if cfg.capacity_factor > 0:
        return E * capacity(n_tokens, cfg.top_k, E, cfg.capacity_factor)
    return runs_rows(n, E, run_multiple(padding, n, E))
