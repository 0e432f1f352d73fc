"""The kernel choice: which expert grouped matmul (`model.moe.gmm_impl`), attention core
(`model.attention_impl`), RMSNorm (`model.norm_impl`) and MXFP8 GEMM
(`model.mxfp8_gemm_impl`) a model runs on a target, decided once, here.

`resolve_kernels(model_cfg, target)` is pure: the Target is passed in (the parallel plan
passes its mesh's, `parallel.strategy.build_plan`, which stores the result as
`plan.kernels` and builds the model from `plan.model_cfg`, whose four fields hold the
resolved names). Nothing here reads a context variable or `jax.default_backend()`.

The table (the only description of it; other docstrings point here):

model.moe.gmm_impl (GMM_IMPLS), for compute dtype `dtype`, expert precision `precision`
and expert GEMM dims (d_model, expert hidden):
  auto, CPU target:      mxfp8 experts -> einsum (neither the BLAS call nor the tiled loop
                         has an MXFP8 version); float32 -> blas where the CPU FFI library
                         builds here (kernels/cpu_gmm.py: one SGEMM per expert over its
                         own rows; measured 1.3-1.6x the tiled loop); else tiled (the
                         per-expert GEMM loop of model/moe/tiled.py; ragged_dot on XLA:CPU
                         expands to a dense masked product, E times the FLOPs).
  auto, GPU target:      mxfp8 experts on a GPU with block-scaled MMA (Blackwell, sm_100+)
                         -> einsum (the blocked layout, whose GEMMs are
                         `jax.nn.scaled_matmul`: no grouped block-scaled GEMM exists for
                         the sorted layout); with a 16-bit dtype and both dims multiples of
                         PALLAS_GMM_DIM_MULTIPLE, a Hopper GPU (sm_90) -> pallas (the wgmma
                         kernels of kernels/grouped_matmul.py) and a datacenter Blackwell
                         GPU (sm_100 B200, sm_103 B300) -> pallas_tcgen05 (the tcgen05/TMEM
                         kernels of kernels/grouped_matmul_tcgen05.py); else einsum
                         (batched GEMMs over rowwise's or capacity's equal groups, the
                         blocked layout for dropless runs). Never ragged_dot on a GPU: this
                         jaxlib's XLA:GPU lowers `jax.lax.ragged_dot` as a dense masked
                         product over the expert groups (every row times every expert's
                         weights, E times the FLOPs), on Blackwell, in float32 and at any
                         shape, and the planner marks a dense lowering an error
                         (planner/plan_build.py).
  auto, TPU target:      ragged_dot (XLA:TPU's grouped matmul).
  explicit choices are kept, and refused (ValueError naming the field and the fix) where
  they cannot run: tiled and blas have no MXFP8 version; blas runs float32 on a CPU
  target and must build here (g++, numpy's OpenBLAS); pallas needs a Hopper target,
  pallas_tcgen05 an sm_100/sm_103 Blackwell target, both a 16-bit dtype (target and dtype
  waived with `interpret`: Pallas' GPU interpret mode on a CPU, for tests) and dims that
  fit their tiles; pallas_tcgen05 has no MXFP8 version.

model.attention_impl (ATTENTION_IMPLS), for compute dtype `dtype`:
  auto:   cudnn on a GPU target in bfloat16/float16; blas on a CPU target in float32
          where the CPU FFI library builds (kernels/cpu_attention.py); xla elsewhere.
  cudnn (GPU, 16-bit) and blas (CPU, float32, builds) are refused elsewhere; xla runs
  everywhere.

model.norm_impl (NORM_IMPLS), the RMSNorm of model/norm.py:
  auto:   blas on a CPU target where the CPU FFI library builds (kernels/cpu_norm.cc: the
          norm and its backward one FFI call each; it runs the norms whose input and [D]
          weight are float32, the others, e.g. QK-norm's [N, H] weights or bfloat16
          activations, run the jnp reference); xla (the jnp reference) elsewhere.
  blas is refused on a non-CPU target or where the library does not build; xla runs
  everywhere.

model.mxfp8_gemm_impl (MXFP8_GEMM_IMPLS), the quantized GEMMs of model/mxfp8_gemm.py
(model.attention_precision=mxfp8, model.moe.precision=mxfp8):
  auto:   scaled_matmul on a GPU with block-scaled MMA (Blackwell, sm_100+: cuDNN's
          block-scaled GEMM, `jax.nn.scaled_matmul`, for the dense, batched and blocked
          layouts; the ragged layouts always dequantize); dequantize elsewhere (the
          operands dequantized, exact in float32, and the product run in the compute dtype).
  scaled_matmul is refused, where a GEMM runs in MXFP8, on a target without block-scaled
  MMA; dequantize runs everywhere.

The dropless expert buffer's row layout follows from the grouped matmul (`run_padding`,
KernelChoice.run_padding): each expert's run is padded to blocks of rows for the blocked
einsum ("blocks", model/moe/sizing.block_size), to the tiled loop's tile ("tiles",
sizing.TILE_MULTIPLE), or not at all for the grouped GEMMs ("none": ragged_dot, pallas,
pallas_tcgen05, blas). The expert-parallel backends size their buffers from this requirement, not from
the kernel's name.
"""

