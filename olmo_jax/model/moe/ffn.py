"""The routed experts' SwiGLU over a dispatched buffer: the one place that chooses the
expert FFN from the buffer's group layout (olmo_jax/model/moe/buffer.py), the resolved
gmm_impl and model.moe.precision.

  Slots  ragged_dot, pallas, pallas_tcgen05, blas: the grouped GEMM with every group `capacity` rows;
         einsum, tiled: one batched product over the [G, C, D] capacity buffers.
         Sender-major slots (`senders` > 1, rowwise dispatch's receive buffer): pallas and
         pallas_tcgen05 read them in place (bf16, slots of whole 128-row blocks); every
         other FFN runs on the rows transposed to group-major order and back.
  Runs   einsum: the blocked batched matmul (runs padded to blocks, each block's owner
         from the run sizes); tiled: the per-expert GEMM loop (runs padded to 8 rows);
         ragged_dot, pallas, pallas_tcgen05, blas: the grouped GEMM over the runs
bf16 FFNs: olmo_jax/model/moe/experts.py, tiled.py and (float32 on CPU, one BLAS SGEMM
per expert) olmo_jax/kernels/cpu_gmm.py; MXFP8: mxfp8_experts.py.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from olmo_jax import shapes
from olmo_jax.kernels.slot_layout import groups_to_slots, slots_to_groups
from olmo_jax.model import mxfp8_gemm
from olmo_jax.model.config import MoEConfig
from olmo_jax.model.moe import dispatch, experts, mxfp8_experts, tiled
from olmo_jax.model.moe.buffer import GroupLayout, Runs, Slots

GROUPED_GEMMS = ("ragged_dot", "pallas", "pallas_tcgen05")


class ExpertFFNs(NamedTuple):
    """The expert feed-forward per layout, with experts.ffn_* signatures."""

    ragged: object  # (x_RD, group_sizes_E, w_gate, w_up, w_down) -> y_RD
    batched: object  # (x_ECD, w_gate_EDF, w_up_EDF, w_down_EFD) -> y_ECD
    blocked: object  # (x_RD, block_expert_U, w_gate, w_up, w_down) -> y_RD
    tiled: object  # (x_RD, group_sizes_E, w_gate, w_up, w_down) -> y_RD, padded layout


def expert_ffns(cfg: MoEConfig, impl: str, mxfp8_impl: str = "auto",
                priced_rows: int = 0, senders: int = 1) -> ExpertFFNs:
    """The expert FFNs for cfg.precision; `impl` (resolved gmm_impl) picks the ragged
    product: jax.lax.ragged_dot, or the Pallas grouped matmul for "pallas" (Hopper) and
    "pallas_tcgen05" (Blackwell), declaring its cost over `priced_rows` rows (0: the
    buffer's) and reading sender-major slots for `senders` > 1; `mxfp8_impl`
    (model.mxfp8_gemm_impl) the MXFP8 GEMM."""
    if cfg.precision == "bf16":
        if impl == "pallas":
            from olmo_jax.kernels.grouped_matmul import grouped_matmul

            gmm = functools.partial(grouped_matmul, priced_rows=priced_rows, senders=senders)
            ragged = functools.partial(experts.ffn_ragged, gmm=gmm)
        elif impl == "pallas_tcgen05":
            from olmo_jax.kernels.grouped_matmul_tcgen05 import grouped_matmul

            gmm = functools.partial(grouped_matmul, priced_rows=priced_rows, senders=senders)
            ragged = functools.partial(experts.ffn_ragged, gmm=gmm)
        else:
            ragged = experts.ffn_ragged
        return ExpertFFNs(ragged, experts.ffn_batched, experts.ffn_blocked, tiled.ffn_tiled)
    rounding, qw, mi = "rceil", cfg.mxfp8_wgrad, mxfp8_impl
    def grouped(sizes_E):
        if impl == "pallas":
            return mxfp8_gemm.Pallas(sizes_E, priced_rows)
        return mxfp8_gemm.Ragged(sizes_E)

    def ragged_mx(x_RD, group_sizes_E, w_gate, w_up, w_down):
        layout = grouped(group_sizes_E.astype(jnp.int32))
        return mxfp8_experts.swiglu(x_RD, w_gate, w_up, w_down, layout, rounding, qw, mi)

    def batched_mx(x_ECD, w_gate, w_up, w_down):
        return mxfp8_experts.swiglu(x_ECD, w_gate, w_up, w_down, mxfp8_gemm.Batched(), rounding, qw,
                                    mi)

    def blocked_mx(x_RD, block_expert_U, w_gate, w_up, w_down):
        R, D = x_RD.shape
        nb = block_expert_U.shape[0]
        x_UbD = x_RD.reshape(nb, R // nb, D)
        y = mxfp8_experts.swiglu(x_UbD, w_gate, w_up, w_down, mxfp8_gemm.Blocked(block_expert_U),
                                 rounding, qw, mi)
        return y.reshape(R, D)

    def tiled_mx(*args):
        raise ValueError("model.moe.gmm_impl=tiled has no MXFP8 version: use gmm_impl=auto or einsum")

    return ExpertFFNs(ragged_mx, batched_mx, blocked_mx, tiled_mx)


@shapes.check("-> R D")
def expert_ffn(x_RD: jax.Array, layout: GroupLayout, weights, cfg: MoEConfig,
               impl: str, mxfp8_impl: str = "auto") -> jax.Array:
    """y_RD: every group's SwiGLU over its rows; `weights` (w_gate, w_up, w_down) hold
    one expert per group, in the compute dtype; `mxfp8_impl`: model.mxfp8_gemm_impl."""
    if isinstance(layout, Slots) and layout.senders > 1 and not reads_slots(impl, cfg, layout):
        G, S = layout.groups, layout.senders
        y_RD = expert_ffn(slots_to_groups(x_RD, G, S), Slots(G, layout.capacity), weights, cfg,
                          impl, mxfp8_impl)
        return groups_to_slots(y_RD, G, S)
    if impl == "blas":
        return _ffn_blas(x_RD, layout, weights)
    ffn = expert_ffns(cfg, impl, mxfp8_impl,
                      priced_rows=layout.balanced_rows if isinstance(layout, Runs) else 0,
                      senders=layout.senders if isinstance(layout, Slots) else 1)
    if isinstance(layout, Slots):
        G, C = layout.groups, layout.capacity
        if impl in GROUPED_GEMMS:
            return ffn.ragged(x_RD, jnp.full((G,), C, jnp.int32), *weights)
        return ffn.batched(x_RD.reshape(G, C, -1), *weights).reshape(G * C, -1)
    if not isinstance(layout, Runs):
        raise TypeError(f"expert_ffn: unknown group layout {type(layout).__name__}")
    if impl == "einsum":
        owner_U = dispatch.block_owners(layout.sizes_E, x_RD.shape[0], layout.multiple)
        return ffn.blocked(x_RD, owner_U, *weights)
    if impl == "tiled":  # runs only the rows of the runs, however large the buffer
        return ffn.tiled(x_RD, layout.sizes_E, *weights)
    if impl in GROUPED_GEMMS:
        return ffn.ragged(x_RD, layout.sizes_E, *weights)
    raise ValueError(f"unknown gmm_impl {impl!r}")


def reads_slots(impl: str, cfg: MoEConfig, layout: Slots) -> bool:
    """Whether the expert FFN reads `layout`'s sender-major slots in place: the Pallas
    grouped matmuls in bf16, where each slot is whole row blocks of the kernels
    (TileConfig.block_m)."""
    if impl not in ("pallas", "pallas_tcgen05") or cfg.precision != "bf16":
        return False
    from olmo_jax.kernels.grouped_matmul import TileConfig

    return (layout.capacity // layout.senders) % TileConfig().block_m == 0


def _ffn_blas(x_RD, layout: GroupLayout, weights):
    """The FFI kernel over the layout's runs (Slots: G runs of `capacity` rows)."""
    from olmo_jax.kernels import cpu_gmm

    if isinstance(layout, Slots):
        sizes_E = jnp.full((layout.groups,), layout.capacity, jnp.int32)
        multiple = layout.capacity
    elif isinstance(layout, Runs):
        sizes_E, multiple = layout.sizes_E.astype(jnp.int32), layout.multiple
    else:
        raise TypeError(f"expert_ffn: unknown group layout {type(layout).__name__}")
    starts_E, _ = tiled.padded_runs(sizes_E, multiple)
    return cpu_gmm.ffn_runs(x_RD, starts_E, sizes_E, *weights)
