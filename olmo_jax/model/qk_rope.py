"""QK-norm, then RoPE, then the head-major layout: one custom VJP for the three.

`norm_rope_heads(x_BTNH, weight, eps, cos_TH, sin_TH)` is
`apply_rope(rms_norm(x_BTNH, weight, eps), cos_TH, sin_TH).transpose(0, 2, 1, 3)`
(norm over the trailing axes `weight` spans: (N, H) for Hugging Face OLMoE's QK-norm,
(H,) for OLMo-core's per-head one). Autodiff of that chain differentiates RoPE's
slices and concatenation into pads and adds, and the norm's backward and the transpose
into separate passes; the hand-written backward here undoes the transpose, applies the
inverse rotation (RoPE's transpose: x * cos + rotate_half^T(x * sin)) and the norm's
backward in one element-wise expression over the saved input and 1/rms. The tables are
not differentiated (their cotangents are zero)."""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

from olmo_jax import shapes
from olmo_jax.kernels.vma import cotangent_like
from olmo_jax.model.norm import rms_norm_backward, rms_norm_forward
from olmo_jax.model.rope import apply_rope


@shapes.check("-> B N T H")
def norm_rope_heads(x_BTNH: jax.Array, weight: jax.Array, eps: float, cos_TH: jax.Array,
                    sin_TH: jax.Array) -> jax.Array:
    """RMSNorm(x) with `weight`, rotated by RoPE, out head-major [B, N, T, H]."""
    return _norm_rope_heads(x_BTNH, weight, cos_TH, sin_TH, eps)


def _fwd(x_BTNH, weight, cos_TH, sin_TH, eps):
    y_BTNH, rstd = rms_norm_forward(x_BTNH, weight, eps)
    out_BNTH = apply_rope(y_BTNH, cos_TH, sin_TH).transpose(0, 2, 1, 3)
    return out_BNTH, (x_BTNH, weight, rstd, cos_TH, sin_TH)


def _bwd(eps, res, d_BNTH):
    x_BTNH, weight, rstd, cos_TH, sin_TH = res
    d_BTNH = d_BNTH.transpose(0, 2, 1, 3)
    half = d_BTNH.shape[-1] // 2
    cos = cos_TH[None, :, None, :].astype(d_BTNH.dtype)
    sin = sin_TH[None, :, None, :].astype(d_BTNH.dtype)
    ds_BTNH = d_BTNH * sin
    # rotate_half(y) = [-y2, y1]; its transpose maps g = [g1, g2] to [g2, -g1].
    dy_BTNH = d_BTNH * cos + jnp.concatenate([ds_BTNH[..., half:], -ds_BTNH[..., :half]], axis=-1)
    dx_BTNH, dweight = rms_norm_backward(x_BTNH, weight, rstd, dy_BTNH)
    return (cotangent_like(dx_BTNH, x_BTNH), cotangent_like(dweight, weight),
            jnp.zeros_like(cos_TH), jnp.zeros_like(sin_TH))


@partial(jax.custom_vjp, nondiff_argnums=(4,))
def _norm_rope_heads(x_BTNH, weight, cos_TH, sin_TH, eps):
    return _fwd(x_BTNH, weight, cos_TH, sin_TH, eps)[0]


_norm_rope_heads.defvjp(_fwd, _bwd)