from __future__ import annotations

import dataclasses
from typing import Literal, get_args

import jax
import jax.numpy as jnp

from olmo_jax.kernels import platform

GmmImpl = Literal["auto", "blas", "tiled", "pallas", "pallas_tcgen05", "ragged_dot", "einsum"]  # model.moe.gmm_impl
GMM_IMPLS = get_args(GmmImpl)
AttentionImpl = Literal["auto", "cudnn", "blas", "xla"]  # model.attention_impl
ATTENTION_IMPLS = get_args(AttentionImpl)
NormImpl = Literal["auto", "blas", "xla"]  # model.norm_impl
NORM_IMPLS = get_args(NormImpl)
Mxfp8GemmImpl = Literal["auto", "scaled_matmul", "dequantize"]  # model.mxfp8_gemm_impl
MXFP8_GEMM_IMPLS = get_args(Mxfp8GemmImpl)
RUN_PADDINGS = ("blocks", "tiles", "none")
# The Pallas grouped matmuls tile d_model and the expert hidden size in blocks of 64 (the
# weight-gradient kernel's wgmma / tcgen05 M is one of them).
PALLAS_GMM_DIM_MULTIPLE = 64


@dataclasses.dataclass(frozen=True)
class KernelChoice:
    """The kernels a model runs on one target (module docstring: the table)."""

    gmm: str  # a concrete model.moe.gmm_impl: blas | tiled | pallas | pallas_tcgen05 |
    #           ragged_dot | einsum
    attention: str  # a concrete model.attention_impl: cudnn | blas | xla
    run_padding: str  # RUN_PADDINGS: how the dropless expert buffer pads each expert's run
    norm: str  # a concrete model.norm_impl: blas | xla
    mxfp8_gemm: str  # a concrete model.mxfp8_gemm_impl: scaled_matmul | dequantize

    def apply(self, model_cfg):
        """`model_cfg` (a TransformerConfig) with moe.gmm_impl, attention_impl, norm_impl and
        mxfp8_gemm_impl replaced by the resolved names."""
        return dataclasses.replace(
            model_cfg, attention_impl=self.attention, norm_impl=self.norm,
            mxfp8_gemm_impl=self.mxfp8_gemm,
            moe=dataclasses.replace(model_cfg.moe, gmm_impl=self.gmm))


def local_target() -> platform.Target:
    """The target of a model used without a parallel plan: its default device, where its
    arrays are placed (a plan passes its mesh's target instead)."""
    return platform.target_of(jax.devices()[:1])


def _is_16bit(dtype) -> bool:
    return dtype is None or jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def _cpu_ffi_missing() -> str | None:
    """Why the CPU FFI library cannot build here (None: it builds)."""
    from olmo_jax.kernels import cpu_ffi  # builds the FFI library on first use

    return cpu_ffi.available()


def pallas_gmm_fits(dims) -> bool:
    """The Pallas kernel tiles these expert GEMM dims (d_model, expert hidden)."""
    return all(d % PALLAS_GMM_DIM_MULTIPLE == 0 for d in dims)


def _hopper(target: platform.Target) -> bool:
    return target.capability is not None and target.capability[0] == 9


def _tcgen05(target: platform.Target) -> bool:
    """Datacenter Blackwell (sm_100 B200, sm_103 B300): tcgen05 MMA and tensor memory."""
    return target.capability is not None and target.capability[0] == 10


def _block_scaled_mma(target: platform.Target) -> bool:
    return target.capability is not None and target.capability[0] >= 10


