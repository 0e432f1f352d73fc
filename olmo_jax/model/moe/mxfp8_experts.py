"""The routed experts' SwiGLU in MXFP8, as one custom-VJP unit, and the choice of expert
feed-forward functions for a precision.

    h = silu(x @ w_gate) * (x @ w_up);  y = h @ w_down

Forward: x quantized along D, w_gate/w_up along D, h along F, w_down along F; three MXFP8
GEMMs (`olmo_jax.model.mxfp8.mx_nt`); each weight is quantized both ways in one pass
(the fused kernel on a GPU). Saved for the backward pass: x and h as their MXFP8 form
(e4m3 values + e8m0 scales, about half of bf16; exactly what the forward GEMMs read, so
the weight gradients stay consistent with the forward), each weight's copy quantized for
the input-gradient GEMM (fp8 instead of the bf16 weight), and the gate and up
pre-activations g, u in the compute dtype (silu's derivative needs them unrounded).
Backward: input-gradient GEMMs in MXFP8 (dy and dg/du quantized along their contracting
dims, the weights along the other axis), weight-gradient GEMMs in the compute dtype on
the dequantized saved operands, or rounded through MXFP8 along the rows when
`mxfp8_wgrad`. Works on every expert layout (batched capacity buffers, blocked,
ragged via ragged_dot or the Pallas kernel).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from olmo_jax.kernels import mxfp8 as mx
from olmo_jax.model import mxfp8
from olmo_jax.model.config import MoEConfig
from olmo_jax.model.moe import experts, tiled


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def swiglu(x, w_gate, w_up, w_down, aux, layout: str, rounding: str, quantize_wgrad: bool):
    """MXFP8 SwiGLU over one expert layout (see olmo_jax.model.mxfp8.LAYOUTS)."""
    return _fwd(x, w_gate, w_up, w_down, aux, layout, rounding, quantize_wgrad)[0]


def _fwd(x, w_gate, w_up, w_down, aux, layout, rounding, quantize_wgrad):
    dt = x.dtype
    wg, wu, wd = (mxfp8.quantize_weight(w, rounding) for w in (w_gate, w_up, w_down))
    x_q, x_s = mx.quantize(x, -1, rounding)
    g = mxfp8.mx_nt(layout, x_q, x_s, wg.fwd_q, wg.fwd_s, aux, dt)
    u = mxfp8.mx_nt(layout, x_q, x_s, wu.fwd_q, wu.fwd_s, aux, dt)
    h = (jax.nn.silu(g.astype(jnp.float32)) * u.astype(jnp.float32)).astype(dt)
    h_q, h_s = mx.quantize(h, -1, rounding)
    y = mxfp8.mx_nt(layout, h_q, h_s, wd.fwd_q, wd.fwd_s, aux, dt)
    # The backward needs each weight only quantized along N (its dgrad copy).
    saved_w = tuple(w._replace(fwd_q=None, fwd_s=None) for w in (wg, wu, wd))
    dtypes = (w_gate.dtype, w_up.dtype, w_down.dtype)
    return y, (x_q, x_s, g, u, h_q, h_s, saved_w, aux, _Dtypes(dtypes))


def _bwd(layout, rounding, quantize_wgrad, res, dy):
    x_q, x_s, g, u, h_q, h_s, (wg, wu, wd), aux, w_dtypes = res
    dt = g.dtype
    dy = dy.astype(dt)
    dh = mxfp8.dgrad(layout, dy, wd, aux, rounding)
    h = mx.dequantize(h_q, h_s, -1, dt)
    dw_down = mxfp8.wgrad(layout, h, dy, wd, aux, rounding, quantize_wgrad)
    g32, u32, dh32 = g.astype(jnp.float32), u.astype(jnp.float32), dh.astype(jnp.float32)
    sig = jax.nn.sigmoid(g32)
    du = (dh32 * g32 * sig).astype(dt)
    dg = (dh32 * u32 * sig * (1.0 + g32 * (1.0 - sig))).astype(dt)
    dx = mxfp8.dgrad(layout, dg, wg, aux, rounding)
    dx = dx + mxfp8.dgrad(layout, du, wu, aux, rounding)
    x = mx.dequantize(x_q, x_s, -1, dt)
    dw_gate = mxfp8.wgrad(layout, x, dg, wg, aux, rounding, quantize_wgrad)
    dw_up = mxfp8.wgrad(layout, x, du, wu, aux, rounding, quantize_wgrad)
    aux_ct = None if aux is None else np.zeros(aux.shape, jax.dtypes.float0)
    dws = (dw_gate, dw_up, dw_down)
    dws = tuple(d.astype(t) for d, t in zip(dws, w_dtypes.dtypes, strict=True))
    return dx, *dws, aux_ct


@functools.partial(jax.tree_util.register_dataclass, data_fields=[], meta_fields=["dtypes"])
@dataclasses.dataclass(frozen=True)
class _Dtypes:
    """The weights' dtypes, carried to the backward pass as static data."""

    dtypes: tuple


