"""`ragged_all_to_all` with jax.lax.ragged_all_to_all's exact semantics, on any platform.

GPU and TPU run the primitive (chosen by the target platform: the mesh's devices, so a
step lowered for abstract GPUs on a CPU host gets the primitive). CPU has none, so
`emulated_ragged_all_to_all` reproduces it over a dense `all_to_all`, consuming the same
(input_offsets, send_sizes, output_offsets, recv_sizes) the primitive would: each sender
packs, for each peer, its slices for that peer back to back into an operand-sized slab
(from input_offsets and send_sizes); the receiver learns where each slice lands from the
all_to_all'ed output_offsets and cuts the received slab with recv_sizes; each row of
`output` then gathers its source row (or keeps its value), so the emulation is linear
and transposable like the primitive. It is typed like the primitive too: the caller's
`output` must vary over the operand's mesh axes, on every path (`check_output_typing`).
Anything the offsets get wrong shows up in the result, which is what lets CPU tests
prove them. The emulation moves ep times the operand (dense slabs); the primitive
moves only the slices.

Semantics (jax docs): arrays of K = ep * q slices; slice i of the sender goes to rank
i // q and is written there at output_offsets[i]; slice i of the receiver came from rank
i // q and has recv_sizes[i] rows (equal to what that sender put in send_sizes).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from olmo_jax.kernels import platform, vma


def native_ragged_all_to_all_available() -> bool:
    """The target (the mesh's devices while a plan's step is traced) has the primitive."""
    return platform.native_collectives()


def ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes,
                      *, axis_name: str, emulate: bool | None = None):
    """jax.lax.ragged_all_to_all where the target has it (or emulate=False), else the
    dense emulation (or emulate=True). The result is typed (vma) like `output`, as the
    primitive types it: inside shard_map pass an `output` buffer varying over the
    operand's axes (`olmo_jax.kernels.vma.like`)."""
    check_output_typing(operand, output)
    if emulate is None:
        emulate = not native_ragged_all_to_all_available()
    fn = emulated_ragged_all_to_all if emulate else jax.lax.ragged_all_to_all
    return fn(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes,
              axis_name=axis_name)


def check_output_typing(operand, output) -> None:
    """The primitive types its result with `output`'s varying manual axes. A buffer that
    does not vary over every axis the operand varies over would type per-device rows as
    device-invariant (JAX then inserts a pvary whose transpose psums the cotangents of
    different devices' tokens), so it is refused, on every platform, at trace time."""
    missing = vma.varying_axes(operand) - vma.varying_axes(output)
    if missing:
        raise TypeError(
            f"ragged_all_to_all: the output buffer is invariant over mesh axes "
            f"{sorted(missing)} the operand varies over; the result would be typed "
            f"device-invariant. Build it with olmo_jax.kernels.vma.like(buffer, operand)"
        )


def _slot_of_rows(sizes_PQ: jax.Array, n_rows: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """For slabs holding slices of sizes_PQ[p] back to back: (slice q of each row [P, Y],
    the row's offset inside its slice, valid mask)."""
    ends_PQ = jnp.cumsum(sizes_PQ, axis=1)
    starts_PQ = ends_PQ - sizes_PQ
    r_Y = jnp.arange(n_rows, dtype=jnp.int32)
    q_PY = jax.vmap(lambda e: jnp.searchsorted(e, r_Y, side="right"))(ends_PQ).astype(jnp.int32)
    valid_PY = q_PY < sizes_PQ.shape[1]
    q_PY = jnp.minimum(q_PY, sizes_PQ.shape[1] - 1)
    within_PY = r_Y[None, :] - jnp.take_along_axis(starts_PQ, q_PY, axis=1)
    return q_PY, within_PY, valid_PY


def emulated_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets,
                               recv_sizes, *, axis_name: str):
    ep = jax.lax.axis_size(axis_name)
    K = input_offsets.shape[0]
    if K % ep:
        raise ValueError(f"ragged_all_to_all: {K} slices is not a multiple of the axis size {ep}")
    q = K // ep
    N, M = operand.shape[0], output.shape[0]
    # Sender: slab p holds the slices for peer p back to back.
    q_PY, within_PY, valid_PY = _slot_of_rows(send_sizes.reshape(ep, q), N)
    in_off_PQ = input_offsets.reshape(ep, q)
    src_PY = jnp.take_along_axis(in_off_PQ, q_PY, axis=1) + within_PY
    src_PY = jnp.where(valid_PY, src_PY, N)
    padded = jnp.concatenate([operand, jnp.zeros((1, *operand.shape[1:]), operand.dtype)])
    slab_PY = padded[src_PY]
    recv_PY = jax.lax.all_to_all(slab_PY, axis_name, 0, 0)  # [sender, N, ...]
    # Receiver: where each sender's slices go, and how long they are.
    out_off_PQ = jax.lax.all_to_all(output_offsets.reshape(ep, q), axis_name, 0, 0)
    q_PY, within_PY, valid_PY = _slot_of_rows(recv_sizes.reshape(ep, q), N)
    dest_PY = jnp.take_along_axis(out_off_PQ, q_PY, axis=1) + within_PY
    dest_PY = jnp.where(valid_PY, dest_PY, M)
    # Each output row's source row in the received slabs (-1: keeps `output`), then one
    # gather: linear in (operand, output) with a gather's transpose (a scatter-add), so
    # the emulation is differentiable and transposable like the primitive.
    flat = recv_PY.reshape(ep * N, *operand.shape[1:])
    src_R = jnp.full((M,), -1, jnp.int32).at[dest_PY.reshape(-1)].set(
        jnp.arange(ep * N, dtype=jnp.int32), mode="drop")
    keep = (src_R >= 0).reshape((M,) + (1,) * (operand.ndim - 1))
    return jnp.where(keep, flat[jnp.maximum(src_R, 0)], output)