def resolve_gmm_impl(gmm_impl: str, target: platform.Target, dtype=None, precision: str = "bf16",
                     dims=None, interpret: bool = False) -> str:
    """`model.moe.gmm_impl` on `target` (module docstring: the table). `dtype` is the compute
    dtype (None: not checked); `dims` (d_model, expert hidden), None: not checked;
    `interpret`: an explicit pallas runs in Pallas' GPU interpret mode (tests)."""
    if gmm_impl == "auto":
        if target.platform == "cpu":
            if precision == "mxfp8":
                return "einsum"
            f32 = dtype is not None and jnp.dtype(dtype) == jnp.float32
            return "blas" if f32 and _cpu_ffi_missing() is None else "tiled"
        if precision == "mxfp8" and _block_scaled_mma(target):
            return "einsum"
        fits = dims is None or pallas_gmm_fits(dims)
        if _hopper(target) and _is_16bit(dtype) and fits:
            return "pallas"
        if _tcgen05(target) and _is_16bit(dtype) and fits:
            return "pallas_tcgen05"
        return "einsum" if target.is_gpu else "ragged_dot"
    if gmm_impl in ("tiled", "blas") and precision == "mxfp8":
        raise ValueError(
            f"model.moe.gmm_impl={gmm_impl} has no MXFP8 version (model.moe.precision=mxfp8): "
            "use model.moe.gmm_impl=auto (the blocked einsum on CPU) or einsum"
        )
    if gmm_impl == "blas":
        if target.platform != "cpu":
            raise ValueError(f"model.moe.gmm_impl=blas runs on a CPU; the target is "
                             f"{target.describe()}. Use model.moe.gmm_impl=auto")
        if dtype is not None and jnp.dtype(dtype) != jnp.float32:
            raise ValueError(f"model.moe.gmm_impl=blas runs float32 GEMMs but model.dtype is "
                             f"{jnp.dtype(dtype).name}; set model.dtype=float32 or gmm_impl=auto")
        why = _cpu_ffi_missing()
        if why is not None:
            raise ValueError(f"model.moe.gmm_impl=blas cannot run here: {why}")
    if gmm_impl == "pallas_tcgen05" and precision == "mxfp8":
        raise ValueError(
            "model.moe.gmm_impl=pallas_tcgen05 has no MXFP8 version (model.moe.precision="
            "mxfp8): use model.moe.gmm_impl=auto (on Blackwell the blocked einsum on cuDNN's "
            "block-scaled GEMM) or einsum"
        )
    if gmm_impl in ("pallas", "pallas_tcgen05"):
        arch_ok, arch = ((_hopper(target), "an NVIDIA Hopper GPU (sm_90, wgmma)")
                         if gmm_impl == "pallas" else
                         (_tcgen05(target), "an NVIDIA B200/B300 GPU (sm_100/sm_103, tcgen05)"))
        if not arch_ok and not interpret:
            raise ValueError(
                f"model.moe.gmm_impl={gmm_impl} needs {arch}; the target "
                f"is {target.describe()}. Use model.moe.gmm_impl=auto (on a "
                "CPU the kernel runs only inside olmo_jax.kernels.platform.interpret(), for tests)"
            )
        if not _is_16bit(dtype) and not interpret:
            raise ValueError(
                f"model.moe.gmm_impl={gmm_impl} runs bfloat16/float16 GEMMs but model.dtype is "
                f"{jnp.dtype(dtype).name}; set model.dtype=bfloat16 or gmm_impl=auto"
            )
        if dims is not None and not pallas_gmm_fits(dims):
            raise ValueError(
                f"model.moe.gmm_impl={gmm_impl} tiles model.d_model={dims[0]} and "
                f"model.moe.expert_hidden={dims[1]} in blocks of {PALLAS_GMM_DIM_MULTIPLE}: "
                f"make both multiples of {PALLAS_GMM_DIM_MULTIPLE}, or set gmm_impl=auto"
            )
    return gmm_impl


