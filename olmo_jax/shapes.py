"""Shape annotations: public functions declare their arrays' axes with the dimension
letters of the legend (olmo_jax/model/__init__.py), and tests check them at trace time.

    from olmo_jax import shapes

    @shapes.check("-> B T V")                 # arguments: from their names (x_BTD: B T D)
    def head(self, x_BTD): ...

    @shapes.check("w: G K N", "-> M N")       # an argument without a suffix, spelled out
    def gmm(x_MK, w, group_sizes_G): ...

An argument whose name ends in `_` + letters (`x_BTD`, `idx_Sk`, `m_BKM1`) is checked
against its name: one axis per letter, a digit run is a literal size. Items spell out the
rest:
  "name: DIMS"        an argument (overrides its name)
  "name.field: DIMS"  a field of an argument (a NamedTuple or any object)
  "name.*"            every field of the argument named with a suffix (`routing.*`)
  "-> R1, R2, ..."    the result, or a tuple result element by element; each Ri is DIMS,
                      "field: DIMS" (a field of the result), "*" (every suffixed field
                      of the result, by name) or "_" (not checked)
DIMS are space-separated axes: a letter (bound on first sight), an integer, `*` (any one
axis), `...` (any number of axes, at most once) or an expression of bound letters
without spaces (`T+1`, `D+D/32`, `N*H`; `/` must divide exactly). None values are not
checked (optional arguments), nor a suffixed argument holding no array.

Each call binds every letter once across its arguments and results; a mismatch raises
ShapeError naming the function, the argument (or result) and the letter, and where the
letter was bound. Inside jit, scan or remat this runs once per trace, on static shapes.

Cost: the checks are off unless OLMO_JAX_SHAPE_CHECKS=1 is in the environment when this
module is first imported (tests/conftest.py sets it). Off, `check` parses its items
(a typo fails at import) and returns the function itself: no wrapper, nothing at trace
time or run time.
"""

from __future__ import annotations

import ast
import functools
import inspect
import operator
import os
import re
from collections.abc import Callable
from fractions import Fraction
from typing import Any, NamedTuple

ENV = "OLMO_JAX_SHAPE_CHECKS"
ENABLED = os.environ.get(ENV, "0").strip().lower() in ("1", "true", "yes", "on")

_SUFFIX = re.compile(r"_([A-Z][A-Za-z0-9]*)$")
_AXIS = re.compile(r"[A-Za-z]|[0-9]+")


class ShapeError(ValueError):
    """An array's shape disagrees with its annotation (or with another argument's)."""


class _Axis(NamedTuple):
    kind: str  # "letter", "int", "any", "ellipsis", "expr"
    value: Any  # the letter, the int, or (source, parsed ast) of an expression


class _Dims(NamedTuple):
    text: str
    axes: tuple[_Axis, ...]


class _Spec(NamedTuple):
    args: dict  # argument name -> _Dims | "fields"; "name.field" -> _Dims
    result: tuple | None  # None: unchecked; else ("whole", item) or ("tuple", items)


# ----------------------------------------------------------------------------- parsing


def parse_dims(text: str) -> _Dims:
    """'B T D' -> the axes; raises ValueError on a malformed item."""
    axes = []
    for tok in text.split():
        if tok == "...":
            axes.append(_Axis("ellipsis", None))
        elif tok == "*":
            axes.append(_Axis("any", None))
        elif tok.isdigit():
            axes.append(_Axis("int", int(tok)))
        elif len(tok) == 1 and tok.isalpha():
            axes.append(_Axis("letter", tok))
        else:
            axes.append(_Axis("expr", (tok, _parse_expr(tok))))
    if sum(a.kind == "ellipsis" for a in axes) > 1:
        raise ValueError(f"shape {text!r}: at most one '...'")
    return _Dims(text, tuple(axes))


def dims_of_name(name: str) -> _Dims | None:
    """x_BTD -> B T D; idx_Sk -> S k; m_BKM1 -> B K M 1; names without a suffix -> None."""
    m = _SUFFIX.search(name)
    if m is None:
        return None
    return parse_dims(" ".join(_AXIS.findall(m.group(1))))


_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
        ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv}


