"""Named trees: any pytree (TrainState, nnx.State, optax states) <-> a flat mapping from
readable slash-separated names ("params/moe_blocks/attn/q_proj") to leaves, and back.

Checkpoints store these names (as nested dicts), so what is on disk does not depend on
Python classes, and a mismatch can be reported by the parameter's name.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax

from olmo_jax.errors import CheckpointError


def _key_name(key) -> str:
    if isinstance(key, jax.tree_util.DictKey):
        return str(key.key)
    if isinstance(key, jax.tree_util.GetAttrKey):
        return key.name
    if isinstance(key, jax.tree_util.SequenceKey):
        return str(key.idx)
    if isinstance(key, jax.tree_util.FlattenedIndexKey):
        return str(key.key)
    return str(key)


def _path_name(path) -> str:
    parts = [_key_name(k) for k in path]
    # An nnx.Variable flattens to its value under an attribute key `value`: drop it so
    # the name is the parameter's ("attn/q_proj", not "attn/q_proj/value").
    if path and isinstance(path[-1], jax.tree_util.GetAttrKey) and path[-1].name == "value":
        parts = parts[:-1]
    return "/".join(parts)


def flatten_named(tree: Any) -> dict[str, Any]:
    """{name: leaf} in the tree's flattening order."""
    flat = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        name = _path_name(path)
        if name in flat:
            raise ValueError(f"two leaves share the name {name!r}")
        flat[name] = leaf
    return flat


def unflatten_named(like: Any, flat: Mapping[str, Any]) -> Any:
    """A tree shaped like `like` whose leaves are `flat[name]`."""
    names = list(flatten_named(like))
    return jax.tree.unflatten(jax.tree.structure(like), [flat[n] for n in names])


def nest(flat: Mapping[str, Any]) -> dict:
    """{"a/b": x} -> {"a": {"b": x}} (the form orbax stores)."""
    out: dict = {}
    for name, leaf in flat.items():
        node = out
        *parents, last = name.split("/")
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = leaf
    return out


def flatten_nested(nested: Mapping) -> dict[str, Any]:
    """The inverse of `nest` (dict nodes only; anything else is a leaf)."""
    flat: dict[str, Any] = {}

    def walk(node, prefix):
        for k, v in node.items():
            name = f"{prefix}/{k}" if prefix else str(k)
            if isinstance(v, Mapping):
                walk(v, name)
            else:
                flat[name] = v

    walk(nested, "")
    return flat


def check_fits(expected: Mapping[str, Any], found: Mapping[str, Any], where: str) -> None:
    """Raises CheckpointError at the first name (in `expected`'s order) that is missing
    from `found` or has another shape or dtype, then at the first unexpected name.

    Values are anything with `.shape` and `.dtype` (arrays, ShapeDtypeStructs, orbax
    array metadata)."""
    for name, want in expected.items():
        if name not in found:
            raise CheckpointError(
                f"{where}: parameter '{name}' is missing from the checkpoint (the model "
                f"expects shape {tuple(want.shape)}); the checkpoint was written for another "
                "model configuration"
            )
        got = found[name]
        if tuple(got.shape) != tuple(want.shape):
            raise CheckpointError(
                f"{where}: parameter '{name}' has shape {tuple(got.shape)} in the checkpoint "
                f"but the model expects {tuple(want.shape)}; the checkpoint was written for "
                "another model configuration"
            )
        if got.dtype is not None and jax.numpy.dtype(got.dtype) != jax.numpy.dtype(want.dtype):
            raise CheckpointError(
                f"{where}: parameter '{name}' has dtype {got.dtype} in the checkpoint but the "
                f"model expects {want.dtype}"
            )
    extra = [n for n in found if n not in expected]
    if extra:
        raise CheckpointError(
            f"{where}: the checkpoint has parameter '{extra[0]}' (shape "
            f"{tuple(found[extra[0]].shape)}) that the model does not have"
            + (f", and {len(extra) - 1} more" if len(extra) > 1 else "")
            + "; the checkpoint was written for another model configuration"
        )