def resolve_attention_impl(impl: str, target: platform.Target, dtype) -> str:
    """`model.attention_impl` on `target`: cudnn, blas or xla (module docstring: the table).
    An explicit cudnn or blas where it cannot run is refused naming the field."""
    dt = jnp.dtype(dtype)
    half = dt in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
    cpu_f32 = target.platform == "cpu" and dt == jnp.dtype(jnp.float32)
    if impl == "auto":
        if target.is_gpu and half:
            return "cudnn"
        return "blas" if cpu_f32 and _cpu_ffi_missing() is None else "xla"
    if impl == "cudnn" and not (target.is_gpu and half):
        why = f"the target is {target.describe()}" if not target.is_gpu else \
            f"model.dtype is {dt.name}"
        raise ValueError(
            f"model.attention_impl=cudnn runs cuDNN's fused attention on an NVIDIA GPU in "
            f"bfloat16/float16, but {why}; use model.attention_impl=auto or xla"
        )
    if impl == "blas":
        why = (f"the target is {target.describe()}" if target.platform != "cpu" else
               f"model.dtype is {dt.name}" if not cpu_f32 else _cpu_ffi_missing())
        if why:
            raise ValueError(f"model.attention_impl=blas runs a float32 CPU kernel, but {why}; "
                             f"use model.attention_impl=auto or xla")
    return impl


def resolve_norm_impl(impl: str, target: platform.Target) -> str:
    """`model.norm_impl` on `target`: blas or xla (module docstring: the table). An explicit
    blas where it cannot run is refused naming the field."""
    if impl == "auto":
        return "blas" if target.platform == "cpu" and _cpu_ffi_missing() is None else "xla"
    if impl == "blas":
        why = (f"the target is {target.describe()}" if target.platform != "cpu"
               else _cpu_ffi_missing())
        if why:
            raise ValueError(f"model.norm_impl=blas runs a CPU kernel, but {why}; "
                             f"use model.norm_impl=auto or xla")
    return impl


def resolve_mxfp8_gemm_impl(impl: str, target: platform.Target, used: bool = True) -> str:
    """`model.mxfp8_gemm_impl` on `target`: scaled_matmul or dequantize (module docstring:
    the table). `used`: some GEMM runs in MXFP8; an explicit scaled_matmul on a target
    without block-scaled MMA is refused (naming the field) only then."""
    if impl == "auto":
        return "scaled_matmul" if _block_scaled_mma(target) else "dequantize"
    if impl == "scaled_matmul" and used and not _block_scaled_mma(target):
        raise ValueError(
            f"model.mxfp8_gemm_impl=scaled_matmul runs cuDNN's block-scaled GEMM on an NVIDIA "
            f"GPU with block-scaled MMA (Blackwell, sm_100+); the target is "
            f"{target.describe()}. Use model.mxfp8_gemm_impl=auto or dequantize"
        )
    return impl


def run_padding(gmm: str) -> str:
    """How the dropless expert buffer pads each expert's run for the resolved grouped
    matmul `gmm` (RUN_PADDINGS; module docstring)."""
    if gmm == "einsum":
        return "blocks"
    if gmm == "tiled":
        return "tiles"
    if gmm in ("ragged_dot", "pallas", "pallas_tcgen05", "blas"):
        return "none"
    raise ValueError(f"run_padding needs a resolved model.moe.gmm_impl, got {gmm!r}")


def resolve_kernels(model_cfg, target: platform.Target, interpret: bool = False) -> KernelChoice:
    """The KernelChoice of `model_cfg` (a TransformerConfig) on `target`. Raises ValueError
    naming the field and the fix for an explicit choice that cannot run there. `interpret`:
    the Pallas GPU kernels run in interpret mode (tests on a CPU)."""
    m = model_cfg.moe
    dtype = model_cfg.compute_dtype
    attention = resolve_attention_impl(model_cfg.attention_impl, target, dtype)
    if model_cfg.n_moe_layers:
        gmm = resolve_gmm_impl(m.gmm_impl, target, dtype, m.precision,
                               (model_cfg.d_model, m.expert_hidden), interpret)
    else:  # no experts: nothing to refuse
        gmm = m.gmm_impl if m.gmm_impl != "auto" else resolve_gmm_impl(
            "auto", target, dtype, m.precision)
    norm = resolve_norm_impl(model_cfg.norm_impl, target)
    mxfp8 = "mxfp8" in (model_cfg.attention_precision, m.precision if model_cfg.n_moe_layers
                        else "bf16")
    mxfp8_gemm = resolve_mxfp8_gemm_impl(model_cfg.mxfp8_gemm_impl, target, mxfp8)
    return KernelChoice(gmm, attention, run_padding(gmm), norm, mxfp8_gemm)
