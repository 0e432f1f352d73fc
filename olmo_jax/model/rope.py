"""Rotary position embedding, "rotate half" layout (Hugging Face / OLMo-core).

Positions are [T] (every row of the batch at 0 .. T-1, tables [T, H]) or, with document
masking, [B, T] (each row's positions restart at its documents' starts, tables [B, T, H]):
`document_positions` derives them from segment ids as OLMo-core's `RotaryEmbedding` does
from `cu_doc_lens`."""

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


@shapes.check("-> B T H, B T H")
def rope_tables_batch(positions_BT: jax.Array, head_dim: int, theta: float
                      ) -> tuple[jax.Array, jax.Array]:
    """`rope_tables` of per-row positions: cos and sin [B, T, head_dim], float32."""
    B, T = positions_BT.shape
    cos_XH, sin_XH = rope_tables(positions_BT.reshape(B * T), head_dim, theta)
    return cos_XH.reshape(B, T, head_dim), sin_XH.reshape(B, T, head_dim)


@shapes.check("-> B T")
def document_positions(segment_ids_BT: jax.Array) -> jax.Array:
    """Each token's position inside its document, int32 [B, T]: 0 at every document start (a
    position whose segment id differs from the previous one's, and position 0), counting up
    to the next. Equal ids must be contiguous (as packed documents are)."""
    B, T = segment_ids_BT.shape
    t_BT = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    starts_BT = jnp.concatenate(
        [jnp.ones((B, 1), bool), segment_ids_BT[:, 1:] != segment_ids_BT[:, :-1]], axis=1)
    first_BT = jax.lax.cummax(jnp.where(starts_BT, t_BT, 0), axis=1)  # the document's start
    return t_BT - first_BT


@shapes.check("cos_TH: ... T H", "sin_TH: ... T H", "-> B T N H")
def apply_rope(x_BTNH: jax.Array, cos_TH: jax.Array, sin_TH: jax.Array) -> jax.Array:
    """x rotated by the [T, H] tables (shared by the rows) or [B, T, H] ones (per row)."""
    half = x_BTNH.shape[-1] // 2
    x1, x2 = x_BTNH[..., :half], x_BTNH[..., half:]
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    cos = _heads_axis(cos_TH).astype(x_BTNH.dtype)
    sin = _heads_axis(sin_TH).astype(x_BTNH.dtype)
    return x_BTNH * cos + rotated * sin


def _heads_axis(table):
    """A [T, H] or [B, T, H] table broadcastable against [B, T, N, H]."""
    return table[None, :, None, :] if table.ndim == 2 else table[:, :, None, :]
