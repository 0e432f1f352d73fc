"""Report section "mesh": the device mesh (pipe x data x expert) and which part of every
parameter and optimizer-state leaf each device stores.

Everything comes from the real parallel plan (`olmo_jax.parallel.strategy.build_plan`):
the TrainState's shardings (`ParallelPlan.state_shardings`) give, through
`NamedSharding.devices_indices_map`, the exact slice of each leaf on each device; the
parameter layouts give the placement the model computes with (after ZeRO-1 / FSDP
gathers). Leaves are described without allocating (abstract TrainState).
"""

from __future__ import annotations

import math

import jax
import numpy as np
from jax.sharding import NamedSharding

from olmo_jax.model.params import path_name
from olmo_jax.optim import build_optimizer
from olmo_jax.parallel import zero
from olmo_jax.parallel.mesh import AXES
from olmo_jax.trainer.state import abstract_train_state

MOMENTS = ("mu", "nu")  # optax AdamW state names in the optimizer-state paths


def _category(part: str, path: str) -> tuple[str, str]:
    """(category, parameter name) of a leaf: param | mu | nu | opt (counters etc.)."""
    if part == "params":
        return "param", path
    parts = path.split("/")
    for moment in MOMENTS:
        if moment in parts:
            return moment, "/".join(parts[parts.index(moment) + 1:])
    return "opt", path


def _spec_str(spec) -> str:
    return str(tuple(spec))


def _slices(index: tuple, shape: tuple[int, ...]) -> list[list[int]]:
    """[[start, stop] per dim] of a devices_indices_map entry (slices of step 1)."""
    return [list(s.indices(n)[:2]) for s, n in zip(index, shape, strict=True)]


def leaf_placement(x, sharding: NamedSharding, flat_devices: list) -> dict:
    """The distinct shards of one leaf and which device holds which: {"shards": [[[start,
    stop] per dim], ...], "device_shard": [shard index per device, in mesh order],
    "shard_bytes": bytes of one shard}."""
    index_map = sharding.devices_indices_map(x.shape)
    shards: list[list[list[int]]] = []
    keys: dict[tuple, int] = {}
    device_shard = []
    for d in flat_devices:
        sl = _slices(index_map[d], x.shape)
        key = tuple(map(tuple, sl))
        if key not in keys:
            keys[key] = len(shards)
            shards.append(sl)
        device_shard.append(keys[key])
    shard_shape = sharding.shard_shape(x.shape)
    return {"shards": shards, "device_shard": device_shard,
            "shard_bytes": math.prod(shard_shape) * np.dtype(x.dtype).itemsize}


def mesh_section(cfg, model_cfg, plan) -> dict:
    """The "mesh" section's data for a config and its ParallelPlan."""
    tx, _ = build_optimizer(cfg.optim, cfg.trainer.total_steps,
                            tokens_per_step=cfg.trainer.tokens_per_step)
    _, state = abstract_train_state(model_cfg, tx, dispatcher=plan.dispatcher)
    shardings = plan.state_shardings(state, tx)
    mesh = plan.mesh
    flat = list(mesh.devices.flat)
    compute = {path_name(p): _spec_str(lay.compute) for p, lay in
               jax.tree_util.tree_leaves_with_path(
                   plan.layouts, is_leaf=lambda x: isinstance(x, zero.ParamLayout))}
    leaves = []
    for part in ("params", "opt_state"):
        shs = jax.tree.leaves(getattr(shardings, part), is_leaf=lambda x: isinstance(x, NamedSharding))
        items = jax.tree_util.tree_leaves_with_path(getattr(state, part))
        for (path, x), sh in zip(items, shs, strict=True):
            name = path_name(path)
            category, param = _category(part, name)
            leaves.append({
                "name": f"{part}/{name}", "category": category, "param": param,
                "shape": list(x.shape), "dtype": str(np.dtype(x.dtype)),
                "spec": _spec_str(sh.spec), "compute": compute.get(param, ""),
                **leaf_placement(x, sh, flat),
            })
    per_device = {c: [0] * len(flat) for c in ("param", "mu", "nu", "opt")}
    for leaf in leaves:
        for i in range(len(flat)):
            per_device[leaf["category"]][i] += leaf["shard_bytes"]
    # Three drawn axes: pipe, the rows (data, or data x context with context parallelism:
    # row d * context + c), expert.
    P, D, C, X = (int(mesh.shape[a]) for a in AXES)
    coords = [[p, d * C + c, x] for p, d, c, x in np.ndindex(P, D, C, X)]
    return {
        "axes": ["pipe", "data" if C == 1 else "data x context", "expert"], "shape": [P, D * C, X],
        "device_ids": [int(d.id) for d in flat], "coords": coords,
        "strategy": plan.strategy, "zero1": plan.zero1, "dispatch": plan.dispatch,
        "leaves": leaves, "device_bytes": per_device,
    }
