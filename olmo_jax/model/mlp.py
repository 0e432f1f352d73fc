"""Dense SwiGLU feed-forward: down(silu(x @ gate) * (x @ up)). Used by dense blocks and
shared experts."""

from __future__ import annotations

import jax
from flax import nnx

from olmo_jax.model.params import normal_param


def swiglu(x_SD: jax.Array, w_gate_DF: jax.Array, w_up_DF: jax.Array, w_down_FD: jax.Array):
    h_SF = jax.nn.silu(x_SD @ w_gate_DF) * (x_SD @ w_up_DF)
    return h_SF @ w_down_FD


class MLP(nnx.Module):
    def __init__(self, d_model: int, hidden: int, init_std: float, dtype, *, rngs: nnx.Rngs):
        D, F = d_model, hidden
        self.w_gate = normal_param(rngs.params(), (D, F), ("embed", "mlp"), init_std)
        self.w_up = normal_param(rngs.params(), (D, F), ("embed", "mlp"), init_std)
        self.w_down = normal_param(rngs.params(), (F, D), ("mlp", "embed"), init_std)
        self.dtype = dtype

    def __call__(self, x_BTD: jax.Array) -> jax.Array:
        dt = self.dtype
        return swiglu(
            x_BTD.astype(dt),
            self.w_gate[...].astype(dt),
            self.w_up[...].astype(dt),
            self.w_down[...].astype(dt),
        )
