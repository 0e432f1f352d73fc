"""What an instruction's metadata op_name says: the JAX source path of the operation,
`jit(train_step)/.../attention_scores/dot_general`, built from jax.named_scope names,
transformations (`jvp(...)`, `transpose(...)`, `remat`) and primitive names. The named
scopes the model, the parallel code and the pipeline executor set are found here.
"""

from __future__ import annotations

import functools
import re

_NUMBERED = re.compile(r"[.]\d+$")
_ARGUMENT = re.compile(r"(\w+)[.](\w+)")
_COND_ROLE = r"(?:^|/)({})/cond$"
_COND_WITHIN = r"(?:^|/)({})/cond/"


@functools.cache
def _scope_pattern(scope: str) -> re.Pattern:
    return re.compile(rf"(^|[/(]){re.escape(scope)}([/)]|$)")


@functools.cache
def _collective_scope_pattern(scope: str) -> re.Pattern:
    return re.compile(rf"(^|[/(:]){re.escape(scope)}[/):]")


def in_scope(op_name: str, scope: str) -> bool:
    """`scope` is one element of the op_name's path: opened by the start, `/` or `(`,
    closed by `/`, `)` or the end ("a/attention/b", "jvp(router)")."""
    return _scope_pattern(scope).search(op_name) is not None


def in_collective_scope(op_name: str, scope: str) -> bool:
    """`scope` names a collective's enclosing scope: opened by the start, `/`, `(` or `:`
    and closed by `/`, `)` or `:` ("a/zero_gather/b", "jvp(loss_allsum)/psum"), never the
    op_name's last element (that is the primitive)."""
    return _collective_scope_pattern(scope).search(op_name) is not None


def argument(op_name: str, arg: str) -> str | None:
    """For a parameter whose op_name is the jitted function's argument path
    ("state.params['w']"): the attribute of argument `arg` it holds ("params")."""
    m = _ARGUMENT.match(op_name)
    return m.group(2) if m and m.group(1) == arg else None


def short_name(op_name: str) -> str:
    """The op_name's last element without the `.N` XLA numbers repeats with."""
    return _NUMBERED.sub("", op_name.rsplit("/", 1)[-1])


@functools.cache
def _cond_patterns(roles: tuple[str, ...]) -> tuple[re.Pattern, re.Pattern]:
    alt = "|".join(re.escape(r) for r in roles)
    return re.compile(_COND_ROLE.format(alt)), re.compile(_COND_WITHIN.format(alt))


def cond_scope(op_name: str, roles: tuple[str, ...]) -> tuple[str, str] | None:
    """For a conditional made by `lax.cond` inside one of the named scopes `roles`
    (op_name ending ".../<role>/cond"): (the role, the op_name before it); else None."""
    m = _cond_patterns(roles)[0].search(op_name)
    return (m.group(1), op_name[: m.start()]) if m else None


def conds_within(op_name: str, roles: tuple[str, ...]) -> list[str]:
    """The roles of `roles` whose `lax.cond` branch the op_name lies in ("<role>/cond/..."),
    outermost first."""
    return _cond_patterns(roles)[1].findall(op_name)