def _parse_expr(tok: str):
    try:
        tree = ast.parse(tok, mode="eval").body
    except SyntaxError:
        raise ValueError(f"shape axis {tok!r}: not a letter, integer, '*', '...' or expression")
    for node in ast.walk(tree):
        ok = isinstance(node, (ast.BinOp, ast.UnaryOp, ast.USub, ast.Name, ast.Load,
                               *_OPS)) or (isinstance(node, ast.Constant)
                                           and isinstance(node.value, int))
        if not ok or (isinstance(node, ast.Name) and len(node.id) != 1):
            raise ValueError(f"shape axis {tok!r}: expressions use single letters, integers "
                             f"and + - * / //")
    return tree


def _names(tree) -> set[str]:
    return {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}


def _eval(tree, env: dict) -> Fraction:
    if isinstance(tree, ast.Constant):
        return Fraction(tree.value)
    if isinstance(tree, ast.Name):
        return Fraction(env[tree.id])
    if isinstance(tree, ast.UnaryOp):
        return -_eval(tree.operand, env)
    a, b = _eval(tree.left, env), _eval(tree.right, env)
    if isinstance(tree.op, ast.Div):
        return a / b
    return Fraction(_OPS[type(tree.op)](a, b))


def _parse_items(items: tuple[str, ...]) -> _Spec:
    args: dict = {}
    result = None
    for item in items:
        item = item.strip()
        if item.startswith("->"):
            if result is not None:
                raise ValueError(f"shape annotation {item!r}: a second '->' item")
            parts = [p.strip() for p in item[2:].split(",")]
            if len(parts) > 1 and parts[-1] == "":
                parts = parts[:-1]  # "-> A B," a one-element tuple
                elems = tuple(_result_elem(p) for p in parts)
                result = ("tuple", elems)
            elif len(parts) == 1:
                result = ("whole", _result_elem(parts[0]))
            else:
                result = ("tuple", tuple(_result_elem(p) for p in parts))
        elif item.endswith(".*"):
            args[item[:-2]] = "fields"
        elif ":" in item:
            name, dims = (s.strip() for s in item.split(":", 1))
            args[name] = parse_dims(dims)
        else:
            raise ValueError(f"shape annotation {item!r}: expected 'name: DIMS', 'name.*' or "
                             f"'-> DIMS'")
    return _Spec(args, result)


def _result_elem(text: str):
    if text == "_":
        return None
    if text == "*":
        return "fields"
    if ":" in text:
        field, dims = (s.strip() for s in text.split(":", 1))
        return _Field(field, parse_dims(dims))
    return parse_dims(text)


class _Field(NamedTuple):
    name: str
    dims: _Dims


# ----------------------------------------------------------------------------- checking


class _Binding:
    """The letters of one call: letter -> (size, where it was bound)."""

    def __init__(self, fn_name: str):
        self.fn = fn_name
        self.sizes: dict[str, int] = {}
        self.where: dict[str, str] = {}
        self.deferred: list = []  # (what, shape, axis index, axis)

    def fail(self, what: str, shape, msg: str):
        raise ShapeError(f"{self.fn}: {what} has shape {tuple(shape)}: {msg}")

    def match(self, what: str, shape, dims: _Dims):
        shape = tuple(int(s) for s in shape)
        axes = dims.axes
        n_fixed = sum(a.kind != "ellipsis" for a in axes)
        if any(a.kind == "ellipsis" for a in axes):
            if len(shape) < n_fixed:
                self.fail(what, shape, f"{len(shape)} axes, '{dims.text}' wants at least {n_fixed}")
            at = next(i for i, a in enumerate(axes) if a.kind == "ellipsis")
            extra = len(shape) - n_fixed
            placed = [(i, a) for i, a in enumerate(axes[:at])]
            placed += [(i + extra, a) for i, a in enumerate(axes[at + 1:], start=at)]
        else:
            if len(shape) != n_fixed:
                self.fail(what, shape, f"{len(shape)} axes, '{dims.text}' wants {n_fixed}")
            placed = list(enumerate(axes))
        for i, a in placed:
            size = shape[i]
            if a.kind == "int" and size != a.value:
                self.fail(what, shape, f"axis {i} is {size}, '{dims.text}' wants {a.value}")
            elif a.kind == "letter":
                bound = self.sizes.get(a.value)
                if bound is None:
                    self.sizes[a.value] = size
                    self.where[a.value] = f"{what} (axis {i})"
                elif bound != size:
                    self.fail(what, shape, f"axis {i} is {a.value}={size} in '{dims.text}', but "
                                           f"{a.value}={bound} from {self.where[a.value]}")
            elif a.kind == "expr":
                self.deferred.append((what, shape, i, a, dims.text))
        self.resolve(final=False)

    def resolve(self, final: bool):
        keep = []
        for what, shape, i, a, text in self.deferred:
            src, tree = a.value
            missing = _names(tree) - self.sizes.keys()
            if missing:
                if final:
                    raise ShapeError(f"{self.fn}: {what}: '{src}' in '{text}' uses "
                                     f"{', '.join(sorted(missing))}, bound by no argument or result")
                keep.append((what, shape, i, a, text))
                continue
            want = _eval(tree, self.sizes)
            if want != shape[i]:
                env = ", ".join(f"{k}={self.sizes[k]}" for k in sorted(_names(tree)))
                self.fail(what, shape, f"axis {i} is {shape[i]}, '{src}' in '{text}' is "
                                       f"{want} ({env})")
        self.deferred = keep

    def value(self, what: str, x, dims: _Dims | None, strict: bool = True):
        if x is None or dims is None:
            return
        shape = getattr(x, "shape", None)
        if shape is None and not strict:  # a suffixed name holding a non-array: not ours
            return
        if shape is None:
            raise ShapeError(f"{self.fn}: {what} is a {type(x).__name__}, not an array, "
                             f"but is annotated '{dims.text}'")
        self.match(what, shape, dims)

    def fields(self, what: str, obj):
        """Every field of obj named with a suffix, checked against its name."""
        if obj is None:
            return
        names = getattr(obj, "_fields", None) or [n for n in vars(obj) if not n.startswith("_")]
        for n in names:
            dims = dims_of_name(n)
            x = getattr(obj, n)
            if dims is not None and x is not None and hasattr(x, "shape"):
                self.match(f"{what}.{n}", x.shape, dims)


