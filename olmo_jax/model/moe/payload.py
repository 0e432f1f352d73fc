"""The expert dispatch payload: what travels in the expert all-to-all, and the hook an
expert-parallel dispatcher calls to move it.

    y = payload.transfer(x_RD, move, precision, *move_args)

`move(a, *move_args)` is the dispatcher's linear row movement (e.g. `lambda a:
jax.lax.all_to_all(a, "expert", 0, 0, tiled=True)` inside shard_map): it must act on
rows only, whatever the last dimension and dtype, and be linear in `a` (its transpose
carries gradients back). Traced values it needs (ragged offsets) are passed as
`move_args`, never closed over: `move` is static data of a custom VJP. With
precision "bf16" this is just move(x). With "mxfp8" each row is quantized along D
(blocks of 32, e4m3 values + e8m0 scales) and packed into one uint8 array [R, D + D/32]
(`olmo_jax.kernels.mxfp8_quant.pack_rows`) before `move`, and dequantized to x's dtype on
arrival: 33/64 = 0.516x the bytes of bf16 on the wire. The backward pass (a straight-
through estimator: d dequant(quant(x)) / dx = 1) moves the cotangent back through
move's transpose in x's dtype, like the bf16 path.

The bytes a compiled dispatcher actually moves are read from its HLO by the planner
(`olmo_jax.planner.comms.all_to_all_ops`), which the tests use to check the saving.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from olmo_jax.kernels import mxfp8_quant as mx
from olmo_jax.model.mxfp8_gemm import PRECISIONS


def encode(x_RD, precision: str):
    """The array that travels: x itself (bf16) or its packed MXFP8 rows (uint8)."""
    if precision == "bf16":
        return x_RD
    if precision == "mxfp8":
        return mx.pack_rows(x_RD)
    raise ValueError(f"dispatch payload precision {precision!r}: choose one of {PRECISIONS}")


def decode(payload, precision: str, dtype):
    """Inverse of encode on arrival."""
    if precision == "bf16":
        return payload.astype(dtype)
    return mx.unpack_rows(payload, dtype)


def transfer(x_RD, move, precision: str = "bf16", *move_args):
    """move(x, *move_args) with the payload in `precision` (see module doc);
    differentiable in x."""
    if precision == "bf16":
        return move(x_RD, *move_args)
    return _quantized_transfer(x_RD, move_args, move, precision)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _quantized_transfer(x_RD, move_args, move, precision):
    return decode(move(encode(x_RD, precision), *move_args), precision, x_RD.dtype)


@functools.partial(
    jax.tree_util.register_dataclass, data_fields=["probe"], meta_fields=["n_rows"]
)
@dataclasses.dataclass(frozen=True)
class _RowsLike:
    """What the backward pass needs of x: its row count (static) and its type, carried
    by a zero-row slice (inside shard_map that slice has x's manual axes)."""

    probe: jax.Array
    n_rows: int

    def example(self):
        return jnp.pad(self.probe, ((0, self.n_rows), (0, 0)))


def _qt_fwd(x_RD, move_args, move, precision):
    y = _quantized_transfer(x_RD, move_args, move, precision)
    return y, (_RowsLike(x_RD[:0], x_RD.shape[0]), move_args)


def _qt_bwd(move, precision, res, g):
    # move is linear: its transpose needs only x's type (no primal values, no forward run).
    like, move_args = res
    example = like.example()
    (dx,) = jax.linear_transpose(lambda a: move(a, *move_args), example)(g.astype(example.dtype))
    args_ct = jax.tree.map(lambda a: np.zeros(a.shape, jax.dtypes.float0), move_args)
    return dx, args_ct


_quantized_transfer.defvjp(_qt_fwd, _qt_bwd)
