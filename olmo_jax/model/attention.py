"""Causal self-attention: grouped-query heads, QK RMSNorm, optional QKV clipping, RoPE.

Matches Hugging Face `OlmoeAttention` (QK-norm spans all heads of q and of k; clipping
is applied after the norm), so converted checkpoints give the same logits. With
`attention_precision="mxfp8"` the four projection GEMMs run in MXFP8
(olmo_jax/model/mxfp8.py); the softmax(q k^T) v core stays in the compute dtype.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from olmo_jax.model import mxfp8
from olmo_jax.model.config import TransformerConfig
from olmo_jax.model.norm import RMSNorm
from olmo_jax.model.params import normal_param
from olmo_jax.model.rope import apply_rope


def causal_attention(q_BTNH: jax.Array, k_BSKH: jax.Array, v_BSKH: jax.Array) -> jax.Array:
    """Softmax(q k^T / sqrt(H)) v with a causal mask; N query heads share K kv heads.

    Scores and softmax in float32; returns [B, T, N, H] in q's dtype.
    """
    B, T, N, H = q_BTNH.shape
    K = k_BSKH.shape[2]
    G = N // K
    q_BTKGH = q_BTNH.reshape(B, T, K, G, H)
    scores_BKGTS = jnp.einsum(
        "btkgh,bskh->bkgts", q_BTKGH, k_BSKH, preferred_element_type=jnp.float32
    ) * (H**-0.5)
    S = k_BSKH.shape[1]
    causal_TS = jnp.arange(T)[:, None] >= jnp.arange(S)[None, :]
    scores_BKGTS = jnp.where(causal_TS, scores_BKGTS, jnp.finfo(jnp.float32).min)
    probs_BKGTS = jax.nn.softmax(scores_BKGTS, axis=-1).astype(v_BSKH.dtype)
    out_BTKGH = jnp.einsum("bkgts,bskh->btkgh", probs_BKGTS, v_BSKH)
    return out_BTKGH.reshape(B, T, N, H)


class Attention(nnx.Module):
    def __init__(self, cfg: TransformerConfig, *, rngs: nnx.Rngs):
        D, N, K, H = cfg.d_model, cfg.n_heads, cfg.kv_heads, cfg.head_size
        std = cfg.init_std
        self.q_proj = normal_param(rngs.params(), (D, N, H), ("embed", "q_heads", "head_dim"), std)
        self.k_proj = normal_param(rngs.params(), (D, K, H), ("embed", "kv_heads", "head_dim"), std)
        self.v_proj = normal_param(rngs.params(), (D, K, H), ("embed", "kv_heads", "head_dim"), std)
        self.o_proj = normal_param(rngs.params(), (N, H, D), ("q_heads", "head_dim", "embed"), std)
        if cfg.qk_norm:
            self.q_norm = RMSNorm((N, H), ("q_heads", "head_dim"), cfg.norm_eps)
            self.k_norm = RMSNorm((K, H), ("kv_heads", "head_dim"), cfg.norm_eps)
        else:
            self.q_norm = self.k_norm = None
        self.clip_qkv = cfg.clip_qkv
        self.dtype = cfg.compute_dtype
        self.mxfp8_proj = cfg.attention_precision == "mxfp8"  # projection GEMMs in MXFP8

    def _proj(self, spec: str, x, w):
        return mxfp8.einsum(spec, x, w) if self.mxfp8_proj else jnp.einsum(spec, x, w)

    def __call__(self, x_BTD: jax.Array, cos_TH: jax.Array, sin_TH: jax.Array) -> jax.Array:
        dt = self.dtype
        x_BTD = x_BTD.astype(dt)
        q_BTNH = self._proj("btd,dnh->btnh", x_BTD, self.q_proj[...].astype(dt))
        k_BTKH = self._proj("btd,dkh->btkh", x_BTD, self.k_proj[...].astype(dt))
        v_BTKH = self._proj("btd,dkh->btkh", x_BTD, self.v_proj[...].astype(dt))
        if self.q_norm is not None:
            q_BTNH = self.q_norm(q_BTNH)
            k_BTKH = self.k_norm(k_BTKH)
        if self.clip_qkv:
            c = self.clip_qkv
            q_BTNH, k_BTKH, v_BTKH = (jnp.clip(a, -c, c) for a in (q_BTNH, k_BTKH, v_BTKH))
        q_BTNH = apply_rope(q_BTNH, cos_TH, sin_TH)
        k_BTKH = apply_rope(k_BTKH, cos_TH, sin_TH)
        o_BTNH = causal_attention(q_BTNH, k_BTKH, v_BTKH)
        return self._proj("btnh,nhd->btd", o_BTNH, self.o_proj[...].astype(dt))
