"""HLO type strings: the arrays they hold, their dimensions and bytes.

A type string is an array type, `bf16[8,128]{1,0}` (dtype, dimensions, layout), `f32[]`
(a scalar), or a tuple of them, `(f32[4], (s32[], u8[2,3]))`, perhaps with comments
(`/*index=5*/`). Dtypes without a size here (`token[]`, opaque types) hold no bytes.
"""

from __future__ import annotations

import math
import re

DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4,
               "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16,
               "f8e4m3fn": 1, "f8e5m2": 1, "f8e8m0fnu": 1, "s4": 1, "u4": 1}

_ARRAY = re.compile(r"\b([a-z]\w*)\[([\d,]*)\]")
_COMMENT = re.compile(r"/\*.*?\*/")


def arrays(type_str: str) -> list[tuple[str, str]]:
    """(dtype, dimensions as written, e.g. "4,2,16") of every array in a type string, in
    order (a tuple's elements flattened)."""
    return _ARRAY.findall(type_str)


def _ints(dims_text: str) -> list[int]:
    return [int(d) for d in dims_text.split(",") if d]


def dims(type_str: str) -> list[int]:
    """Dimensions of the first array in a type string ([] for a scalar or none)."""
    m = _ARRAY.search(type_str)
    return _ints(m.group(2)) if m else []


def elements(type_str: str) -> int:
    """Elements of the first array in a type string (1 for a scalar)."""
    return math.prod(dims(type_str))


def type_bytes(type_str: str) -> int:
    """Bytes of every array in a type string (a tuple counts all its elements)."""
    return shape_bytes(type_str)[0]


def shape_bytes(type_str: str) -> tuple[int, tuple[str, ...]]:
    """(bytes, "dtype[dims]" of each sized array) of a type string."""
    total, shapes = 0, []
    for dtype, ds in arrays(type_str):
        if dtype not in DTYPE_BYTES:
            continue
        total += math.prod(_ints(ds)) * DTYPE_BYTES[dtype]
        shapes.append(f"{dtype}[{ds}]")
    return total, tuple(shapes)


def tuple_elements(type_str: str) -> list[str]:
    """The element types of a tuple type string (one element for an array type)."""
    text = _COMMENT.sub("", type_str).strip()
    if not text.startswith("("):
        return [text]
    out, depth, start = [], 0, 1
    for i, ch in enumerate(text[1:-1], 1):
        depth += ch in "([{"
        depth -= ch in ")]}"
        if ch == "," and depth == 0:
            out.append(text[start:i].strip())
            start = i + 1
    last = text[start:-1].strip()
    return out + [last] if last else out