def _qualname(fn) -> str:
    return f"{fn.__module__}.{fn.__qualname__}"


def _check_args(spec: _Spec, sig: inspect.Signature, b: _Binding, args, kwargs):
    bound = sig.bind(*args, **kwargs)
    for name, value in bound.arguments.items():
        p = sig.parameters[name]
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        item = spec.args.get(name)
        if item == "fields":
            b.fields(f"argument {name}", value)
        elif item is not None:
            b.value(f"argument {name}", value, item)
        else:
            b.value(f"argument {name}", value, dims_of_name(name), strict=False)
    for key, dims in spec.args.items():
        if "." in key:
            name, field = key.split(".", 1)
            obj = bound.arguments.get(name)
            if obj is not None:
                b.value(f"argument {key}", getattr(obj, field), dims)


def _check_result(spec: _Spec, b: _Binding, out):
    if spec.result is None:
        return
    how, what = spec.result
    elems = [what] if how == "whole" else list(what)
    if how == "tuple":
        if not isinstance(out, tuple) or len(out) != len(elems):
            n = len(out) if isinstance(out, tuple) else "not a tuple"
            raise ShapeError(f"{b.fn}: the result has {n} elements, the annotation "
                             f"{len(elems)}")
        values = list(out)
    else:
        values = [out]
    for i, (elem, value) in enumerate(zip(elems, values)):
        label = "the result" if how == "whole" else f"result {i}"
        if elem is None:
            continue
        if elem == "fields":
            b.fields(label, value)
        elif isinstance(elem, _Field):
            b.value(f"{label}.{elem.name}", getattr(value, elem.name), elem.dims)
        else:
            b.value(label, value, elem)


def check(*items: str, enabled: bool | None = None) -> Callable:
    """Decorator: the shape annotation of a function (see the module doc). `enabled`
    (tests of this module): wrap or not regardless of OLMO_JAX_SHAPE_CHECKS."""
    spec = _parse_items(items)
    on = ENABLED if enabled is None else enabled

    def decorate(fn):
        sig = inspect.signature(fn)
        unknown = {k.split(".", 1)[0] for k in spec.args} - sig.parameters.keys()
        if unknown:
            raise ValueError(f"shape annotation of {_qualname(fn)} names no argument "
                             f"{', '.join(sorted(unknown))}")
        fn.__shapes__ = items
        if not on:
            return fn
        name = _qualname(fn)

        @functools.wraps(fn)
        def checked(*args, **kwargs):
            b = _Binding(name)
            _check_args(spec, sig, b, args, kwargs)
            out = fn(*args, **kwargs)
            _check_result(spec, b, out)
            b.resolve(final=True)
            return out

        return checked

    return decorate


__all__ = ["ENABLED", "ENV", "ShapeError", "check", "dims_of_name", "parse_dims"]
