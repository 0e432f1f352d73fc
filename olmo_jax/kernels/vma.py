"""Varying manual axes (vma) inside `shard_map`: every value is typed with the mesh axes
over which it may differ between devices. Two rules keep gradients right:

- A custom op (a Pallas kernel, a collective's output buffer, a hand-written VJP) must
  type its outputs with its inputs' axes (`like`). An output typed device-invariant that
  holds per-device data makes JAX insert a `pvary` where it meets varying values, and the
  transpose of that `pvary` is a `psum`: cotangents of different tokens on different
  devices get summed.
- A hand-written VJP's cotangent must vary over the same axes as its primal
  (`cotangent_like`): where a primal was implicitly broadcast to more axes (a weight
  replicated over an axis the activations vary over), the cotangent is summed over those
  axes, the transpose of that broadcast.
Outside shard_map every value has no varying axes and these are the identity.
"""

from __future__ import annotations

import jax


def varying_axes(x) -> frozenset:
    mat = getattr(jax.typeof(x), "manual_axis_type", None)
    return mat.varying if mat is not None else frozenset()


def like(y, *inputs):
    """`y` typed varying over every axis any of `inputs` varies over (it keeps its own)."""
    want = frozenset().union(*(varying_axes(x) for x in inputs))
    missing = tuple(sorted(want - varying_axes(y)))
    return jax.lax.pcast(y, missing, to="varying") if missing else y


def cotangent_like(ct, primal):
    """`ct` summed over the mesh axes it varies over and `primal` does not."""
    if ct is None:
        return None
    extra = varying_axes(ct) - varying_axes(primal)
    return jax.lax.psum(ct, tuple(sorted(extra))) if extra else ct
