"""Cotangents of hand-written VJPs under `shard_map`: a cotangent must vary over the same
mesh axes as its primal. Where a primal was implicitly broadcast to more axes (a weight
replicated over an axis the activations vary over), the cotangent is summed over those
axes: the transpose of that broadcast. Outside shard_map this is the identity.
"""

from __future__ import annotations

import jax


def varying_axes(x) -> frozenset:
    mat = getattr(jax.typeof(x), "manual_axis_type", None)
    return mat.varying if mat is not None else frozenset()


def cotangent_like(ct, primal):
    """`ct` summed over the mesh axes it varies over and `primal` does not."""
    if ct is None:
        return None
    extra = varying_axes(ct) - varying_axes(primal)
    return jax.lax.psum(ct, tuple(sorted(extra))) if extra else ct
