"""MXFP8 GEMMs for the model: every GEMM operand quantized in blocks of 32 along that
GEMM's contracting dimension (`olmo_jax.kernels.mxfp8_quant`), forward and input-gradient
GEMMs in MXFP8, weight-gradient GEMMs in the compute dtype (optionally on MXFP8-rounded
operands too).

A layout is a small typed value naming a bilinear product f(a, w) = layout.product(a, w)
between rows `a` and weights `w` whose contracting dimension is a's last and w's
second-to-last (w is [K, N] or [E, K, N]); its fields are what the product needs:
  Dense()                 a [M, K] @ w [K, N]                 (attention projections)
  Batched()               a [G, C, K], w [G, K, N] per group   (capacity buffers)
  Blocked(block_expert_U) a [B, b, K], w [E, K, N], block i uses expert block_expert_U[i]
  Ragged(group_sizes_G)   a [R, K] sorted by expert: jax.lax.ragged_dot
  Pallas(group_sizes_G)   the same with the Pallas grouped-matmul kernels (olmo_jax.kernels)
The input and weight gradients of any layout are the vjp of f, so the MXFP8 versions
below need only f:
  forward  y  = f(Q(a) along K, Q(w) along K)
  dgrad    da = vjp_a f(., Q(w) along N) applied to Q(dy) along N
  wgrad    dw = vjp_w f(a_saved, .) applied to dy (bf16), or both rounded through MXFP8
              along the rows when `quantize_wgrad`
Each weight is quantized both ways in one pass in the forward (`quantize_weight`); the
backward keeps its N-quantized copy (fp8) instead of the bf16 weight.
`mx_nt` runs one quantized GEMM as `impl` says (`model.mxfp8_gemm_impl`; which runs where:
the table of olmo_jax/kernels/select.py; a model built from a parallel plan holds the
name resolved for its mesh, one used without a plan resolves "auto" for its default
device): scaled_matmul, `jax.nn.scaled_matmul` (cuDNN's block-scaled GEMM, Blackwell) for
the dense, batched and blocked layouts; dequantize, and for the ragged layouts always, an
emulation that dequantizes (exact in float32) and runs f in the compute dtype, so both
agree up to accumulation order.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from olmo_jax.kernels import mxfp8_quant as mx
from olmo_jax.kernels import select, vma
from olmo_jax.kernels.vma import cotangent_like

# GEMM precisions: model.attention_precision, model.moe.precision and the dispatch payload
# (model/moe/payload.py); bf16 = the compute dtype, mxfp8 = the block-scaled GEMMs here.
PRECISIONS = ("bf16", "mxfp8")


def _layout(cls):
    """A layout type: a frozen dataclass whose array fields are pytree data (traced)."""
    return jax.tree_util.register_dataclass(dataclasses.dataclass(frozen=True)(cls))


@_layout
class Dense:
    """a [M, K] @ w [K, N] (attention projections)."""

    scaled_matmul = True  # jax.nn.scaled_matmul runs it on block-scaled MMA

    def product(self, a, w):
        return jnp.dot(a, w)


@_layout
class Batched:
    """a [G, C, K], w [G, K, N]: one product per group (capacity buffers)."""

    scaled_matmul = True

    def product(self, a, w):
        return jnp.einsum("gck,gkn->gcn", a, w)


@_layout
class Blocked:
    """a [B, b, K], w [E, K, N]: block i uses expert block_expert_U[i] (dropless blocked)."""

    block_expert_U: jax.Array
    scaled_matmul = True

    def product(self, a, w):
        return jnp.einsum("bck,bkn->bcn", a, w[self.block_expert_U])


@_layout
class Ragged:
    """a [R, K] sorted by expert, group_sizes_G rows per expert: jax.lax.ragged_dot."""

    group_sizes_G: jax.Array
    scaled_matmul = False

    def product(self, a, w):
        return jax.lax.ragged_dot(a, w, self.group_sizes_G)


@_layout
class Pallas:
    """Ragged on the Pallas grouped-matmul kernels (olmo_jax/kernels/grouped_matmul.py);
    its weight gradient is the kernel's own (tgmm), not the product's transpose;
    `priced_rows`: the rows the kernels declare their cost over (buffer.Runs.balanced_rows)."""

    group_sizes_G: jax.Array
    priced_rows: int = dataclasses.field(default=0, metadata={"static": True})
    scaled_matmul = False

    def product(self, a, w):
        from olmo_jax.kernels.grouped_matmul import grouped_matmul

        return grouped_matmul(a, w, self.group_sizes_G, priced_rows=self.priced_rows)

    def weight_grad(self, a, dy):
        from olmo_jax.kernels import grouped_matmul as gm

        config = gm.with_priced_rows(None, self.priced_rows, a.shape[1], dy.shape[1])
        return gm.tgmm(a, dy, self.group_sizes_G, config=config)


Layout = Dense | Batched | Blocked | Ragged | Pallas
DENSE = Dense()


def no_cotangent(layout: Layout):
    """The (float0) cotangent of a layout's integer fields, for a custom VJP."""
    return jax.tree.map(lambda a: np.zeros(a.shape, jax.dtypes.float0), layout)


