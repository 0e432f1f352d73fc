"""MXFP8 quantization: the jnp reference against the format's definition (numpy), the
packed payload, and the fused Pallas row+column kernel bit for bit against the
reference in GPU interpret mode (plus its lowering for CUDA)."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from olmo_jax.kernels import mxfp8_quant as mx
from olmo_jax.kernels import platform

quantize = jax.jit(mx.quantize, static_argnums=(1, 2))
dequantize = jax.jit(mx.dequantize, static_argnums=(2, 3))


def _wide_range(key, shape, dtype=jnp.bfloat16):
    """Normal values times exp(3 * normal): blocks span many binades, some values tiny."""
    k1, k2 = jax.random.split(key)
    x = jax.random.normal(k1, shape) * jnp.exp(3.0 * jax.random.normal(k2, shape))
    return x.astype(dtype)


def _bits(a):
    return np.asarray(jax.lax.bitcast_convert_type(a, jnp.uint8))


def _numpy_mx(x, rounding):
    """The definition, in float64 numpy: scale 2^s with s = ceil(log2(amax / 448)) for
    rceil, floor(log2(amax)) - 8 for floor; values x / 2^s saturated to +-448, rounded
    to nearest-even e4m3 (ml_dtypes)."""
    xb = np.asarray(x, np.float64).reshape(*x.shape[:-1], -1, 32)
    amax = np.abs(xb).max(-1)
    with np.errstate(divide="ignore"):
        if rounding == "rceil":
            s = np.ceil(np.log2(amax / 448.0))
        else:
            s = np.floor(np.log2(amax)) - 8
    s = np.clip(np.where(amax > 0, s, -127), -127, 127)
    v = np.clip(xb / 2.0 ** s[..., None], -448, 448).astype(ml_dtypes.float8_e4m3fn)
    return v.reshape(x.shape), (s + 127).astype(np.uint8)


@pytest.mark.parametrize("rounding", ["rceil", "floor"])
def test_quantize_matches_the_definition(rounding):
    x = _wide_range(jax.random.key(0), (64, 256), jnp.float32)
    x = x.at[3, :32].set(0.0)  # an all-zero block
    q, s = quantize(x, -1, rounding)
    v_ref, e_ref = _numpy_mx(np.asarray(x), rounding)
    np.testing.assert_array_equal(_bits(s), e_ref)
    np.testing.assert_array_equal(_bits(q), v_ref.view(np.uint8))
    # rceil never saturates: the block maximum lands in (224, 448] (224 after rounding).
    if rounding == "rceil":
        top = np.abs(np.asarray(q, np.float32)).reshape(64, 8, 32).max(-1)
        live = np.asarray(s.astype(jnp.float32)).reshape(64, 8) > 2.0**-127
        assert (top[live] >= 224).all() and (top <= 448).all()


def test_dequantize_error_and_non_finite_blocks():
    x = _wide_range(jax.random.key(1), (32, 128), jnp.float32)
    q, s = quantize(x, -1, "rceil")
    d = np.asarray(dequantize(q, s, -1, jnp.float32)).reshape(32, 4, 32)
    xb = np.asarray(x).reshape(32, 4, 32)
    scale = np.asarray(s.astype(jnp.float32)).reshape(32, 4, 1)
    # Half an e4m3 ulp: 2^-4 relative for normal values, 2^-10 of the block's scale
    # (half the subnormal step 2^-9) below; values are exact in float32 after dequant.
    bound = np.maximum(2.0**-4 * np.abs(xb), 2.0**-10 * scale)
    assert (np.abs(d - xb) <= bound).all()
    bad = x.at[0, 5].set(jnp.inf).at[1, 40].set(jnp.nan)
    q, s = quantize(bad, -1, "rceil")
    assert _bits(s)[0, 0] == 255 and _bits(s)[1, 1] == 255  # e8m0 NaN
    out = np.asarray(dequantize(q, s, -1, jnp.float32))
    assert np.isnan(out[0, :32]).all() and np.isnan(out[1, 32:64]).all()
    assert np.isfinite(out[2:]).all()


def test_axis_and_shape_errors():
    x = _wide_range(jax.random.key(2), (4, 64, 96))
    q, s = quantize(x, 1, "rceil")
    assert q.shape == x.shape and s.shape == (4, 2, 96)
    np.testing.assert_array_equal(
        _bits(q), _bits(jnp.swapaxes(quantize(jnp.swapaxes(x, 1, 2), -1, "rceil")[0], 1, 2))
    )
    with pytest.raises(ValueError, match="multiple of 32"):
        mx.quantize(x[:, :, :40], -1)
    with pytest.raises(ValueError, match="rceil"):
        mx.quantize(x, -1, "nearest")


def test_payload_roundtrip_and_size():
    x = _wide_range(jax.random.key(3), (48, 256))
    packed = jax.jit(mx.pack_rows)(x)
    assert packed.dtype == jnp.uint8 and packed.shape == (48, 256 + 8)
    assert packed.nbytes / x.nbytes == pytest.approx(33 / 64)
    unpacked = jax.jit(mx.unpack_rows, static_argnums=1)(packed, jnp.float32)
    q, s = quantize(x, -1, "rceil")
    want = dequantize(q, s, -1, jnp.float32)
    np.testing.assert_array_equal(np.asarray(unpacked), np.asarray(want))
    with pytest.raises(ValueError, match="payload"):
        mx.unpack_rows(packed[:, :-1])


@pytest.mark.parametrize(
    "rounding,shape,block_k",
    [pytest.param("rceil", (128, 256), 128, marks=pytest.mark.jax011), ("floor", (64, 128), 0)]
)
def test_rowcol_kernel_is_bitwise_equal_to_reference(rounding, shape, block_k):
    """rceil: 2 programs x 2 pipelined K tiles; floor: one tile. Wide-range values, a
    block that is zero both ways, and NaN / inf entries (their blocks get scale NaN)."""
    x = _wide_range(jax.random.key(4), shape)
    x = x.at[:32, :32].set(0).at[40, 100].set(jnp.nan).at[63, 7].set(-jnp.inf)
    with platform.interpret():
        got = jax.jit(mx.quantize_rowcol_pallas, static_argnums=(1, 2, 3))(x, rounding, 64, block_k)
    want = jax.jit(mx.quantize_rowcol_reference, static_argnums=1)(x, rounding)
    for g, w, name in zip(got, want, ("q_row", "s_row", "q_col", "s_col"), strict=True):
        assert g.shape == w.shape and g.dtype == w.dtype, name
        np.testing.assert_array_equal(_bits(g), _bits(w), err_msg=name)


@pytest.mark.jax011
def test_rowcol_kernel_lowers_for_cuda():
    x = jax.ShapeDtypeStruct((256, 512), jnp.bfloat16)
    with platform.cross_lowering():
        lowered = jax.jit(mx.quantize_rowcol_pallas).trace(x).lower(lowering_platforms=("cuda",))
    text = lowered.as_text()
    assert "mosaic_gpu" in text
    with pytest.raises(ValueError, match="M % 64"):
        with platform.interpret():
            mx.quantize_rowcol_pallas(jnp.zeros((96, 128), jnp.bfloat16))
