"""Per-parameter-group overrides (OLMo-core's `OptimGroupOverride`): parameters selected by
glob on their path take their own learning rate and weight decay, as multipliers of
optim.lr and optim.weight_decay.

    optim.group_overrides = "*router*,embedding: wd_mult=0.0; lm_head: lr_mult=0.5"

Groups are separated by ";"; each is comma-separated globs (fnmatch, on the parameter paths
`olmo_jax.model.params.path_name` spells: "embedding", "moe_blocks/ffn/router/weight",
"moe_blocks/attn_norm/weight", ...), ":", then `lr_mult=` and / or `wd_mult=` (default 1).
As OLMo-core's `build_groups(strict=True)`: a glob that matches no parameter is an error,
and a parameter may belong to one group only (torch refuses a parameter in two groups);
the rest form the default group. A group's learning rate is its own schedule of
lr x lr_mult (OLMo-core schedules each param group from its own initial lr), its weight
decay weight_decay x wd_mult on the weights AdamW decays (optimizer.decay_mask)."""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass

import jax

from olmo_jax.errors import ConfigError
from olmo_jax.model.params import path_name

FIELD = "optim.group_overrides"
OPTS = ("lr_mult", "wd_mult")
DEFAULT = "default"


@dataclass(frozen=True)
class GroupOverride:
    globs: tuple[str, ...]
    lr_mult: float = 1.0
    wd_mult: float = 1.0

    @property
    def label(self) -> str:
        return ",".join(self.globs)


def parse(spec: str) -> list[GroupOverride]:
    """The groups of an optim.group_overrides spec (module docstring); ConfigError naming the
    field otherwise."""
    fix = "write it as 'GLOB[,GLOB...]: lr_mult=X, wd_mult=Y; ...', e.g. '*router*: wd_mult=0.0'"
    groups = []
    for part in (p.strip() for p in spec.split(";")):
        if not part:
            continue
        globs, sep, opts = part.partition(":")
        globs = tuple(g.strip() for g in globs.split(",") if g.strip())
        if not sep or not globs:
            raise ConfigError(f"{FIELD}={spec!r}: group {part!r} has no 'GLOBS:' part; {fix}")
        values = {}
        for item in (x.strip() for x in opts.split(",") if x.strip()):
            key, eq, value = (s.strip() for s in item.partition("="))
            if not eq or key not in OPTS:
                raise ConfigError(f"{FIELD}={spec!r}: {item!r} is not one of "
                                  f"{', '.join(o + '=X' for o in OPTS)}; {fix}")
            try:
                values[key] = float(value)
            except ValueError:
                raise ConfigError(f"{FIELD}={spec!r}: {key}={value!r} is not a number") from None
            if values[key] < 0:
                raise ConfigError(f"{FIELD}={spec!r}: {key}={value} must be >= 0")
        if not values:
            raise ConfigError(f"{FIELD}={spec!r}: group {part!r} sets nothing; {fix}")
        groups.append(GroupOverride(globs, **values))
    return groups


def labels(params, groups: list[GroupOverride]):
    """The tree of each parameter's group label (GroupOverride.label, or DEFAULT)."""
    names = [path_name(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
    if names in ([], [""]):  # not a tree of parameters (optax.tree_map_params' placeholder)
        return DEFAULT
    for g in groups:
        for glob in g.globs:
            if not any(fnmatch.fnmatchcase(n, glob) for n in names):
                raise ConfigError(
                    f"{FIELD}: the glob {glob!r} matches no parameter; the parameters are "
                    f"{', '.join(names[:12])}{', ...' if len(names) > 12 else ''}")

    def label(path, _):
        name = path_name(path)
        hits = [g.label for g in groups if any(fnmatch.fnmatchcase(name, x) for x in g.globs)]
        if len(hits) > 1:
            raise ConfigError(f"{FIELD}: parameter {name!r} is in more than one group "
                              f"({' and '.join(repr(h) for h in hits)}); make the globs disjoint")
        return hits[0] if hits else DEFAULT

    return jax.tree_util.tree_map_with_path(label, params)
