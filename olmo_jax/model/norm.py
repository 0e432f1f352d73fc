"""RMSNorm, computed in float32 and cast back (the Hugging Face OLMoE definition)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from olmo_jax.model.params import ones_param


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """x * rsqrt(mean(x^2) + eps) over all trailing axes that `weight` spans, times weight."""
    axes = tuple(range(x.ndim - weight.ndim, x.ndim))
    x32 = x.astype(jnp.float32)
    var = jnp.mean(jnp.square(x32), axis=axes, keepdims=True)
    y = (x32 * jax.lax.rsqrt(var + eps)).astype(x.dtype)
    return weight.astype(x.dtype) * y


class RMSNorm(nnx.Module):
    """Normalizes over trailing axes of shape `shape` (one axis for the residual stream,
    (heads, head_dim) for QK-norm, which Hugging Face OLMoE applies across all heads)."""

    def __init__(self, shape: tuple[int, ...], axes: tuple[str | None, ...], eps: float):
        self.weight = ones_param(shape, axes)
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        return rms_norm(x, self.weight[...], self.eps)
