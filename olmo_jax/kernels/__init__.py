"""GPU kernels (Pallas Mosaic GPU), each file with its pure-jnp reference beside it, and
the choice of kernels by target and config.

    grouped_matmul.py  expert-grouped matmul (Hopper wgmma): forward, input gradient,
                       weight gradient, one custom VJP; reference: masked loop / ragged_dot
    mxfp8_quant.py     MXFP8 quantize / dequantize / packed payload; fused row+column
                       quantize kernel; reference: the jnp functions
    platform.py        device capability, interpret mode (running the kernels on a CPU)
    select.py          the kernel choice: model.moe.gmm_impl, model.attention_impl,
                       model.norm_impl and model.mxfp8_gemm_impl resolved for a target
                       (`resolve_kernels`), its one table
    cpu_ffi.py         the CPU FFI kernels' one library (C++ built on first use, numpy's
                       OpenBLAS handed in; cpu_blas.h/.cc: the SGEMM and the thread pool)
    cpu_gmm.py/.cc     the routed SwiGLU over expert runs as an XLA FFI call into numpy's
                       OpenBLAS (CPU, float32); reference: tiled.py
    cpu_attention.py/.cc  the causal attention core and its QK-norm / clipping / RoPE as
                       XLA FFI calls (CPU, float32); reference: model/attention.py's xla
    ring_attention.py  context parallelism: zig-zag shards, ring and all-gather attention
    ring_blocks.py     the ring's [L, L] block kernels: cuDNN's fused attention, forward
                       and backward from the global statistics; reference: XLA einsums

Importing this package is cheap: the Pallas modules load when a kernel is first used.
"""

from __future__ import annotations

from olmo_jax.kernels.select import (
    ATTENTION_IMPLS,
    GMM_IMPLS,
    PALLAS_GMM_DIM_MULTIPLE,
    KernelChoice,
    pallas_gmm_fits,
    resolve_attention_impl,
    resolve_gmm_impl,
    resolve_kernels,
)

__all__ = [
    "ATTENTION_IMPLS", "GMM_IMPLS", "PALLAS_GMM_DIM_MULTIPLE", "KernelChoice", "pallas_gmm_fits",
    "resolve_attention_impl", "resolve_gmm_impl", "resolve_kernels",
]
