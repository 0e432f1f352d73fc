"""The routed experts' weights and the grouped SwiGLU matmul over an expert-grouped buffer.

Weights: w_gate, w_up [E, D, F]; w_down [E, F, D]. Implementations (`gmm_impl`, resolved
by `olmo_jax.kernels.resolve_gmm_impl`):
  ragged_dot  jax.lax.ragged_dot over the sorted layout (GPU/TPU grouped GEMM; on CPU
              it expands to a dense masked product, E times the FLOPs);
  pallas      the sorted layout on the Pallas grouped-matmul kernels (Hopper GPUs;
              olmo_jax/kernels/grouped_matmul.py);
  einsum      a padded batched einsum: over [E, C, D] capacity buffers, or, dropless,
              over blocks of the blocked layout with each block's expert's weights
              gathered ([B, b, D] x [B, D, F]);
  tiled       a loop of dense per-expert GEMMs over the sorted layout padded to 8 rows
              per expert (olmo_jax/model/moe/tiled.py); the fastest dropless path on CPU;
  auto        tiled on CPU (einsum with MXFP8 experts), pallas on Hopper (bf16),
              ragged_dot elsewhere.
MXFP8 versions of these FFNs: olmo_jax/model/moe/mxfp8_experts.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from olmo_jax.kernels import resolve_gmm_impl
from olmo_jax.kernels.vma import cotangent_like
from olmo_jax.model.params import normal_param

__all__ = ["Experts", "ffn_batched", "ffn_blocked", "ffn_ragged", "resolve_gmm_impl"]


class Experts(nnx.Module):
    def __init__(self, num_experts: int, d_model: int, hidden: int, init_std: float, *, rngs):
        E, D, F = num_experts, d_model, hidden
        self.w_gate = normal_param(rngs.params(), (E, D, F), ("expert", "embed", "mlp"), init_std)
        self.w_up = normal_param(rngs.params(), (E, D, F), ("expert", "embed", "mlp"), init_std)
        self.w_down = normal_param(rngs.params(), (E, F, D), ("expert", "mlp", "embed"), init_std)

    def weights(self, dtype) -> tuple[jax.Array, jax.Array, jax.Array]:
        return tuple(w[...].astype(dtype) for w in (self.w_gate, self.w_up, self.w_down))


def ffn_ragged(x_RD, group_sizes_E, w_gate_EDF, w_up_EDF, w_down_EFD, gmm=jax.lax.ragged_dot):
    """SwiGLU over rows sorted by expert; group_sizes_E rows per expert. `gmm(x, w, gs)`
    is the grouped matmul (ragged_dot, or kernels.grouped_matmul.grouped_matmul)."""
    gs = group_sizes_E.astype(jnp.int32)
    g_RF = gmm(x_RD, w_gate_EDF, gs)
    u_RF = gmm(x_RD, w_up_EDF, gs)
    return gmm(jax.nn.silu(g_RF) * u_RF, w_down_EFD, gs)


def _swiglu_groups_fwd(x_GCD, wgu_GDJ, wd_GFD):
    """y = (silu(g) * u) @ w_down per group, with [g | u] = x @ [w_gate | w_up] (J = 2F)."""
    F = wd_GFD.shape[1]
    gu_GCJ = jnp.einsum("gcd,gdj->gcj", x_GCD, wgu_GDJ)
    h_GCF = jax.nn.silu(gu_GCJ[..., :F]) * gu_GCJ[..., F:]
    return jnp.einsum("gcf,gfd->gcd", h_GCF, wd_GFD), gu_GCJ


def _swiglu_groups_bwd(x_GCD, gu_GCJ, wgu_GDJ, wd_GFD, dy_GCD):
    """Gradients (dx, dwgu per group, dwd per group) from the saved gate/up activations."""
    F = wd_GFD.shape[1]
    g_GCF, u_GCF = gu_GCJ[..., :F], gu_GCJ[..., F:]
    sig_GCF = jax.nn.sigmoid(g_GCF)
    act_GCF = g_GCF * sig_GCF
    dh_GCF = jnp.einsum("gcd,gfd->gcf", dy_GCD, wd_GFD)
    dwd_GFD = jnp.einsum("gcf,gcd->gfd", act_GCF * u_GCF, dy_GCD)
    dg_GCF = dh_GCF * u_GCF * (sig_GCF * (1 + g_GCF * (1 - sig_GCF)))
    dgu_GCJ = jnp.concatenate([dg_GCF, dh_GCF * act_GCF], axis=-1)
    dx_GCD = jnp.einsum("gcj,gdj->gcd", dgu_GCJ, wgu_GDJ)
    dwgu_GDJ = jnp.einsum("gcd,gcj->gdj", x_GCD, dgu_GCJ)
    return dx_GCD, dwgu_GDJ, dwd_GFD


def _fuse_gate_up(w_gate, w_up):
    return jnp.concatenate([w_gate, w_up], axis=-1)


def _split_gate_up(dwgu, F):
    return dwgu[..., :F], dwgu[..., F:]


@jax.custom_vjp
def ffn_batched(x_GCD, w_gate_GDF, w_up_GDF, w_down_GFD):
    """SwiGLU per group g (an expert's capacity buffer). Gate and up run as one matmul;
    the backward pass keeps only x and the gate/up activations from the forward."""
    return _swiglu_groups_fwd(x_GCD, _fuse_gate_up(w_gate_GDF, w_up_GDF), w_down_GFD)[0]


def _ffn_batched_fwd(x_GCD, w_gate_GDF, w_up_GDF, w_down_GFD):
    wgu_GDJ = _fuse_gate_up(w_gate_GDF, w_up_GDF)
    y_GCD, gu_GCJ = _swiglu_groups_fwd(x_GCD, wgu_GDJ, w_down_GFD)
    return y_GCD, (x_GCD, gu_GCJ, wgu_GDJ, w_down_GFD)


def _ffn_batched_bwd(res, dy_GCD):
    x_GCD, gu_GCJ, wgu_GDJ, w_down_GFD = res
    dx, dwgu, dwd = _swiglu_groups_bwd(x_GCD, gu_GCJ, wgu_GDJ, w_down_GFD, dy_GCD)
    dwg, dwu = _split_gate_up(cotangent_like(dwgu, wgu_GDJ), w_down_GFD.shape[1])
    return cotangent_like(dx, x_GCD), dwg, dwu, cotangent_like(dwd, w_down_GFD)


ffn_batched.defvjp(_ffn_batched_fwd, _ffn_batched_bwd)


@jax.custom_vjp
def ffn_blocked(x_PD, block_expert_B, w_gate_EDF, w_up_EDF, w_down_EFD):
    """SwiGLU over the blocked layout: block i of rows uses expert block_expert_B[i].

    Each block's weights are gathered (in both passes, so they are never saved), and the
    per-block weight gradients are summed per expert with a one-hot matmul (no scatter)."""
    return _ffn_blocked_fwd(x_PD, block_expert_B, w_gate_EDF, w_up_EDF, w_down_EFD)[0]


def _ffn_blocked_fwd(x_PD, block_expert_B, w_gate_EDF, w_up_EDF, w_down_EFD):
    P, D = x_PD.shape
    nb = block_expert_B.shape[0]
    x_BbD = x_PD.reshape(nb, P // nb, D)
    wgu_BDJ = _fuse_gate_up(w_gate_EDF, w_up_EDF)[block_expert_B]
    y_BbD, gu_BbJ = _swiglu_groups_fwd(x_BbD, wgu_BDJ, w_down_EFD[block_expert_B])
    return y_BbD.reshape(P, D), (x_BbD, gu_BbJ, block_expert_B, w_gate_EDF, w_up_EDF, w_down_EFD)


def _ffn_blocked_bwd(res, dy_PD):
    x_BbD, gu_BbJ, block_expert_B, w_gate_EDF, w_up_EDF, w_down_EFD = res
    E, _, F = w_gate_EDF.shape
    wgu_BDJ = _fuse_gate_up(w_gate_EDF, w_up_EDF)[block_expert_B]
    dx_BbD, dwgu_BDJ, dwd_BFD = _swiglu_groups_bwd(
        x_BbD, gu_BbJ, wgu_BDJ, w_down_EFD[block_expert_B], dy_PD.reshape(x_BbD.shape)
    )
    onehot_BE = jax.nn.one_hot(block_expert_B, E, dtype=dwgu_BDJ.dtype)
    dwgu_EDJ = jnp.einsum("be,bdj->edj", onehot_BE, dwgu_BDJ)
    dwd_EFD = jnp.einsum("be,bfd->efd", onehot_BE, dwd_BFD)
    dwg_EDF, dwu_EDF = _split_gate_up(dwgu_EDJ, F)
    return (cotangent_like(dx_BbD.reshape(dy_PD.shape), x_BbD), None,
            cotangent_like(dwg_EDF, w_gate_EDF), cotangent_like(dwu_EDF, w_up_EDF),
            cotangent_like(dwd_EFD, w_down_EFD))


ffn_blocked.defvjp(_ffn_blocked_fwd, _ffn_blocked_bwd)