def quantize(x, axis: int, rounding: str):
    """mx.quantize, padding `axis` with zeros to a multiple of 32 when needed (zeros do
    not change a block's maximum); the pad is sliced off after dequantizing."""
    n = x.shape[axis]
    pad = -n % mx.BLOCK
    if pad:
        widths = [(0, 0)] * x.ndim
        widths[axis % x.ndim] = (0, pad)
        x = jnp.pad(x, widths)
    return mx.quantize(x, axis, rounding)


def dequantize(q, s, axis: int, dtype, n: int | None = None):
    x = mx.dequantize(q, s, axis, dtype)
    if n is not None and x.shape[axis] != n:
        x = jax.lax.slice_in_dim(x, 0, n, axis=axis % x.ndim)
    return x


def round_trip(x, axis: int, rounding: str):
    """x as an MXFP8 GEMM along `axis` sees it, in x's dtype."""
    q, s = quantize(x, axis, rounding)
    return dequantize(q, s, axis, x.dtype, x.shape[axis])


def gemm_impl(impl: str) -> str:
    """The MXFP8 GEMM the model runs: `impl`, or for "auto" (no plan resolved it) the
    table's choice for the default device (module docstring)."""
    if impl != "auto":
        return impl
    return select.resolve_mxfp8_gemm_impl("auto", select.local_target())


def use_scaled_matmul(layout: Layout, impl: str = "auto") -> bool:
    """`layout`'s GEMMs run on jax.nn.scaled_matmul for model.mxfp8_gemm_impl=`impl`."""
    return layout.scaled_matmul and gemm_impl(impl) == "scaled_matmul"


def mx_nt(layout: Layout, a_q, a_s, bt_q, bt_s, dtype, impl: str = "auto"):
    """One MXFP8 GEMM: rows a [..., K] and weights given transposed, bt [.., N, K], both
    quantized along K (their last dim). Returns layout.product(a, bt^T) in `dtype`;
    `impl`: model.mxfp8_gemm_impl (module docstring)."""
    if use_scaled_matmul(layout, impl):
        if isinstance(layout, Blocked):
            bt_q, bt_s = bt_q[layout.block_expert_U], bt_s[layout.block_expert_U]
        if isinstance(layout, Dense):
            out = jax.nn.scaled_matmul(a_q[None], bt_q[None], a_s[None], bt_s[None])[0]
        else:
            out = jax.nn.scaled_matmul(a_q, bt_q, a_s, bt_s)
        # cuDNN's block-scaled GEMM (a custom call) types its output device-invariant
        # inside shard_map; it holds per-device rows, so type it like its operands.
        return vma.like(out.astype(dtype), a_q, bt_q)
    a = mx.dequantize(a_q, a_s, -1, dtype)
    w = jnp.swapaxes(mx.dequantize(bt_q, bt_s, -1, dtype), -1, -2)
    return layout.product(a, w).astype(dtype)


class WeightQ(NamedTuple):
    """A weight w [.., K, N] quantized both ways, from one pass over it
    (`olmo_jax.kernels.mxfp8_quant.quantize_rowcol`: the fused kernel on a GPU):
    fwd_q, fwd_s    along K, transposed to [.., N, K] and [.., N, K/32] (forward GEMM)
    dgrad_q, dgrad_s along N: [.., K, N] and [.., K, N/32] (input-gradient GEMM; this
                    copy, not the bf16 weight, is what the backward pass keeps)"""

    fwd_q: jax.Array
    fwd_s: jax.Array
    dgrad_q: jax.Array
    dgrad_s: jax.Array


