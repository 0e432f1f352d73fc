"""The routed SwiGLU over expert runs as an XLA FFI call on CPUs (`model.moe.gmm_impl=blas`,
auto's choice there for float32): one SGEMM per expert over its contiguous rows, through
the OpenBLAS that numpy ships, operands read in place. Forward and the custom VJP's
backward are each one call (cpu_gmm.cc); the SwiGLU's element-wise work runs between the
expert's GEMMs. Reference: model/moe/tiled.py's XLA loop and the naive loop in the tests.

The C++ is built on first use with the other CPU kernels (olmo_jax/kernels/cpu_ffi.py);
`cpu_ffi.available()` says whether that works here (auto falls back to the tiled loop).

Layout: expert e's sizes_E[e] rows start at row starts_E[e], the runs ascending and
disjoint; rows outside them come out zero (and get zero gradient).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from olmo_jax.kernels import cpu_ffi
from olmo_jax.kernels.cpu_ffi import Unavailable  # noqa: F401  (raised by ffn_runs)
from olmo_jax.kernels.vma import cotangent_like

FWD, BWD = "olmo_cpu_swiglu_fwd", "olmo_cpu_swiglu_bwd"


def _fwd_call(x_RD, starts_E, sizes_E, wg_EDF, wu_EDF, wd_EFD):
    R, F = x_RD.shape[0], wg_EDF.shape[2]
    outs = (jax.ShapeDtypeStruct(x_RD.shape, x_RD.dtype),
            jax.ShapeDtypeStruct((R, 2 * F), x_RD.dtype))
    return cpu_ffi.call(FWD, outs, x_RD, starts_E, sizes_E, wg_EDF, wu_EDF, wd_EFD)


@jax.custom_vjp
def _swiglu(x_RD, starts_E, sizes_E, wg_EDF, wu_EDF, wd_EFD):
    return _fwd_call(x_RD, starts_E, sizes_E, wg_EDF, wu_EDF, wd_EFD)[0]


def _swiglu_fwd(x_RD, starts_E, sizes_E, wg_EDF, wu_EDF, wd_EFD):
    y_RD, gu_RJ = _fwd_call(x_RD, starts_E, sizes_E, wg_EDF, wu_EDF, wd_EFD)
    return y_RD, (x_RD, gu_RJ, starts_E, sizes_E, wg_EDF, wu_EDF, wd_EFD)


def _swiglu_bwd(res, dy_RD):
    x_RD, gu_RJ, starts_E, sizes_E, wg_EDF, wu_EDF, wd_EFD = res
    outs = tuple(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in (x_RD, wg_EDF, wu_EDF, wd_EFD))
    dx_RD, dwg_EDF, dwu_EDF, dwd_EFD = cpu_ffi.call(
        BWD, outs, x_RD, gu_RJ, dy_RD.astype(x_RD.dtype), starts_E, sizes_E, wg_EDF, wu_EDF,
        wd_EFD)
    return (cotangent_like(dx_RD, x_RD), None, None, cotangent_like(dwg_EDF, wg_EDF),
            cotangent_like(dwu_EDF, wu_EDF), cotangent_like(dwd_EFD, wd_EFD))


_swiglu.defvjp(_swiglu_fwd, _swiglu_bwd)


def ffn_runs(x_RD, starts_E, sizes_E, w_gate_EDF, w_up_EDF, w_down_EFD):
    """y_RD = SwiGLU of each expert's run of rows (float32 only); differentiable in x and
    the weights. Raises Unavailable (with the reason) where the kernel cannot be built."""
    arrays = (x_RD, w_gate_EDF, w_up_EDF, w_down_EFD)
    if any(jnp.dtype(a.dtype) != jnp.float32 for a in arrays):
        raise ValueError(
            f"model.moe.gmm_impl=blas runs float32 GEMMs, got {[a.dtype.name for a in arrays]}: "
            "set model.dtype=float32 or model.moe.gmm_impl=auto (tiled for other dtypes)")
    cpu_ffi.require("model.moe.gmm_impl=tiled")
    return _swiglu(x_RD, starts_E.astype(jnp.int32), sizes_E.astype(jnp.int32),
                   w_gate_EDF, w_up_EDF, w_down_EFD)
