"""The routed experts' SwiGLU in MXFP8, as one custom-VJP unit (which FFN runs on a
buffer, bf16 or MXFP8: olmo_jax/model/moe/ffn.py).

    h = silu(x @ w_gate) * (x @ w_up);  y = h @ w_down

Forward: x quantized along D, w_gate/w_up along D, h along F, w_down along F; three MXFP8
GEMMs (`olmo_jax.model.mxfp8_gemm.mx_nt`); each weight is quantized both ways in one pass
(the fused kernel on a GPU). Saved for the backward pass: x and h as their MXFP8 form
(e4m3 values + e8m0 scales, about half of bf16; exactly what the forward GEMMs read, so
the weight gradients stay consistent with the forward), each weight's copy quantized for
the input-gradient GEMM (fp8 instead of the bf16 weight), and the gate and up
pre-activations g, u in the compute dtype (silu's derivative needs them unrounded).
Backward: input-gradient GEMMs in MXFP8 (dy and dg/du quantized along their contracting
dims, the weights along the other axis), weight-gradient GEMMs in the compute dtype on
the dequantized saved operands, or rounded through MXFP8 along the rows when
`mxfp8_wgrad`. `impl` is model.mxfp8_gemm_impl (olmo_jax/model/mxfp8_gemm.py). Works on
every expert layout (batched capacity buffers, blocked,
ragged via ragged_dot or the Pallas kernel).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from olmo_jax.kernels import mxfp8_quant as mx
from olmo_jax.model import mxfp8_gemm


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def swiglu(x, w_gate, w_up, w_down, layout: mxfp8_gemm.Layout, rounding: str, quantize_wgrad: bool,
           impl: str = "auto"):
    """MXFP8 SwiGLU over one expert layout (a typed value of olmo_jax.model.mxfp8_gemm:
    Batched(), Blocked(block_expert_U), Ragged(group_sizes_G), Pallas(group_sizes_G))."""
    return _fwd(x, w_gate, w_up, w_down, layout, rounding, quantize_wgrad, impl)[0]


def _fwd(x, w_gate, w_up, w_down, layout, rounding, quantize_wgrad, impl):
    dt = x.dtype
    wg, wu, wd = (mxfp8_gemm.quantize_weight(w, rounding) for w in (w_gate, w_up, w_down))
    x_q, x_s = mx.quantize(x, -1, rounding)
    g = mxfp8_gemm.mx_nt(layout, x_q, x_s, wg.fwd_q, wg.fwd_s, dt, impl)
    u = mxfp8_gemm.mx_nt(layout, x_q, x_s, wu.fwd_q, wu.fwd_s, dt, impl)
    h = (jax.nn.silu(g.astype(jnp.float32)) * u.astype(jnp.float32)).astype(dt)
    h_q, h_s = mx.quantize(h, -1, rounding)
    y = mxfp8_gemm.mx_nt(layout, h_q, h_s, wd.fwd_q, wd.fwd_s, dt, impl)
    # The backward needs each weight only quantized along N (its dgrad copy).
    saved_w = tuple(w._replace(fwd_q=None, fwd_s=None) for w in (wg, wu, wd))
    dtypes = (w_gate.dtype, w_up.dtype, w_down.dtype)
    return y, (x_q, x_s, g, u, h_q, h_s, saved_w, layout, _Dtypes(dtypes))


def _bwd(rounding, quantize_wgrad, impl, res, dy):
    x_q, x_s, g, u, h_q, h_s, (wg, wu, wd), layout, w_dtypes = res
    dt = g.dtype
    dy = dy.astype(dt)
    dh = mxfp8_gemm.dgrad(layout, dy, wd, rounding, impl)
    h = mx.dequantize(h_q, h_s, -1, dt)
    dw_down = mxfp8_gemm.wgrad(layout, h, dy, wd, rounding, quantize_wgrad)
    g32, u32, dh32 = g.astype(jnp.float32), u.astype(jnp.float32), dh.astype(jnp.float32)
    sig = jax.nn.sigmoid(g32)
    du = (dh32 * g32 * sig).astype(dt)
    dg = (dh32 * u32 * sig * (1.0 + g32 * (1.0 - sig))).astype(dt)
    dx = mxfp8_gemm.dgrad(layout, dg, wg, rounding, impl)
    dx = dx + mxfp8_gemm.dgrad(layout, du, wu, rounding, impl)
    x = mx.dequantize(x_q, x_s, -1, dt)
    dw_gate = mxfp8_gemm.wgrad(layout, x, dg, wg, rounding, quantize_wgrad)
    dw_up = mxfp8_gemm.wgrad(layout, x, du, wu, rounding, quantize_wgrad)
    dws = (dw_gate, dw_up, dw_down)
    dws = tuple(d.astype(t) for d, t in zip(dws, w_dtypes.dtypes, strict=True))
    return dx, *dws, mxfp8_gemm.no_cotangent(layout)


@functools.partial(jax.tree_util.register_dataclass, data_fields=[], meta_fields=["dtypes"])
@dataclasses.dataclass(frozen=True)
class _Dtypes:
    """The weights' dtypes, carried to the backward pass as static data."""

    dtypes: tuple


swiglu.defvjp(_fwd, _bwd)


def swiglu_reference(x, w_gate, w_up, w_down, layout: mxfp8_gemm.Layout, rounding: str = "rceil"):
    """The straightforward MXFP8 forward: round each GEMM operand through MXFP8 along the
    contracting dim (float32), then the layout's product in float32."""
    f = layout.product
    f32 = jnp.float32

    def rt(a, axis):
        return mx.quantize_dequantize(a.astype(f32), axis, rounding)

    g = f(rt(x, -1), rt(w_gate, -2))
    u = f(rt(x, -1), rt(w_up, -2))
    h = jax.nn.silu(g) * u
    return f(rt(h.astype(x.dtype), -1), rt(w_down, -2))