def quantize_weight(w, rounding: str) -> WeightQ:
    *lead, K, N = w.shape
    if K % mx.BLOCK:
        raise ValueError(f"MXFP8 weight: contracting size {K} is not a multiple of {mx.BLOCK}")
    q_n, s_n, q_k, s_k = mx.quantize_rowcol(w.reshape(-1, N), rounding)  # [L*K, N] view
    q_k = q_k.reshape(*lead, K, N)
    s_k = s_k.reshape(*lead, K // mx.BLOCK, N)
    return WeightQ(
        jnp.swapaxes(q_k, -1, -2),
        jnp.swapaxes(s_k, -1, -2),
        q_n.reshape(*lead, K, N),
        s_n.reshape(*lead, K, N // mx.BLOCK),
    )


def forward(layout: Layout, a, wq: WeightQ, rounding, impl: str = "auto"):
    """(y, (a_q, a_s)): the forward GEMM and a's quantized form (saved for backward)."""
    a_q, a_s = mx.quantize(a, -1, rounding)
    return mx_nt(layout, a_q, a_s, wq.fwd_q, wq.fwd_s, a.dtype, impl), (a_q, a_s)


def dgrad(layout: Layout, dy, wq: WeightQ, rounding, impl: str = "auto"):
    """dL/da of f(a, w): Q(dy along N) times Q(w along N)^T."""
    dy_q, dy_s = mx.quantize(dy, -1, rounding)
    return mx_nt(layout, dy_q, dy_s, wq.dgrad_q, wq.dgrad_s, dy.dtype, impl)


def wgrad(layout: Layout, a, dy, wq: WeightQ, rounding, quantize_wgrad: bool):
    """dL/dw of f(a, w) for cotangent dy: the transpose of the linear map w -> f(a, w)
    (no forward product is run). With quantize_wgrad, a and dy are first rounded through
    MXFP8 along the rows (axis -2). Returns a's dtype."""
    dy = dy.astype(a.dtype)
    if quantize_wgrad:
        a, dy = round_trip(a, -2, rounding), round_trip(dy, -2, rounding)
    if isinstance(layout, Pallas):  # a kernel typed like (a, dy): summed to the weight's axes
        return cotangent_like(layout.weight_grad(a, dy).astype(a.dtype), wq.dgrad_q)
    # w's type (shape, dtype, and inside shard_map its manual axes), from a saved copy;
    # the conversion is dead code after the transpose and is never computed.
    w_like = wq.dgrad_q.astype(a.dtype)
    (dw,) = jax.linear_transpose(lambda w_: layout.product(a, w_), w_like)(dy)
    return dw


# ----------------------------------------------------------------------------- dense


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def dense(x_MK, w_KN, rounding: str = "rceil", quantize_wgrad: bool = False, impl: str = "auto"):
    """x @ w in MXFP8 (forward and input gradient), weight gradient in x's dtype; `impl`:
    model.mxfp8_gemm_impl (module docstring)."""
    return _dense_fwd(x_MK, w_KN, rounding, quantize_wgrad, impl)[0]


def _dense_fwd(x_MK, w_KN, rounding, quantize_wgrad, impl):
    wq = quantize_weight(w_KN, rounding)
    y, (x_q, x_s) = forward(DENSE, x_MK, wq, rounding, impl)
    return y, (x_q, x_s, wq._replace(fwd_q=None, fwd_s=None))


def _dense_bwd(rounding, quantize_wgrad, impl, res, dy):
    x_q, x_s, wq = res
    dt = dy.dtype
    x = mx.dequantize(x_q, x_s, -1, dt)
    dx = dgrad(DENSE, dy, wq, rounding, impl)
    dw = wgrad(DENSE, x, dy, wq, rounding, quantize_wgrad)
    return dx, dw


dense.defvjp(_dense_fwd, _dense_bwd)


_EINSUM = re.compile(r"^([a-z]+),([a-z]+)->([a-z]+)$")


@functools.cache
def _einsum_plan(spec: str):
    m = _EINSUM.match(spec.replace(" ", ""))
    if not m:
        raise ValueError(f"mxfp8 einsum: cannot parse {spec!r}")
    xs, ws, out = m.groups()
    contracted = "".join(c for c in xs if c in ws and c not in out)
    batch, w_rest = xs[: len(xs) - len(contracted)], ws[len(contracted):]
    if xs != batch + contracted or ws != contracted + w_rest or out != batch + w_rest:
        raise ValueError(
            f"mxfp8 einsum {spec!r}: needs x = batch + contracted, w = contracted + rest, "
            "out = batch + rest (a plain matmul after reshaping)"
        )
    return len(batch), len(contracted)


def einsum(spec: str, x, w, rounding: str = "rceil", quantize_wgrad: bool = False,
           impl: str = "auto"):
    """An einsum that is one matmul after reshaping (e.g. "btd,dnh->btnh"), in MXFP8;
    `impl`: model.mxfp8_gemm_impl (module docstring)."""
    nb, nc = _einsum_plan(spec)
    batch, contracted, rest = x.shape[:nb], w.shape[:nc], w.shape[nc:]
    k = 1
    for d in contracted:
        k *= d
    y = dense(x.reshape(-1, k), w.reshape(k, -1), rounding, quantize_wgrad, impl)
    return y.reshape(*batch, *rest)