swiglu.defvjp(_fwd, _bwd)


def swiglu_reference(x, w_gate, w_up, w_down, aux, layout: str, rounding: str = "rceil"):
    """The straightforward MXFP8 forward: round each GEMM operand through MXFP8 along the
    contracting dim (float32), then the layout's product in float32."""
    f = mxfp8.LAYOUTS[layout]
    f32 = jnp.float32

    def rt(a, axis):
        return mx.quantize_dequantize(a.astype(f32), axis, rounding)

    g = f(rt(x, -1), rt(w_gate, -2), aux)
    u = f(rt(x, -1), rt(w_up, -2), aux)
    h = jax.nn.silu(g) * u
    return f(rt(h.astype(x.dtype), -1), rt(w_down, -2), aux)


# ----------------------------------------------------------------------------- layouts


class ExpertFFNs(NamedTuple):
    """The expert feed-forward per layout, with experts.ffn_* signatures."""

    ragged: object  # (x_RD, group_sizes_E, w_gate, w_up, w_down) -> y_RD
    batched: object  # (x_GCD, w_gate_GDF, w_up_GDF, w_down_GFD) -> y_GCD
    blocked: object  # (x_PD, block_expert_B, w_gate, w_up, w_down) -> y_PD
    tiled: object  # (x_PD, group_sizes_E, w_gate, w_up, w_down) -> y_PD, padded layout


def expert_ffns(cfg: MoEConfig, impl: str) -> ExpertFFNs:
    """The expert FFNs for cfg.precision; `impl` (resolved gmm_impl) picks the ragged
    product: jax.lax.ragged_dot, or the Pallas grouped matmul for "pallas"."""
    if cfg.precision == "bf16":
        if impl == "pallas":
            from olmo_jax.kernels.grouped_matmul import grouped_matmul

            ragged = functools.partial(experts.ffn_ragged, gmm=grouped_matmul)
        else:
            ragged = experts.ffn_ragged
        return ExpertFFNs(ragged, experts.ffn_batched, experts.ffn_blocked, tiled.ffn_tiled)
    rounding, qw = "rceil", cfg.mxfp8_wgrad
    ragged_layout = "pallas" if impl == "pallas" else "ragged"

    def ragged_mx(x_RD, group_sizes_E, w_gate, w_up, w_down):
        gs = group_sizes_E.astype(jnp.int32)
        return swiglu(x_RD, w_gate, w_up, w_down, gs, ragged_layout, rounding, qw)

    def batched_mx(x_GCD, w_gate, w_up, w_down):
        return swiglu(x_GCD, w_gate, w_up, w_down, None, "batched", rounding, qw)

    def blocked_mx(x_PD, block_expert_B, w_gate, w_up, w_down):
        P, D = x_PD.shape
        nb = block_expert_B.shape[0]
        x_BbD = x_PD.reshape(nb, P // nb, D)
        y = swiglu(x_BbD, w_gate, w_up, w_down, block_expert_B, "blocked", rounding, qw)
        return y.reshape(P, D)

    def tiled_mx(*args):
        raise ValueError("model.moe.gmm_impl=tiled has no MXFP8 version: use gmm_impl=auto or einsum")

    return ExpertFFNs(ragged_mx, batched_mx, blocked_mx, tiled_mx)
