"""Where the GPU kernels can run: the device's CUDA capability, and Pallas' GPU interpret
mode for running them on a CPU.

- `gpu_capability()`: (major, minor) of the default device, or None when it is no CUDA GPU.
- `pallas_gmm_supported()`: the grouped-matmul kernel is written for Hopper's wgmma
  (sm_90); Blackwell (sm_100+) has no wgmma (tcgen05 instead), so it is Hopper only.
- `block_scaled_mma_supported()`: Blackwell and newer, where `jax.nn.scaled_matmul`
  runs a cuDNN MXFP8 block-scaled GEMM.
- `interpret()`: inside this context the Pallas GPU kernels run in GPU interpret mode
  (on the CPU); `interpret_params()` is what the kernels pass to `plgpu.kernel`.
- `cross_lowering()`: inside this context the kernels may be traced on a CPU host in
  order to lower them for CUDA (`.lower(lowering_platforms=("cuda",))`): the Pallas ->
  Mosaic GPU lowering runs (shapes, layouts, transforms, primitive support are checked)
  without a GPU; the result cannot be executed here.
"""

from __future__ import annotations

import contextlib
import contextvars

import jax

_CROSS_LOWERING: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "olmo_jax_cross_lowering", default=False
)
# The jax.experimental.pallas.mosaic_gpu.InterpretGPUParams in force (imported lazily:
# loading Pallas costs about a second).
_INTERPRET: contextvars.ContextVar[object | None] = contextvars.ContextVar(
    "olmo_jax_gpu_interpret", default=None
)


def gpu_capability() -> tuple[int, int] | None:
    d = jax.devices()[0]
    cc = getattr(d, "compute_capability", None)
    if d.platform != "gpu" or not cc:
        return None
    major, minor = str(cc).split(".")[:2]
    return int(major), int(minor)


def pallas_gmm_supported() -> bool:
    cc = gpu_capability()
    return cc is not None and cc[0] == 9


def block_scaled_mma_supported() -> bool:
    cc = gpu_capability()
    return cc is not None and cc[0] >= 10


def num_sms() -> int:
    """Streaming multiprocessors of the default GPU (a small number when interpreting,
    where every program is simulated)."""
    if _CROSS_LOWERING.get():
        return 132  # H100/H200 SXM
    d = jax.devices()[0]
    return int(getattr(d, "core_count", 0) or 4)


@contextlib.contextmanager
def interpret(params=None):
    """Run the Pallas GPU kernels traced inside this context in GPU interpret mode.

    Defaults: out-of-bounds reads raise and uninitialized memory reads NaN, so an index
    or masking error fails loudly instead of passing by accident."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    token = _INTERPRET.set(params or plgpu.InterpretGPUParams())
    try:
        yield
    finally:
        _INTERPRET.reset(token)


@contextlib.contextmanager
def cross_lowering():
    token = _CROSS_LOWERING.set(True)
    try:
        yield
    finally:
        _CROSS_LOWERING.reset(token)


def interpret_params():
    return _INTERPRET.get()


def require_kernel_platform(what: str) -> None:
    """Clear error when a Pallas GPU kernel is called where it cannot run."""
    if interpret_params() is None and gpu_capability() is None and not _CROSS_LOWERING.get():
        raise RuntimeError(
            f"{what} is a Pallas Mosaic GPU kernel: it needs an NVIDIA GPU (found "
            f"{jax.devices()[0].platform}); on a CPU run it inside "
            "olmo_jax.kernels.platform.interpret() (slow, for tests)"
        )
