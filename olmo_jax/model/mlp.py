"""Dense SwiGLU feed-forward: down(silu(x @ gate) * (x @ up)). Used by dense blocks and
shared experts."""

from __future__ import annotations

import jax
from flax import nnx

from olmo_jax import shapes
from olmo_jax.model.params import normal_param


@shapes.check("x: ... D", "-> ... D")
def swiglu(x: jax.Array, w_gate_DF: jax.Array, w_up_DF: jax.Array, w_down_FD: jax.Array):
    """x [..., D] (tokens x_SD, or x_BTD in dense blocks) -> [..., D]."""
    h = jax.nn.silu(x @ w_gate_DF) * (x @ w_up_DF)  # [..., F]
    return h @ w_down_FD


class MLP(nnx.Module):
    def __init__(self, d_model: int, hidden: int, init_std: float, dtype, *, rngs: nnx.Rngs):
        D, F = d_model, hidden
        self.w_gate = normal_param(rngs.params(), (D, F), ("embed", "mlp"), init_std)
        self.w_up = normal_param(rngs.params(), (D, F), ("embed", "mlp"), init_std)
        self.w_down = normal_param(rngs.params(), (F, D), ("mlp", "embed"), init_std)
        self.dtype = dtype

    @shapes.check("x: ... D", "-> ... D")
    def __call__(self, x: jax.Array) -> jax.Array:
        """x_BTD in dense blocks, x_SD as the MoE layer's shared experts."""
        dt = self.dtype
        return swiglu(
            x.astype(dt),
            self.w_gate[...].astype(dt),
            self.w_up[...].astype(dt),
            self.w_down[...].astype(dt),
        )
