"""The one place where olmo_jax bridges jax 0.11.2 and 0.12 (pyproject pins >=0.11.2,<0.13).

The lent H200 image ships jax/jaxlib 0.11.2 and installs nothing, so every API olmo_jax
uses must exist in 0.11.2 or have a fallback here with identical numerics on both.
What differs (checked against both installed versions; `make test` runs the tests of
these APIs in .venv-jax011 too, Makefile J11_TESTS):

- `plgpu.store(ref, value, optimized=False)` (Pallas Mosaic GPU) is new in 0.12. In
  0.11.2 the ref assignment `ref[...] = value` lowers (Lane semantics) to the same
  unoptimized untiled store of the value's fragments (it also reads the old contents,
  which are discarded); in interpret mode both are the state `swap`. `gpu_store` picks.

- `plgpu.kernel(..., cost_estimate=)` is new in 0.12 (0.11.2 passes unknown keywords on to
  its Mesh, which refuses them). `gpu_kernel_cost` gives the keyword where it exists; in
  0.11.2 a kernel declares no cost, which changes no numerics (the planner then counts
  its FLOPs as 0, as planner/gpu_hlo.py says).

- cuDNN's fused-attention backward primitive (`_dot_product_attention_bwd_p_wrapper` of
  jax/_src/cudnn/fused_attention_stablehlo.py), which the ring's cuDNN blocks call with
  the global output and softmax statistics (kernels/ring_blocks.py): 0.12 binds flex
  attention's `score_mod` (None) as a static argument, 0.11.2 has none; the operands and
  the other static arguments are the same. `cudnn_sdpa_bwd` binds it either way. (The
  forward, jax's private `dot_product_attention` with `return_residual`, is called by
  keyword and is the same on both.)

Everything else olmo_jax calls exists in 0.11.2 with the same meaning: the jax functions of
`SAME_ON_BOTH` below (shard_map and its vma typing, pcast, ppermute, all_gather (over
replica groups: the ring's pair exchanges), ragged_all_to_all,
scaled_matmul, the FFI, the Pallas Mosaic GPU primitives), plus
`jax.experimental.topologies` (deviceless GPU compiles, in the CUDA plugin's venv only) and
the class `plgpu.InterpretGPUParams`. `make test`'s jax 0.11.2 stage runs the tests marked
`jax011` and fails unless they call every shim here and every function of SAME_ON_BOTH
from olmo_jax (tests/jax011_apis.py).
(flax must be >= 0.12.10 with jax 0.11.2: flax 0.12.9 and older subclass
`jax.experimental.hijax.HiPrimitive`, which jax 0.11.2 names `HiPrim`, so `from flax
import nnx` fails.)
"""

from __future__ import annotations

# The jax functions olmo_jax calls whose meaning was checked on both versions (module
# docstring), by dotted name.
SAME_ON_BOTH = (
    "jax.shard_map", "jax.typeof", "jax.lax.pcast", "jax.lax.ppermute", "jax.lax.all_gather",
    "jax.lax.ragged_all_to_all", "jax.nn.scaled_matmul", "jax.ffi.ffi_call",
    "jax.ffi.register_ffi_target",
    *(f"jax.experimental.pallas.mosaic_gpu.{f}" for f in (
        "kernel", "load", "layout_cast", "emit_pipeline", "nd_loop", "wgmma", "tcgen05_mma")),
)


def gpu_store(ref, value) -> None:
    """Store `value` into the Pallas Mosaic GPU ref `ref` (SMEM or GMEM), unoptimized."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    store = getattr(plgpu, "store", None)
    if store is not None:  # jax >= 0.12
        store(ref, value, optimized=False)
    else:  # jax 0.11: the swap lowering stores untiled, optimized=False
        ref[...] = value


def gpu_kernel_cost(estimate) -> dict:
    """`plgpu.kernel`'s keyword arguments declaring `estimate` (a pl.CostEstimate) to XLA:
    {"cost_estimate": estimate} on jax >= 0.12, nothing on 0.11.2 (module docstring)."""
    import inspect

    from jax.experimental.pallas import mosaic_gpu as plgpu

    if "cost_estimate" in inspect.signature(plgpu.kernel).parameters:
        return {"cost_estimate": estimate}
    return {}


def cudnn_sdpa_bwd(q_BTNH, k_BSKH, v_BSKH, o_BTNH, stats, do_BTNH, *, q_seqlen=None,
                   kv_seqlen=None, q_offsets=None, kv_offsets=None, scale: float, mask_type):
    """(dq, dk, dv) of cuDNN's fused attention (BTNH layout, no bias or dropout) from a
    given output `o_BTNH` and softmax statistics `stats` (cuDNN's layout, as
    `dot_product_attention(..., return_residual=True)` returns them): jax's private
    backward primitive, bound as jax's own VJP binds it. Its static arguments differ: jax
    0.12 adds flex attention's `score_mod` (None here); 0.11.2 has none."""
    import inspect

    import jax.numpy as jnp
    from jax._src.cudnn import fused_attention_stablehlo as fa

    unused = jnp.zeros(0, q_BTNH.dtype)
    args = [unused if x is None else x for x in (q_seqlen, kv_seqlen, q_offsets, kv_offsets)]
    extra = {}
    if "score_mod" in inspect.signature(fa._dot_product_attention_bwd_rule).parameters:
        extra["score_mod"] = None  # jax >= 0.12 (and no score_mod_args operands)
    dq, dk, dv = fa._dot_product_attention_bwd_p_wrapper.bind(
        q_BTNH, k_BSKH, v_BSKH, unused, *args, unused, unused, stats, o_BTNH, do_BTNH,
        scale=scale, seed=42, dropout_rate=0.0, variadic_args=(False, False),
        mask_type=mask_type, layout=fa.AttentionLayout.BTNH.value,
        sliding_window_length=None, **extra)
    return dq, dk, dv
