"""GPU kernels (Pallas Mosaic GPU), each file with its pure-jnp reference beside it, and
the choice of grouped-matmul implementation by platform and config.

    grouped_matmul.py  expert-grouped matmul (Hopper wgmma): forward, input gradient,
                       weight gradient, one custom VJP; reference: masked loop / ragged_dot
    mxfp8_quant.py     MXFP8 quantize / dequantize / packed payload; fused row+column
                       quantize kernel; reference: the jnp functions
    platform.py        device capability, interpret mode (running the kernels on a CPU)
    cpu_ffi.py         the CPU FFI kernels' one library (C++ built on first use, numpy's
                       OpenBLAS handed in; cpu_blas.h/.cc: the SGEMM and the thread pool)
    cpu_gmm.py/.cc     the routed SwiGLU over expert runs as an XLA FFI call into numpy's
                       OpenBLAS (CPU, float32); reference: tiled.py
    cpu_attention.py/.cc  the causal attention core and its QK-norm / clipping / RoPE as
                       XLA FFI calls (CPU, float32); reference: model/attention.py's xla

Importing this package is cheap: the Pallas modules load when a kernel is first used.
"""

from __future__ import annotations

import jax.numpy as jnp

from olmo_jax.kernels import platform

GMM_IMPLS = ("auto", "blas", "tiled", "pallas", "ragged_dot", "einsum")
# The Pallas grouped matmul tiles d_model and the expert hidden size in blocks of 64 (the
# weight-gradient kernel's wgmma M is one of them).
PALLAS_GMM_DIM_MULTIPLE = 64


def _is_16bit(dtype) -> bool:
    return dtype is None or jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def _cpu_blas_available() -> bool:
    from olmo_jax.kernels import cpu_ffi  # builds the FFI library on first use

    return cpu_ffi.available() is None


def _check_blas(dtype) -> None:
    target = platform.current_target()
    if target.platform != "cpu":
        raise ValueError(f"model.moe.gmm_impl=blas runs on a CPU; the target is "
                         f"{target.describe()}. Use model.moe.gmm_impl=auto")
    if dtype is not None and jnp.dtype(dtype) != jnp.float32:
        raise ValueError(f"model.moe.gmm_impl=blas runs float32 GEMMs but model.dtype is "
                         f"{jnp.dtype(dtype).name}; set model.dtype=float32 or gmm_impl=auto")
    from olmo_jax.kernels import cpu_ffi

    why = cpu_ffi.available()
    if why is not None:
        raise ValueError(f"model.moe.gmm_impl=blas cannot run here: {why}")


def pallas_gmm_fits(dims) -> bool:
    """The Pallas kernel tiles these expert GEMM dims (d_model, expert hidden)."""
    return all(d % PALLAS_GMM_DIM_MULTIPLE == 0 for d in dims)


def resolve_gmm_impl(gmm_impl: str, dtype=None, precision: str = "bf16", dims=None) -> str:
    """The grouped-matmul implementation for `model.moe.gmm_impl` on the target platform
    (`platform.current_target()`: the mesh's devices while a step is traced).

    auto: on CPU with float32 the FFI call into numpy's OpenBLAS (kernels/cpu_gmm.py: one
    SGEMM per expert over its own rows; measured 1.3-1.6x the tiled loop) where it
    builds here, else (other dtypes, no compiler) the tiled per-expert GEMM loop
    (olmo_jax/model/moe/tiled.py: dense XLA GEMMs over each expert's own rows; ragged_dot
    there expands to a dense masked product, E times the FLOPs), or with MXFP8 experts on
    CPU the blocked einsum (neither has an MXFP8 version); with MXFP8 experts on a GPU with
    block-scaled MMA (Blackwell) the blocked einsum layout too, whose GEMMs are
    `jax.nn.scaled_matmul` (cuDNN block-scaled MMA; no grouped block-scaled GEMM exists
    for the sorted layout); on a Hopper GPU with a 16-bit compute dtype the Pallas
    kernel when `dims` (d_model, expert hidden) fit its tiles; elsewhere (other GPUs,
    TPU, float32, other dims) jax.lax.ragged_dot.
    tiled, blas: bf16/float precision only (refused with MXFP8 experts, naming the fix);
    blas runs float32 on a CPU only, and must build here (g++, numpy's OpenBLAS).
    pallas: checked here, so a wrong choice fails before tracing with the fix named.
    `dtype` is the compute dtype (None: not checked); `dims` None: not checked."""
    if gmm_impl == "auto":
        if platform.current_target().platform == "cpu":
            if precision == "mxfp8":
                return "einsum"
            f32 = dtype is not None and jnp.dtype(dtype) == jnp.float32
            return "blas" if f32 and _cpu_blas_available() else "tiled"
        if precision == "mxfp8" and platform.block_scaled_mma_supported():
            return "einsum"
        fits = dims is None or pallas_gmm_fits(dims)
        if platform.pallas_gmm_supported() and _is_16bit(dtype) and fits:
            return "pallas"
        return "ragged_dot"
    if gmm_impl in ("tiled", "blas") and precision == "mxfp8":
        raise ValueError(
            f"model.moe.gmm_impl={gmm_impl} has no MXFP8 version (model.moe.precision=mxfp8): "
            "use model.moe.gmm_impl=auto (the blocked einsum on CPU) or einsum"
        )
    if gmm_impl == "blas":
        _check_blas(dtype)
    if gmm_impl == "pallas":
        if not platform.pallas_gmm_supported() and platform.interpret_params() is None:
            raise ValueError(
                "model.moe.gmm_impl=pallas needs an NVIDIA Hopper GPU (sm_90, wgmma); the target "
                f"is {platform.current_target().describe()}. Use model.moe.gmm_impl=auto (on a "
                "CPU the kernel runs only inside olmo_jax.kernels.platform.interpret(), for tests)"
            )
        if not _is_16bit(dtype) and platform.interpret_params() is None:
            raise ValueError(
                f"model.moe.gmm_impl=pallas runs bfloat16/float16 GEMMs but model.dtype is "
                f"{jnp.dtype(dtype).name}; set model.dtype=bfloat16 or gmm_impl=auto"
            )
        if dims is not None and not pallas_gmm_fits(dims):
            raise ValueError(
                f"model.moe.gmm_impl=pallas tiles model.d_model={dims[0]} and "
                f"model.moe.expert_hidden={dims[1]} in blocks of {PALLAS_GMM_DIM_MULTIPLE}: "
                f"make both multiples of {PALLAS_GMM_DIM_MULTIPLE}, or set gmm_impl=auto"
            )
    return gmm_impl
