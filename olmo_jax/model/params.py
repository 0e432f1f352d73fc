"""Parameter creation: every parameter is float32 and carries logical axis names.

The names (`embed`, `mlp`, `expert`, `vocab`, ...) are the only sharding information in
model code; `olmo_jax.parallel.rules` maps them to mesh axes in one table.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

# The parameters the model casts to the compute dtype wherever it uses them (the matmul
# weights), by their name in the params tree. A parallel plan may make their compute
# copies in that dtype before gathering them (olmo_jax/parallel/zero.py: the gather moves
# and keeps bf16): the model's own cast is then a no-op and every value is the same. The
# others are used in float32 and stay so: norm scales, the router (float32 logits), the
# embedding (looked up in float32, also the tied LM head).
CAST_AT_USE = frozenset({"q_proj", "k_proj", "v_proj", "o_proj", "w_gate", "w_up", "w_down",
                         "lm_head"})


def normal_param(key: jax.Array, shape: tuple[int, ...], axes: tuple[str | None, ...], std: float):
    """A float32 parameter drawn from N(0, std^2), truncated at 3 std (OLMo-core's init)."""
    assert len(shape) == len(axes), (shape, axes)
    value = std * jax.random.truncated_normal(key, -3.0, 3.0, shape, jnp.float32)
    return nnx.Param(value, out_sharding=axes, eager_sharding=False)


def ones_param(shape: tuple[int, ...], axes: tuple[str | None, ...]):
    assert len(shape) == len(axes), (shape, axes)
    return nnx.Param(jnp.ones(shape, jnp.float32), out_sharding=axes, eager_sharding=False)


def logical_axes(variable: nnx.Variable) -> tuple[str | None, ...]:
    """The logical axis names a parameter was created with (plus any stacking axes)."""
    return tuple(variable.get_metadata().get("out_sharding") or (None,) * variable.ndim)


def path_name(path) -> str:
    """'moe_blocks/ffn/experts/w_gate' for a jax key path of the params (an nnx Variable's
    `.value` dropped): the one spelling of parameter names (ZeRO layouts, Muon's matrices)."""
    parts = []
    for k in path:
        name = getattr(k, "key", getattr(k, "name", getattr(k, "idx", None)))
        if name is not None and name != "value":
            parts.append(str(name))
    return "/".join(parts)


def compute_copy_dtype(path, leaf, compute_dtype) -> str | None:
    """The dtype a compute copy of parameter `leaf` (at jax key path `path`) may take:
    `compute_dtype`'s name for a weight the model casts at use, when narrower than the
    stored leaf; None (the stored dtype) otherwise."""
    name = path_name(path).rsplit("/", 1)[-1]
    narrower = jnp.dtype(compute_dtype).itemsize < jnp.dtype(leaf.dtype).itemsize
    return jnp.dtype(compute_dtype).name if name in CAST_AT_USE and narrower else None
