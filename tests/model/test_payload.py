"""The dispatch payload hook: values and gradients through a row movement, and the bytes
of a real all-to-all (shard_map over 8 CPU devices) in compiled HLO: MXFP8 <= 0.55x bf16."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from olmo_jax.kernels import mxfp8_quant as mx
from olmo_jax.model.moe import payload
from olmo_jax.planner import comms


def test_transfer_values_and_gradient_through_a_permutation():
    x = jax.random.normal(jax.random.key(0), (48, 64), jnp.bfloat16)
    perm = jax.random.permutation(jax.random.key(1), 48)
    g = jax.random.normal(jax.random.key(2), (48, 64), jnp.bfloat16)

    @jax.jit
    def run(x, g):
        y, vjp = jax.vjp(lambda x: payload.transfer(x, lambda a: a[perm], "mxfp8"), x)
        return y, vjp(g)[0]

    y, dx = run(x, g)
    assert y.dtype == x.dtype
    np.testing.assert_array_equal(np.asarray(y), np.asarray(mx.quantize_dequantize(x)[perm]))
    # Straight-through: the cotangent goes back through the permutation's transpose.
    np.testing.assert_array_equal(np.asarray(dx), np.asarray(jnp.zeros_like(g).at[perm].set(g)))
    assert payload.transfer(x, lambda a: a[perm], "bf16") is not None
    with pytest.raises(ValueError, match="precision"):
        payload.encode(x, "fp8")


def _all_to_all_step(precision):
    """(x, f, lowered HLO text of f, lowered HLO text of grad) for a shard_map over 8
    devices whose body moves its rows with a tiled all_to_all through the hook."""
    mesh = jax.make_mesh((8,), ("expert",))
    spec = PartitionSpec("expert")

    def per_device(x):
        move = lambda a: jax.lax.all_to_all(a, "expert", 0, 0, tiled=True)  # noqa: E731
        return payload.transfer(x, move, precision)

    f = jax.shard_map(per_device, mesh=mesh, in_specs=spec, out_specs=spec)

    def loss(x):
        return jnp.sum(f(x).astype(jnp.float32) ** 2)

    sharding = NamedSharding(mesh, spec)
    x = jax.device_put(jax.random.normal(jax.random.key(3), (8 * 64, 128), jnp.bfloat16), sharding)
    fwd = jax.jit(f).lower(x).as_text(dialect="hlo")
    grad = jax.jit(jax.grad(loss)).lower(x).as_text(dialect="hlo")
    return x, f, fwd, grad


def test_all_to_all_payload_bytes_and_values():
    x, f_bf16, fwd_bf16, _ = _all_to_all_step("bf16")
    _, f_mx, fwd_mx, grad_mx = _all_to_all_step("mxfp8")
    bytes_bf16 = comms.all_to_all_bytes(fwd_bf16)
    bytes_mx = comms.all_to_all_bytes(fwd_mx)
    assert bytes_bf16 == x.nbytes // 8  # per device: all its rows (the self slot included)
    assert bytes_mx / bytes_bf16 <= 0.55, (bytes_mx, bytes_bf16)  # 33/64 = 0.516
    # The backward all-to-all carries the bf16 cotangent (straight-through).
    assert sorted(comms.all_to_all_ops(grad_mx)) == [bytes_mx, bytes_bf16]
    y_mx, y_bf16 = np.asarray(f_mx(x), np.float32), np.asarray(f_bf16(x), np.float32)
    expected = np.asarray(jax.jit(f_bf16)(mx.quantize_dequantize(x)), np.float32)
    np.testing.assert_array_equal(y_mx, expected)
    assert np.abs(y_mx - y_bf16).max() <= 2.0**-4 * np.abs(y_bf16).max()
