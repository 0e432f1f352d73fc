"""MXFP8 (OCP microscaling): blocks of 32 values along one axis share an e8m0 scale
(a power of two); the values are float8_e4m3fn. Quantize, dequantize, the packed dispatch
payload, and a fused Pallas Mosaic GPU kernel writing the row-wise and column-wise
quantized copies of a matrix in one pass; the jnp functions are the reference.

Scale of a block with absolute maximum `amax` (taken as an integer max over the bit
patterns of |x|, so NaN is seen), as a biased e8m0 exponent e (scale 2^(e-127)):
  rceil (default)  the smallest power of two >= amax / 448 (448 = e4m3's largest value):
                   e = exponent(amax / 448), plus one when its mantissa is not zero; the
                   same rule as NVIDIA's cvt.rp.satfinite.ue8m0 (no value saturates)
  floor            OCP's rule: e = floor(log2(amax)) - 8 (8 = e4m3's largest exponent);
                   values above 448 after scaling saturate to +-448
Values: x * 2^(127-e), clipped to +-448 (satfinite), rounded to nearest even e4m3.
e is clamped to [0, 254]; a block holding inf or NaN gets e = 255, e8m0's NaN, so it
dequantizes to NaN. All steps are exact float32 and integer operations (one division by
448 for rceil, correctly rounded everywhere), so the kernel matches the reference bit for
bit (interpret mode on CPU; on a GPU, tools/gpu_check.py compares them).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from olmo_jax import compat, shapes
from olmo_jax.kernels import platform, vma

BLOCK = 32
E4M3_MAX = 448.0
E4M3_MAX_EXP = 8
ROUNDINGS = ("rceil", "floor")
VALUE_DTYPE = jnp.float8_e4m3fn
SCALE_DTYPE = jnp.float8_e8m0fnu


def _check_rounding(rounding: str) -> None:
    if rounding not in ROUNDINGS:
        raise ValueError(f"MXFP8 scale rounding {rounding!r}: choose one of {ROUNDINGS}")


def abs_bits(x_f32):
    """|x| as int32 bit patterns. For non-negative floats the integer order is the float
    order with NaN above inf, so an integer max over a block is its absolute maximum and
    sees NaN (a float max reduction may drop NaN)."""
    return lax.bitcast_convert_type(x_f32, jnp.int32) & 0x7FFFFFFF


def scale_exponent(amax_bits, rounding: str = "rceil"):
    """Biased e8m0 exponent (int32 in [0, 255]) of blocks whose absolute maximum has the
    bit pattern `amax_bits` (int32, from abs_bits). Integer and exact float32 operations
    only (the kernel runs the same code)."""
    finite = ((amax_bits >> 23) & 0xFF) != 0xFF
    if rounding == "rceil":
        amax = lax.bitcast_convert_type(amax_bits, jnp.float32)
        s_bits = lax.bitcast_convert_type(amax / E4M3_MAX, jnp.int32)
        e = ((s_bits >> 23) & 0xFF) + ((s_bits & 0x7FFFFF) != 0).astype(jnp.int32)
    elif rounding == "floor":
        e = ((amax_bits >> 23) & 0xFF) - E4M3_MAX_EXP
    else:
        _check_rounding(rounding)
    e = jnp.minimum(jnp.maximum(e, 0), 254)
    return jnp.where(finite, e, 255)


def _inverse_scale(e):
    """2^(127 - e) as float32 for e in [0, 254] (exact: built from its exponent bits)."""
    return lax.bitcast_convert_type((254 - jnp.minimum(e, 254)) << 23, jnp.float32)


def _to_e4m3(v_f32):
    return jnp.clip(v_f32, -E4M3_MAX, E4M3_MAX).astype(VALUE_DTYPE)


def _e8m0(e):
    return lax.bitcast_convert_type(e.astype(jnp.uint8), SCALE_DTYPE)


def quantize(x, axis: int = -1, rounding: str = "rceil"):
    """(values e4m3 shaped like x, scales e8m0 with x.shape[axis] / 32 along `axis`)."""
    _check_rounding(rounding)
    axis = axis % x.ndim
    n = x.shape[axis]
    if n % BLOCK:
        raise ValueError(
            f"MXFP8 quantizes blocks of {BLOCK} along axis {axis}, whose size {n} is not a "
            f"multiple of {BLOCK}"
        )
    xm = jnp.moveaxis(x, axis, -1).astype(jnp.float32)
    xb = xm.reshape(*xm.shape[:-1], n // BLOCK, BLOCK)
    e = scale_exponent(jnp.max(abs_bits(xb), axis=-1), rounding)
    q = _to_e4m3(xb * _inverse_scale(e)[..., None]).reshape(xm.shape)
    return jnp.moveaxis(q, -1, axis), jnp.moveaxis(_e8m0(e), -1, axis)


def dequantize(q, scales, axis: int = -1, dtype=jnp.float32):
    """values * their block's scale, in float32 (exact), cast to dtype."""
    axis = axis % q.ndim
    s = jnp.repeat(scales.astype(jnp.float32), BLOCK, axis=axis)
    return (q.astype(jnp.float32) * s).astype(dtype)


