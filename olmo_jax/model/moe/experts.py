"""The routed experts' weights and the grouped SwiGLU matmul over an expert-grouped buffer.

Weights: w_gate, w_up [E, D, F]; w_down [E, F, D]. Implementations (`gmm_impl`; which one
runs where: the table of olmo_jax/kernels/select.py):
  ragged_dot  jax.lax.ragged_dot over the sorted layout (GPU/TPU grouped GEMM; on CPU
              it expands to a dense masked product, E times the FLOPs);
  pallas      the sorted layout on the Pallas grouped-matmul kernels (Hopper GPUs;
              olmo_jax/kernels/grouped_matmul.py);
  pallas_tcgen05  the same on the Blackwell tcgen05 kernels (B200/B300;
              olmo_jax/kernels/grouped_matmul_tcgen05.py);
  einsum      a padded batched einsum: over [E, C, D] capacity buffers, or, dropless,
              over blocks of the blocked layout with each block's expert's weights
              gathered ([U, b, D] x [U, D, F]);
  tiled       a loop of dense per-expert XLA GEMMs over the sorted layout padded to 8
              rows per expert (olmo_jax/model/moe/tiled.py); dropless, any dtype;
  blas        one OpenBLAS SGEMM per expert over its rows, an XLA FFI call (float32 on
              CPU; olmo_jax/kernels/cpu_gmm.py); the fastest dropless path on CPU.
MXFP8 versions of these FFNs: olmo_jax/model/moe/mxfp8_experts.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from olmo_jax import shapes
from olmo_jax.kernels.vma import cotangent_like
from olmo_jax.model.params import normal_param

__all__ = ["Experts", "ffn_batched", "ffn_blocked", "ffn_ragged"]


class Experts(nnx.Module):
    def __init__(self, num_experts: int, d_model: int, hidden: int, init_std: float, *, rngs):
        E, D, F = num_experts, d_model, hidden
        self.w_gate = normal_param(rngs.params(), (E, D, F), ("expert", "embed", "mlp"), init_std)
        self.w_up = normal_param(rngs.params(), (E, D, F), ("expert", "embed", "mlp"), init_std)
        self.w_down = normal_param(rngs.params(), (E, F, D), ("expert", "mlp", "embed"), init_std)

    def weights(self, dtype) -> tuple[jax.Array, jax.Array, jax.Array]:
        return tuple(w[...].astype(dtype) for w in (self.w_gate, self.w_up, self.w_down))


@shapes.check("-> R D")
def ffn_ragged(x_RD, group_sizes_E, w_gate_EDF, w_up_EDF, w_down_EFD, gmm=jax.lax.ragged_dot):
    """SwiGLU over rows sorted by expert; group_sizes_E rows per expert. `gmm(x, w, gs)`
    is the grouped matmul (ragged_dot, or kernels.grouped_matmul.grouped_matmul)."""
    gs = group_sizes_E.astype(jnp.int32)
    g_RF = gmm(x_RD, w_gate_EDF, gs)
    u_RF = gmm(x_RD, w_up_EDF, gs)
    return gmm(jax.nn.silu(g_RF) * u_RF, w_down_EFD, gs)


def _swiglu_groups_fwd(x_ECD, wgu_EDJ, wd_EFD):
    """y = (silu(g) * u) @ w_down per group, with [g | u] = x @ [w_gate | w_up] (J = 2F)."""
    F = wd_EFD.shape[1]
    gu_ECJ = jnp.einsum("ecd,edj->ecj", x_ECD, wgu_EDJ)
    h_ECF = jax.nn.silu(gu_ECJ[..., :F]) * gu_ECJ[..., F:]
    return jnp.einsum("ecf,efd->ecd", h_ECF, wd_EFD), gu_ECJ


def _swiglu_groups_bwd(x_ECD, gu_ECJ, wgu_EDJ, wd_EFD, dy_ECD):
    """Gradients (dx, dwgu per group, dwd per group) from the saved gate/up activations."""
    F = wd_EFD.shape[1]
    g_ECF, u_ECF = gu_ECJ[..., :F], gu_ECJ[..., F:]
    sig_ECF = jax.nn.sigmoid(g_ECF)
    act_ECF = g_ECF * sig_ECF
    dh_ECF = jnp.einsum("ecd,efd->ecf", dy_ECD, wd_EFD)
    dwd_EFD = jnp.einsum("ecf,ecd->efd", act_ECF * u_ECF, dy_ECD)
    dg_ECF = dh_ECF * u_ECF * (sig_ECF * (1 + g_ECF * (1 - sig_ECF)))
    dgu_ECJ = jnp.concatenate([dg_ECF, dh_ECF * act_ECF], axis=-1)
    dx_ECD = jnp.einsum("ecj,edj->ecd", dgu_ECJ, wgu_EDJ)
    dwgu_EDJ = jnp.einsum("ecd,ecj->edj", x_ECD, dgu_ECJ)
    return dx_ECD, dwgu_EDJ, dwd_EFD


def _fuse_gate_up(w_gate, w_up):
    return jnp.concatenate([w_gate, w_up], axis=-1)


def _split_gate_up(dwgu, F):
    return dwgu[..., :F], dwgu[..., F:]


@jax.custom_vjp
def ffn_batched(x_ECD, w_gate_EDF, w_up_EDF, w_down_EFD):
    """SwiGLU per group g (an expert's capacity buffer). Gate and up run as one matmul;
    the backward pass keeps only x and the gate/up activations from the forward."""
    return _swiglu_groups_fwd(x_ECD, _fuse_gate_up(w_gate_EDF, w_up_EDF), w_down_EFD)[0]


def _ffn_batched_fwd(x_ECD, w_gate_EDF, w_up_EDF, w_down_EFD):
    wgu_EDJ = _fuse_gate_up(w_gate_EDF, w_up_EDF)
    y_ECD, gu_ECJ = _swiglu_groups_fwd(x_ECD, wgu_EDJ, w_down_EFD)
    return y_ECD, (x_ECD, gu_ECJ, wgu_EDJ, w_down_EFD)


def _ffn_batched_bwd(res, dy_ECD):
    x_ECD, gu_ECJ, wgu_EDJ, w_down_EFD = res
    dx, dwgu, dwd = _swiglu_groups_bwd(x_ECD, gu_ECJ, wgu_EDJ, w_down_EFD, dy_ECD)
    dwg, dwu = _split_gate_up(cotangent_like(dwgu, wgu_EDJ), w_down_EFD.shape[1])
    return cotangent_like(dx, x_ECD), dwg, dwu, cotangent_like(dwd, w_down_EFD)


ffn_batched.defvjp(_ffn_batched_fwd, _ffn_batched_bwd)


@jax.custom_vjp
def ffn_blocked(x_RD, block_expert_U, w_gate_EDF, w_up_EDF, w_down_EFD):
    """SwiGLU over the blocked layout: block i of rows uses expert block_expert_U[i].

    Each block's weights are gathered (in both passes, so they are never saved), and the
    per-block weight gradients are summed per expert with a one-hot matmul (no scatter)."""
    return _ffn_blocked_fwd(x_RD, block_expert_U, w_gate_EDF, w_up_EDF, w_down_EFD)[0]


def _ffn_blocked_fwd(x_RD, block_expert_U, w_gate_EDF, w_up_EDF, w_down_EFD):
    R, D = x_RD.shape
    nb = block_expert_U.shape[0]
    x_UbD = x_RD.reshape(nb, R // nb, D)
    wgu_UDJ = _fuse_gate_up(w_gate_EDF, w_up_EDF)[block_expert_U]
    y_UbD, gu_UbJ = _swiglu_groups_fwd(x_UbD, wgu_UDJ, w_down_EFD[block_expert_U])
    return y_UbD.reshape(R, D), (x_UbD, gu_UbJ, block_expert_U, w_gate_EDF, w_up_EDF, w_down_EFD)


def _ffn_blocked_bwd(res, dy_RD):
    x_UbD, gu_UbJ, block_expert_U, w_gate_EDF, w_up_EDF, w_down_EFD = res
    E, _, F = w_gate_EDF.shape
    wgu_UDJ = _fuse_gate_up(w_gate_EDF, w_up_EDF)[block_expert_U]
    dx_UbD, dwgu_UDJ, dwd_UFD = _swiglu_groups_bwd(
        x_UbD, gu_UbJ, wgu_UDJ, w_down_EFD[block_expert_U], dy_RD.reshape(x_UbD.shape)
    )
    onehot_UE = jax.nn.one_hot(block_expert_U, E, dtype=dwgu_UDJ.dtype)
    dwgu_EDJ = jnp.einsum("ue,udj->edj", onehot_UE, dwgu_UDJ)
    dwd_EFD = jnp.einsum("ue,ufd->efd", onehot_UE, dwd_UFD)
    dwg_EDF, dwu_EDF = _split_gate_up(dwgu_EDJ, F)
    return (cotangent_like(dx_UbD.reshape(dy_RD.shape), x_UbD), None,
            cotangent_like(dwg_EDF, w_gate_EDF), cotangent_like(dwu_EDF, w_up_EDF),
            cotangent_like(dwd_EFD, w_down_EFD))


ffn_blocked.defvjp(_ffn_blocked_fwd, _ffn_blocked_bwd)
