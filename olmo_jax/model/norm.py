"""RMSNorm, computed in float32 and cast back (the Hugging Face OLMoE definition).

`impl` is `model.norm_impl` (which runs where: the table of olmo_jax/kernels/select.py; a
model built from a parallel plan holds the name resolved for its mesh, one used without a
plan resolves "auto" for its default device). With blas, a norm whose input and [D] weight
are float32 and its backward are one FFI call each (kernels/cpu_norm.cc, the same math):
XLA:CPU otherwise materializes the weight's broadcast and runs the reductions and
element-wise work as separate passes. Otherwise (xla, other dtypes, QK-norm's [N, H]
weights) the jnp functions below, the reference.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from olmo_jax.kernels import cpu_ffi, select
from olmo_jax.kernels.vma import cotangent_like
from olmo_jax.model.params import ones_param


def norm_impl(impl: str) -> str:
    """The norm the model runs: `impl`, or for "auto" (no plan resolved it) the table's
    choice for the default device (module docstring)."""
    if impl != "auto":
        return impl
    return select.resolve_norm_impl("auto", select.local_target())


def rms_norm(x: jax.Array, weight: jax.Array, eps: float, impl: str = "auto") -> jax.Array:
    """x * rsqrt(mean(x^2) + eps) over all trailing axes that `weight` spans, times weight;
    `impl`: model.norm_impl (module docstring)."""
    if _cpu_kernel(x, weight, impl):
        return _rms_norm_cpu(x, weight, eps)
    return _rms_norm(x, weight, eps)


def _cpu_kernel(x, weight, impl: str) -> bool:
    f32 = jnp.dtype(jnp.float32)
    return (weight.ndim == 1 and jnp.dtype(x.dtype) == f32 and jnp.dtype(weight.dtype) == f32
            and norm_impl(impl) == "blas")


@partial(jax.custom_vjp, nondiff_argnums=(2,))
def _rms_norm_cpu(x, weight, eps):
    return cpu_ffi.call("olmo_cpu_rms_norm_fwd", (jax.ShapeDtypeStruct(x.shape, x.dtype),), x,
                        weight, eps=np.float32(eps))[0]


def _rms_norm_cpu_fwd(x, weight, eps):
    return _rms_norm_cpu(x, weight, eps), (x, weight)


def _rms_norm_cpu_bwd(eps, res, dy):
    x, weight = res
    outs = (jax.ShapeDtypeStruct(x.shape, x.dtype), jax.ShapeDtypeStruct(weight.shape, weight.dtype))
    dx, dweight = cpu_ffi.call("olmo_cpu_rms_norm_bwd", outs, x, weight, dy.astype(x.dtype),
                               eps=np.float32(eps))
    return cotangent_like(dx, x), cotangent_like(dweight, weight)


_rms_norm_cpu.defvjp(_rms_norm_cpu_fwd, _rms_norm_cpu_bwd)


def _norm_axes(x, weight):
    return tuple(range(x.ndim - weight.ndim, x.ndim))


def _rms_norm_fwd(x, weight, eps):
    axes = _norm_axes(x, weight)
    x32 = x.astype(jnp.float32)
    rstd = jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=axes, keepdims=True) + eps)
    y = weight.astype(x.dtype) * (x32 * rstd).astype(x.dtype)
    return y, (x, weight, rstd)


def _rms_norm_bwd(eps, res, dy):
    # Written by hand so the backward pass keeps only x and 1/rms, and the weight is not
    # materialized at the activations' shape to be shared between the two passes.
    x, weight, rstd = res
    axes = _norm_axes(x, weight)
    batch_axes = tuple(range(x.ndim - weight.ndim))
    x32, dy32 = x.astype(jnp.float32), dy.astype(jnp.float32)
    xhat = x32 * rstd
    dweight = jnp.sum(dy32 * xhat, axis=batch_axes).astype(weight.dtype)
    g = dy32 * weight.astype(jnp.float32)
    dx = rstd * (g - xhat * jnp.mean(g * xhat, axis=axes, keepdims=True))
    return cotangent_like(dx.astype(x.dtype), x), cotangent_like(dweight, weight)


@partial(jax.custom_vjp, nondiff_argnums=(2,))
def _rms_norm(x, weight, eps):
    return _rms_norm_fwd(x, weight, eps)[0]


_rms_norm.defvjp(_rms_norm_fwd, _rms_norm_bwd)


class RMSNorm(nnx.Module):
    """Normalizes over trailing axes of shape `shape` (one axis for the residual stream,
    (heads, head_dim) for QK-norm, which Hugging Face OLMoE applies across all heads);
    `impl`: model.norm_impl (module docstring)."""

    def __init__(self, shape: tuple[int, ...], axes: tuple[str | None, ...], eps: float,
                 impl: str = "auto"):
        self.weight = ones_param(shape, axes)
        self.eps = eps
        self.impl = impl

    def __call__(self, x: jax.Array) -> jax.Array:
        return rms_norm(x, self.weight[...], self.eps, self.impl)