def quantize_dequantize(x, axis: int = -1, rounding: str = "rceil", dtype=None):
    """x rounded through MXFP8 along `axis` (what an MXFP8 GEMM sees of x)."""
    q, s = quantize(x, axis, rounding)
    return dequantize(q, s, axis, dtype or x.dtype)


# ----------------------------------------------------------------------------- payload


@shapes.check("-> R D+D/32")
def pack_rows(x_RD, rounding: str = "rceil"):
    """One uint8 array [R, D + D/32] holding the e4m3 values then the e8m0 scales of each
    row, quantized along D: the bytes that travel (0.516x of bfloat16)."""
    q, s = quantize(x_RD, -1, rounding)
    return jnp.concatenate(
        [lax.bitcast_convert_type(q, jnp.uint8), lax.bitcast_convert_type(s, jnp.uint8)], -1
    )


@shapes.check("-> R J*32/33")
def unpack_rows(packed_RJ, dtype=jnp.bfloat16):
    """Inverse of pack_rows: [R, J = D + D/32] uint8 -> [R, D] dequantized."""
    width = packed_RJ.shape[-1]
    D = width * BLOCK // (BLOCK + 1)
    if D + D // BLOCK != width or D % BLOCK:
        raise ValueError(f"not an MXFP8 row payload: last dim {width} is not D + D/32")
    q = lax.bitcast_convert_type(packed_RJ[..., :D], VALUE_DTYPE)
    s = lax.bitcast_convert_type(packed_RJ[..., D:], SCALE_DTYPE)
    return dequantize(q, s, -1, dtype)


# ----------------------------------------------------------------------------- row + col


_ROWCOL = "-> M K, M K/32, M K, M/32 K"  # (q_row, s_row, q_col, s_col)


@shapes.check(_ROWCOL)
def quantize_rowcol_reference(x_MK, rounding: str = "rceil"):
    """(q_row, s_row [M, K/32]) quantized along K and (q_col, s_col [M/32, K]) along M."""
    q_row, s_row = quantize(x_MK, 1, rounding)
    q_col, s_col = quantize(x_MK, 0, rounding)
    return q_row, s_row, q_col, s_col


def rowcol_kernel_fits(shape) -> bool:
    """Shapes the fused kernel takes: M a multiple of 64 (one warpgroup's row tile),
    K a multiple of 128 (a row of the tile spread over the 128 threads)."""
    return len(shape) == 2 and shape[0] % 64 == 0 and shape[1] % 128 == 0


