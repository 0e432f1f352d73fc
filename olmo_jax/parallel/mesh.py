"""The device mesh: axes (`pipe`, `data`, `expert`), sized from `parallel.*` in the config.

One of the three sizes may be -1 (fill the devices). Tokens are sharded over
data x expert; expert weights over `expert`; the `pipe` axis holds pipeline stages.
"""

from __future__ import annotations

import math

import jax
import numpy as np
from jax.sharding import Mesh

from olmo_jax.errors import ConfigError

AXES = ("pipe", "data", "expert")
BATCH_AXES = ("data", "expert")  # the axes a global batch's rows are split over


def mesh_shape(pipe: int, data: int, expert: int, n_devices: int) -> tuple[int, int, int]:
    sizes = {"pipe": pipe, "data": data, "expert": expert}
    fill = [k for k, v in sizes.items() if v == -1]
    for k, v in sizes.items():
        if v == 0 or v < -1:
            raise ConfigError(f"parallel.{k}={v} must be a positive size or -1 (fill the devices)")
    if len(fill) > 1:
        raise ConfigError(
            f"only one of parallel.pipe/data/expert may be -1, got -1 for {', '.join(fill)}"
        )
    known = math.prod(v for v in sizes.values() if v != -1)
    if fill:
        if n_devices % known:
            raise ConfigError(
                f"parallel.{fill[0]}=-1 cannot fill {n_devices} devices: the other axes "
                f"multiply to {known}, which does not divide {n_devices}"
            )
        sizes[fill[0]] = n_devices // known
    product = math.prod(sizes.values())
    if product != n_devices:
        raise ConfigError(
            f"mesh parallel.pipe x data x expert = {sizes['pipe']} x {sizes['data']} x "
            f"{sizes['expert']} = {product} does not match the {n_devices} available devices; "
            f"set one of them to -1 to fill, or change the sizes"
        )
    return sizes["pipe"], sizes["data"], sizes["expert"]


def make_mesh(parallel_cfg, devices=None) -> Mesh:
    devices = list(devices if devices is not None else jax.devices())
    shape = mesh_shape(parallel_cfg.pipe, parallel_cfg.data, parallel_cfg.expert, len(devices))
    return Mesh(np.asarray(devices).reshape(shape), AXES)


def batch_shards(mesh: Mesh) -> int:
    return math.prod(mesh.shape[a] for a in BATCH_AXES)
