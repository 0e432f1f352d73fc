"""Rotary position embedding, "rotate half" layout (Hugging Face / OLMo-core)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from olmo_jax import shapes


@shapes.check("-> T H, T H")
def rope_tables(positions_T: jax.Array, head_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
    """cos and sin tables, each [T, head_dim], float32."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    freqs_Th = positions_T.astype(jnp.float32)[:, None] * inv_freq[None, :]
    emb_TH = jnp.concatenate([freqs_Th, freqs_Th], axis=-1)
    return jnp.cos(emb_TH), jnp.sin(emb_TH)


@shapes.check("-> B T N H")
def apply_rope(x_BTNH: jax.Array, cos_TH: jax.Array, sin_TH: jax.Array) -> jax.Array:
    half = x_BTNH.shape[-1] // 2
    x1, x2 = x_BTNH[..., :half], x_BTNH[..., half:]
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    cos = cos_TH[None, :, None, :].astype(x_BTNH.dtype)
    sin = sin_TH[None, :, None, :].astype(x_BTNH.dtype)
    return x_BTNH * cos + rotated * sin