@shapes.check(_ROWCOL)
def quantize_rowcol_pallas(x_MK, rounding: str = "rceil", block_m: int = 64, block_k: int = 0):
    """The fused Pallas kernel: reads each [block_m, block_k] tile of x once (TMA into
    SMEM), writes both quantized copies and both scale arrays. One program per row block,
    pipelined over the K tiles. Same outputs as quantize_rowcol_reference, bit for bit."""
    _check_rounding(rounding)
    platform.require_kernel_platform("quantize_rowcol_pallas")
    M, K = x_MK.shape
    if not rowcol_kernel_fits(x_MK.shape) or M % block_m or block_m % 64:
        raise ValueError(
            f"quantize_rowcol_pallas needs M % 64 == 0 and K % 128 == 0 (and block_m | M), "
            f"got {x_MK.shape} block_m={block_m}; use quantize_rowcol_reference"
        )
    bk = block_k or (256 if K % 256 == 0 else 128)
    bm, g = block_m, bk // BLOCK
    x3 = x_MK.reshape(M, K // BLOCK, BLOCK)

    def tile(x_s, qr_s, sr_g, qc_s, sc_g):
        # Row-wise (blocks along K): group j of the tile is the [bm, 32] slab x[:, j, :].
        @pl.loop(0, g)
        def _row_group(j):
            v = plgpu.load(x_s.at[:, j, :], layout=plgpu.Layout.WGMMA, optimized=False)
            v = v.astype(jnp.float32)
            e = scale_exponent(jnp.max(abs_bits(v), axis=1), rounding)
            inv = plgpu.layout_cast(
                lax.broadcast_in_dim(_inverse_scale(e), (bm, BLOCK), (0,)), plgpu.Layout.WGMMA
            )
            compat.gpu_store(qr_s.at[:, j, :], _to_e4m3(v * inv))
            compat.gpu_store(sr_g.at[j], e.astype(jnp.uint8))

        # Column-wise (blocks along M): 32 consecutive rows share a scale per column.
        @pl.loop(0, bm // BLOCK)
        def _col_group(i):
            rows = i * BLOCK

            def amax_step(t, amax):
                return jnp.maximum(amax, abs_bits(x_s[rows + t].astype(jnp.float32)))

            amax = lax.fori_loop(1, BLOCK, amax_step, abs_bits(x_s[rows].astype(jnp.float32)))
            e = scale_exponent(amax, rounding)
            inv = _inverse_scale(e)

            @pl.loop(0, BLOCK)
            def _quantize_row(t):
                qc_s[rows + t] = _to_e4m3(x_s[rows + t].astype(jnp.float32) * inv)

            compat.gpu_store(sc_g.at[i], e.astype(jnp.uint8))

    def body(x_g, qr_g, sr_g, qc_g, sc_g):
        mi = lax.axis_index("m")

        def scope(qr_s, qc_s):
            def step(idx, x_s):
                j = idx[0]
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # previous tile's stores
                tile(
                    x_s, qr_s, sr_g.at[mi, pl.ds(j * g, g)], qc_s,
                    sc_g.at[pl.ds(mi * (bm // BLOCK), bm // BLOCK), pl.ds(j * g, g)],
                )
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(qr_s, qr_g.at[pl.ds(mi * bm, bm), pl.ds(j * g, g)])
                plgpu.copy_smem_to_gmem(qc_s, qc_g.at[pl.ds(mi * bm, bm), pl.ds(j * g, g)])

            plgpu.emit_pipeline(
                step,
                grid=(K // bk,),
                in_specs=[plgpu.BlockSpec((bm, g, BLOCK), lambda j: (mi, j, 0))],
                max_concurrent_steps=2,
            )(x_g)
            plgpu.wait_smem_to_gmem(0)

        pl.run_scoped(
            scope, plgpu.SMEM((bm, g, BLOCK), VALUE_DTYPE), plgpu.SMEM((bm, g, BLOCK), VALUE_DTYPE)
        )

    out_type = (
        jax.ShapeDtypeStruct((M, K // BLOCK, BLOCK), VALUE_DTYPE),
        jax.ShapeDtypeStruct((M // bm, K // BLOCK, bm), jnp.uint8),  # row scales, tile-major
        jax.ShapeDtypeStruct((M, K // BLOCK, BLOCK), VALUE_DTYPE),
        jax.ShapeDtypeStruct((M // BLOCK, K // BLOCK, BLOCK), jnp.uint8),
    )
    q_row, s_row, q_col, s_col = plgpu.kernel(
        body,
        out_type=out_type,
        grid=(M // bm,),
        grid_names=("m",),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane),
        interpret=platform.interpret_params(),
    )(x3)
    s_row = s_row.transpose(0, 2, 1).reshape(M, K // BLOCK)
    outs = (
        q_row.reshape(M, K),
        lax.bitcast_convert_type(s_row, SCALE_DTYPE),
        q_col.reshape(M, K),
        lax.bitcast_convert_type(s_col.reshape(M // BLOCK, K), SCALE_DTYPE),
    )
    return tuple(vma.like(o, x_MK) for o in outs)  # typed like x inside shard_map


@shapes.check(_ROWCOL)
def quantize_rowcol(x_MK, rounding: str = "rceil"):
    """Both quantized copies: the fused kernel on a GPU (Hopper and newer) when the shape
    fits, else the jnp reference (identical bits)."""
    cc = platform.gpu_capability()
    use_kernel = platform.interpret_params() is not None or (cc is not None and cc[0] >= 9)
    if use_kernel and rowcol_kernel_fits(x_MK.shape):
        return quantize_rowcol_pallas(x_MK, rounding)
    return quantize_rowcol_reference(x_MK, rounding)
