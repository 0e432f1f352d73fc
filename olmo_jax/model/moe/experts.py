"""The routed experts' weights and the grouped SwiGLU matmul over an expert-grouped buffer.

Weights: w_gate, w_up [E, D, F]; w_down [E, F, D]. Implementations (`gmm_impl`, resolved
by `olmo_jax.kernels.resolve_gmm_impl`):
  ragged_dot  jax.lax.ragged_dot over the sorted layout (GPU/TPU grouped GEMM; on CPU
              it expands to a dense masked product, E times the FLOPs);
  pallas      the sorted layout on the Pallas grouped-matmul kernels (Hopper GPUs;
              olmo_jax/kernels/grouped_matmul.py);
  einsum      a padded batched einsum: over [E, C, D] capacity buffers, or, dropless,
              over blocks of the blocked layout with each block's expert's weights
              gathered ([B, b, D] x [B, D, F]); the fastest path on CPU;
  auto        einsum on CPU, pallas on Hopper (bf16), ragged_dot elsewhere.
MXFP8 versions of these FFNs: olmo_jax/model/moe/mxfp8_experts.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from olmo_jax.kernels import resolve_gmm_impl
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


def ffn_batched(x_GCD, w_gate_GDF, w_up_GDF, w_down_GFD):
    """SwiGLU per group g (an expert's capacity buffer, or one block of rows)."""
    g_GCF = jnp.einsum("gcd,gdf->gcf", x_GCD, w_gate_GDF)
    u_GCF = jnp.einsum("gcd,gdf->gcf", x_GCD, w_up_GDF)
    return jnp.einsum("gcf,gfd->gcd", jax.nn.silu(g_GCF) * u_GCF, w_down_GFD)


def ffn_blocked(x_PD, block_expert_B, w_gate_EDF, w_up_EDF, w_down_EFD):
    """SwiGLU over the blocked layout: block i of rows uses expert block_expert_B[i]."""
    P, D = x_PD.shape
    nb = block_expert_B.shape[0]
    x_BbD = x_PD.reshape(nb, P // nb, D)
    y_BbD = ffn_batched(
        x_BbD, w_gate_EDF[block_expert_B], w_up_EDF[block_expert_B], w_down_EFD[block_expert_B]
    )
    return y_BbD.reshape(P, D)
