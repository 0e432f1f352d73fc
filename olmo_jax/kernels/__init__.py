"""GPU kernels (Pallas Mosaic GPU), each file with its pure-jnp reference beside it, and
the choice of grouped-matmul implementation by platform and config.

    grouped_matmul.py  expert-grouped matmul (Hopper wgmma): forward, input gradient,
                       weight gradient, one custom VJP; reference: masked loop / ragged_dot
    mxfp8.py           MXFP8 quantize / dequantize / packed payload; fused row+column
                       quantize kernel; reference: the jnp functions
    platform.py        device capability, interpret mode (running the kernels on a CPU)

Importing this package is cheap: the Pallas modules load when a kernel is first used.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from olmo_jax.kernels import platform

GMM_IMPLS = ("auto", "pallas", "ragged_dot", "einsum")


def _is_16bit(dtype) -> bool:
    return dtype is None or jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def resolve_gmm_impl(gmm_impl: str, dtype=None) -> str:
    """The grouped-matmul implementation for `model.moe.gmm_impl` on this platform.

    auto: on CPU the padded batched einsum (measured fastest there: ragged_dot expands
    to a dense masked product, E times the FLOPs); on a Hopper GPU with a 16-bit compute
    dtype the Pallas kernel; elsewhere (other GPUs, TPU, float32) jax.lax.ragged_dot.
    pallas: checked here, so a wrong choice fails before tracing with the fix named.
    `dtype` is the compute dtype (None: not checked)."""
    if gmm_impl == "auto":
        if jax.default_backend() == "cpu":
            return "einsum"
        if platform.pallas_gmm_supported() and _is_16bit(dtype):
            return "pallas"
        return "ragged_dot"
    if gmm_impl == "pallas":
        if not platform.pallas_gmm_supported() and platform.interpret_params() is None:
            cc = platform.gpu_capability()
            found = f"a GPU of compute capability {cc}" if cc else jax.devices()[0].platform
            raise ValueError(
                "model.moe.gmm_impl=pallas needs an NVIDIA Hopper GPU (sm_90, wgmma); found "
                f"{found}. Use model.moe.gmm_impl=auto (on a CPU the kernel runs only inside "
                "olmo_jax.kernels.platform.interpret(), for tests)"
            )
        if not _is_16bit(dtype):
            raise ValueError(
                f"model.moe.gmm_impl=pallas runs bfloat16/float16 GEMMs but model.dtype is "
                f"{jnp.dtype(dtype).name}; set model.dtype=bfloat16 or gmm_impl=auto"
            )
    return gmm_impl
