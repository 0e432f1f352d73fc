"""The attention block after its q/k/v GEMM as XLA FFI calls on CPUs
(`model.attention_impl=blas`, olmo_jax/kernels/select.py; C++ in cpu_attention.cc):
- `qk_prep`: QK-norm, clipping and RoPE, row by row, from the GEMM's [B, T, (N + 2K) H]
  output to q, k and v;
- `causal_attention`: the core, flash attention's math in query blocks of 64 rows, each
  block's scores one SGEMM through numpy's OpenBLAS into a per-thread buffer, the blocks
  above the diagonal skipped; the forward saves only the output and the log-sum-exp.
  With segment ids (document masking) or a sliding window each query attends only to
  the keys from its first key on (its document's start, its window's): the kernel reads
  the first key of every query (int32 [B, T]) and skips the keys before a query block's
  first query's first key too;
Forward and each custom VJP's backward are one call each.

q [B, T, N, H], k and v [B, T, K, H] (grouped-query: query head n uses kv head n // (N/K)),
in the projections' own layout, so no head-major transposes are made. float32 only.
Reference: olmo_jax/model/attention.py's xla core and the naive softmax in the tests.
The C++ is built on first use with the other CPU kernels (olmo_jax/kernels/cpu_ffi.py).
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from olmo_jax import shapes
from olmo_jax.kernels import cpu_ffi
from olmo_jax.kernels.vma import cotangent_like

FWD, BWD = "olmo_cpu_attention_fwd", "olmo_cpu_attention_bwd"
DOC_FWD, DOC_BWD = "olmo_cpu_attention_doc_fwd", "olmo_cpu_attention_doc_bwd"
PREP_FWD, PREP_BWD = "olmo_cpu_attention_prep_fwd", "olmo_cpu_attention_prep_bwd"
NORMS = {None: 0, "head": 1, "all": 2}  # qk_prep's `norm` -> the kernel's attribute
BLOCK = 64  # query rows per block of the kernel (its `block` attribute)


def computed_fraction(T: int) -> float:
    """The share of the [T, T] scores the kernel computes: query block [r0, r1) against
    keys [0, r1)."""
    starts = range(0, T, BLOCK)
    return sum((min(T, r0 + BLOCK) - r0) * min(T, r0 + BLOCK) for r0 in starts) / (T * T)


def _fwd_call(q_BTNH, k_BTKH, v_BTKH, start_BT):
    B, T, N, _ = q_BTNH.shape
    outs = (jax.ShapeDtypeStruct(q_BTNH.shape, q_BTNH.dtype),
            jax.ShapeDtypeStruct((B, N, T), jnp.float32))
    if start_BT is None:
        return cpu_ffi.call(FWD, outs, q_BTNH, k_BTKH, v_BTKH, block=np.int64(BLOCK))
    return cpu_ffi.call(DOC_FWD, outs, q_BTNH, k_BTKH, v_BTKH, start_BT, block=np.int64(BLOCK))


@jax.custom_vjp
def _attention(q_BTNH, k_BTKH, v_BTKH, start_BT):
    return _fwd_call(q_BTNH, k_BTKH, v_BTKH, start_BT)[0]


def _attention_fwd(q_BTNH, k_BTKH, v_BTKH, start_BT):
    o_BTNH, lse_BNT = _fwd_call(q_BTNH, k_BTKH, v_BTKH, start_BT)
    return o_BTNH, (q_BTNH, k_BTKH, v_BTKH, start_BT, o_BTNH, lse_BNT)


def _attention_bwd(res, do_BTNH):
    q_BTNH, k_BTKH, v_BTKH, start_BT, o_BTNH, lse_BNT = res
    outs = tuple(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in (q_BTNH, k_BTKH, v_BTKH))
    doc = () if start_BT is None else (start_BT,)
    dq_BTNH, dk_BTKH, dv_BTKH = cpu_ffi.call(
        BWD if start_BT is None else DOC_BWD, outs, q_BTNH, k_BTKH, v_BTKH, *doc, o_BTNH,
        lse_BNT, do_BTNH.astype(q_BTNH.dtype), block=np.int64(BLOCK))
    return (cotangent_like(dq_BTNH, q_BTNH), cotangent_like(dk_BTKH, k_BTKH),
            cotangent_like(dv_BTKH, v_BTKH), None)


_attention.defvjp(_attention_fwd, _attention_bwd)


def first_keys(B: int, T: int, segment_ids_BT: jax.Array | None, window: int) -> jax.Array:
    """The first key each query may attend, int32 [B, T], non-decreasing along a row: the
    position where its segment began (equal ids contiguous along a row; 0 without
    segments), and with a `window` W > 0 no earlier than t - W + 1."""
    t_BT = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    first_BT = jnp.zeros((B, T), jnp.int32)
    if segment_ids_BT is not None:
        starts_BT = jnp.concatenate(
            [jnp.ones((B, 1), bool), segment_ids_BT[:, 1:] != segment_ids_BT[:, :-1]], axis=1)
        first_BT = jax.lax.cummax(jnp.where(starts_BT, t_BT, 0), axis=1)
    if window > 0:
        first_BT = jnp.maximum(first_BT, t_BT - (window - 1))
    return first_BT


@shapes.check("-> B T N H")
def causal_attention(q_BTNH: jax.Array, k_BTKH: jax.Array, v_BTKH: jax.Array,
                     segment_ids_BT: jax.Array | None = None, window: int = 0) -> jax.Array:
    """softmax(q k^T / sqrt(H)) v under a causal mask, [B, T, N, H] (float32 only);
    differentiable in q, k and v. `segment_ids_BT` (int32 [B, T]): a query attends only
    to keys of its own segment (None = causal only); `window` > 0: only to the last
    `window` keys up to its own position (sliding window). Raises Unavailable (with the reason)
    where the kernels cannot be built, ValueError for other dtypes or shapes."""
    arrays = (q_BTNH, k_BTKH, v_BTKH)
    if any(jnp.dtype(a.dtype) != jnp.float32 for a in arrays):
        raise ValueError(
            f"model.attention_impl=blas runs float32, got {[a.dtype.name for a in arrays]}: "
            "set model.dtype=float32 or model.attention_impl=auto")
    B, T, N, H = q_BTNH.shape
    K = k_BTKH.shape[2]
    if k_BTKH.shape != (B, T, K, H) or v_BTKH.shape != k_BTKH.shape or N % K:
        raise ValueError(f"cpu attention: q {q_BTNH.shape}, k {k_BTKH.shape}, v {v_BTKH.shape}: "
                         "want q [B, T, N, H], k and v [B, T, K, H] with N % K == 0")
    cpu_ffi.require("model.attention_impl=xla")
    start_BT = None
    if segment_ids_BT is not None or window > 0:
        start_BT = first_keys(B, T, segment_ids_BT, window)
    return _attention(*arrays, start_BT)


def _prep_attrs(n_heads, kv_heads, norm, eps, clip):
    return {"n_heads": np.int64(n_heads), "kv_heads": np.int64(kv_heads),
            "norm": np.int64(NORMS[norm]), "eps": np.float32(eps), "clip": np.float32(clip or 0.0)}


def _prep_outs(qkv_BTJ, n_heads, kv_heads):
    B, T, J = qkv_BTJ.shape
    H = J // (n_heads + 2 * kv_heads)
    return tuple(jax.ShapeDtypeStruct((B, T, n, H), qkv_BTJ.dtype)
                 for n in (n_heads, kv_heads, kv_heads))


@partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8, 9))
def _prep(qkv_BTJ, q_w, k_w, cos_TH, sin_TH, n_heads, kv_heads, norm, eps, clip):
    return cpu_ffi.call(PREP_FWD, _prep_outs(qkv_BTJ, n_heads, kv_heads), qkv_BTJ, q_w, k_w,
                        cos_TH, sin_TH, **_prep_attrs(n_heads, kv_heads, norm, eps, clip))


def _prep_fwd(qkv_BTJ, q_w, k_w, cos_TH, sin_TH, n_heads, kv_heads, norm, eps, clip):
    out = _prep(qkv_BTJ, q_w, k_w, cos_TH, sin_TH, n_heads, kv_heads, norm, eps, clip)
    return out, (qkv_BTJ, q_w, k_w, cos_TH, sin_TH)


def _prep_bwd(n_heads, kv_heads, norm, eps, clip, res, cts):
    qkv_BTJ, q_w, k_w, cos_TH, sin_TH = res
    outs = tuple(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in (qkv_BTJ, q_w, k_w))
    dqkv_BTJ, dq_w, dk_w = cpu_ffi.call(
        PREP_BWD, outs, qkv_BTJ, q_w, k_w, cos_TH, sin_TH,
        *(ct.astype(qkv_BTJ.dtype) for ct in cts), **_prep_attrs(n_heads, kv_heads, norm, eps, clip))
    return (cotangent_like(dqkv_BTJ, qkv_BTJ), cotangent_like(dq_w, q_w),
            cotangent_like(dk_w, k_w), jnp.zeros_like(cos_TH), jnp.zeros_like(sin_TH))


_prep.defvjp(_prep_fwd, _prep_bwd)


@shapes.check("cos_TH: ... T H", "sin_TH: ... T H", "-> B T N H, B T K H, B T K H")
def qk_prep(qkv_BTJ: jax.Array, n_heads: int, kv_heads: int, cos_TH: jax.Array,
            sin_TH: jax.Array, *, norm: str | None = None, q_norm=None, k_norm=None,
            eps: float = 1e-6, clip: float | None = None):
    """(q [B, T, N, H], k and v [B, T, K, H]) from the projections' [B, T, (N + 2K) H]
    output [q | k | v]: q and k RMS-normalized (`norm` "head": each head over H with one
    [H] weight; "all": all heads of q (of k) together, [N, H] / [K, H] weights; None: no
    norm), then clamped to [-clip, clip] (None: not clamped; v is clamped too), then
    rotated (RoPE, rotate half, the [T, H] cos / sin tables, or [B, T, H] per row); float32 only. The
    attention block's element-wise work before the core as one FFI call each way;
    differentiable in qkv and the norm weights (the tables are constants)."""
    if jnp.dtype(qkv_BTJ.dtype) != jnp.float32:
        raise ValueError(f"model.attention_impl=blas runs float32, got {qkv_BTJ.dtype}: set "
                         "model.dtype=float32 or model.attention_impl=auto")
    cpu_ffi.require("model.attention_impl=xla")
    dummy = jnp.zeros((1,), jnp.float32)
    q_w = dummy if norm is None else q_norm.reshape(-1).astype(jnp.float32)
    k_w = dummy if norm is None else k_norm.reshape(-1).astype(jnp.float32)
    q, k, v = _prep(qkv_BTJ, q_w, k_w, cos_TH.astype(jnp.float32), sin_TH.astype(jnp.float32),
                    n_heads, kv_heads, norm, float(eps), float(clip or 0.0))
    return q, k, v
