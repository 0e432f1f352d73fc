"""The device mesh: axes (`pipe`, `data`, `context`, `expert`), sized from `parallel.*` in
the config.

One of pipe / data / expert may be -1 (fill the devices); `context` is given (default 1).
A batch's rows are sharded over data x expert; each row's tokens over `context` (the
zig-zag layout, olmo_jax/kernels/ring_attention.py); expert weights over `expert`; the
`pipe` axis holds pipeline stages.
"""

from __future__ import annotations

import math

import jax
import numpy as np
from jax.sharding import Mesh

from olmo_jax.errors import ConfigError
from olmo_jax.kernels.ring_attention import CONTEXT_AXIS

AXES = ("pipe", "data", CONTEXT_AXIS, "expert")
BATCH_AXES = ("data", "expert")  # the axes a global batch's rows are split over
# The axes whose devices hold different tokens (rows over data x expert, each row's
# tokens over context): loss sums, router counts and data-parallel gradients span them.
TOKEN_AXES = ("data", CONTEXT_AXIS, "expert")


def mesh_shape(pipe: int, data: int, expert: int, n_devices: int,
               context: int = 1) -> tuple[int, int, int, int]:
    """(pipe, data, context, expert) sizes for `n_devices`."""
    if not isinstance(context, int) or context < 1:
        raise ConfigError(f"parallel.context={context} must be a positive size (1 = off)")
    sizes = {"pipe": pipe, "data": data, "expert": expert}
    fill = [k for k, v in sizes.items() if v == -1]
    for k, v in sizes.items():
        if v == 0 or v < -1:
            raise ConfigError(f"parallel.{k}={v} must be a positive size or -1 (fill the devices)")
    if len(fill) > 1:
        raise ConfigError(
            f"only one of parallel.pipe/data/expert may be -1, got -1 for {', '.join(fill)}"
        )
    known = context * math.prod(v for v in sizes.values() if v != -1)
    if fill:
        if n_devices % known:
            raise ConfigError(
                f"parallel.{fill[0]}=-1 cannot fill {n_devices} devices: the other axes "
                f"multiply to {known}, which does not divide {n_devices}"
            )
        sizes[fill[0]] = n_devices // known
    product = context * math.prod(sizes.values())
    if product != n_devices:
        raise ConfigError(
            f"mesh parallel.pipe x data x context x expert = {sizes['pipe']} x {sizes['data']} x "
            f"{context} x {sizes['expert']} = {product} does not match the {n_devices} available "
            f"devices; set one of pipe / data / expert to -1 to fill, or change the sizes"
        )
    return sizes["pipe"], sizes["data"], context, sizes["expert"]


def make_mesh(parallel_cfg, devices=None) -> Mesh:
    devices = list(devices if devices is not None else jax.devices())
    shape = mesh_shape(parallel_cfg.pipe, parallel_cfg.data, parallel_cfg.expert, len(devices),
                       parallel_cfg.context)
    return Mesh(np.asarray(devices).reshape(shape), AXES)


def batch_shards(mesh: Mesh) -> int:
    return math.prod(mesh.shape[a] for a in BATCH_AXES)


def token_shards(mesh: Mesh) -> int:
    """Devices holding different tokens of a batch (data x context x expert)."""
    return math.prod(mesh.shape[a] for a in TOKEN_AXES)
