"""The GPU paths' types inside shard_map, checked on the CPU host (issue: GPU paths right
by construction).

Every custom op run inside shard_map must type its outputs with its inputs' varying
manual axes (vma): a device-invariant output holding per-device rows makes JAX insert a
pvary whose transpose psums the cotangents of different devices' tokens. Each op's
output type is checked at trace time, and the trainer's step with native
ragged_all_to_all, lowered for CUDA, has exactly the collectives of the CPU-emulated
step (the primitive in place of its all_to_all emulation): no extra all-reduce.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from olmo_jax.kernels import grouped_matmul, grouped_matmul_tcgen05, platform, ring_blocks, vma
from olmo_jax.kernels import mxfp8_quant as mx
from olmo_jax.model.abstract import abstract_model
from olmo_jax.parallel.expert.ragged_a2a import ragged_all_to_all
from olmo_jax.trainer.step import make_train_step
from tests.parallel.harness import batches, host_state, make_cfg, with_capacity
from tests.sections import plan_for

EP = 4


def _mesh():
    return Mesh(np.asarray(jax.devices()[:EP]), ("expert",))


def _traced_types(fn, *args):
    """The output types of fn run per device inside shard_map over 'expert' (every input
    split over it, so every input varies over it)."""
    mesh = _mesh()
    spec = PartitionSpec("expert")
    types = []

    def local(*a):
        out = fn(*a)
        types.extend(jax.typeof(o) for o in jax.tree.leaves(out))
        return jax.tree.map(lambda o: o.sum(keepdims=True).reshape(1), out)

    jax.eval_shape(jax.shard_map(local, mesh=mesh, in_specs=spec, out_specs=spec),
                   *(jax.ShapeDtypeStruct((EP * a.shape[0], *a.shape[1:]), a.dtype,
                                          sharding=NamedSharding(mesh, spec)) for a in args))
    return types


def _varies(t) -> bool:
    return "expert" in t.manual_axis_type.varying


@pytest.mark.jax011
@pytest.mark.parametrize("emulate", [False, True], ids=["native", "emulated"])
def test_ragged_all_to_all_result_varies_like_its_rows(emulate):
    """The dispatcher's buffers vary over the operand's axes, so the result does; an
    invariant output buffer is refused on both paths (the primitive would type the
    result invariant)."""
    rows = 16

    def exchange(x, sizes):
        out = vma.like(jnp.zeros((rows, 8), x.dtype), x)
        zero = jnp.zeros((EP,), jnp.int32)
        return ragged_all_to_all(x, out, zero, sizes[:EP], zero, sizes[:EP],
                                 axis_name="expert", emulate=emulate)

    (t,) = _traced_types(exchange, jnp.zeros((rows, 8)), jnp.zeros((EP,), jnp.int32))
    assert _varies(t)

    def invariant_buffer(x, sizes):
        zero = jnp.zeros((EP,), jnp.int32)
        return ragged_all_to_all(x, jnp.zeros((rows, 8), x.dtype), zero, sizes[:EP], zero,
                                 sizes[:EP], axis_name="expert", emulate=emulate)

    with pytest.raises(TypeError, match="output buffer is invariant over mesh axes"):
        _traced_types(invariant_buffer, jnp.zeros((rows, 8)), jnp.zeros((EP,), jnp.int32))


@pytest.mark.jax011
@pytest.mark.parametrize("kernels", [grouped_matmul, grouped_matmul_tcgen05],
                         ids=["hopper", "blackwell"])
def test_pallas_grouped_matmul_outputs_vary_like_their_inputs(kernels):
    M, K, N, G = 128, 64, 64, 4
    gs = jnp.zeros((G,), jnp.int32)
    gmm, tgmm = kernels.gmm, kernels.tgmm
    with platform.cross_lowering():
        types = _traced_types(
            lambda x, w, dy, gs: (gmm(x, w[0], gs), gmm(dy, w[0], gs, transpose_rhs=True),
                                  tgmm(x, dy, gs)),
            jnp.zeros((M, K), jnp.bfloat16), jnp.zeros((1, G, K, N), jnp.bfloat16),
            jnp.zeros((M, N), jnp.bfloat16), gs)
    assert len(types) == 3 and all(_varies(t) for t in types), types


@pytest.mark.jax011
@pytest.mark.parametrize("diagonal", [True, False], ids=["diagonal", "before"])
def test_cudnn_ring_block_backward_varies_like_its_inputs(diagonal):
    # The ring's cuDNN block backward (kernels/ring_blocks.py: jax's backward primitive
    # bound with the global O / LSE, compat.cudnn_sdpa_bwd) traced inside shard_map for
    # one document-masked block: dq, dk and dv vary like q, k and v (an invariant dk would
    # be psum-ed across the ring's devices by the pvary's transpose).
    B, K, G, L, H = 1, 2, 2, 16, 32
    kern = ring_blocks.cudnn_kernels(max_docs=4, packed_diagonal=True)

    def bwd(qs, k, v, o, lse, do, seg):
        mask = ring_blocks.block_mask(diagonal, seg, seg)
        return kern.bwd(qs, k, v, mask, o, lse, do, None)

    bf = jnp.bfloat16
    args = [jnp.zeros((B, K, G, L, H), bf), jnp.zeros((B, K, L, H), bf),
            jnp.zeros((B, K, L, H), bf), jnp.zeros((B, K, G, L, H), jnp.float32),
            jnp.zeros((B, K, G, L, 1), jnp.float32), jnp.zeros((B, K, G, L, H), bf),
            jnp.zeros((B, L), jnp.int32)]
    types = _traced_types(bwd, *args)
    assert [t.shape for t in types] == [(B, K, G, L, H), (B, K, L, H), (B, K, L, H)]
    assert all(t.dtype == jnp.float32 for t in types)
    assert all(_varies(t) for t in types), types


@pytest.mark.jax011
def test_mxfp8_quantize_kernel_outputs_vary_like_their_input():
    with platform.cross_lowering():
        types = _traced_types(lambda x: mx.quantize_rowcol_pallas(x),
                              jnp.zeros((128, 128), jnp.bfloat16))
    assert len(types) == 4 and all(_varies(t) for t in types), types


def _cuda_lowered_step(dispatch: str) -> str:
    """The trainer's step for a data 2 x expert 4 plan, lowered for CUDA on this host as for
    an H100 (native ragged_all_to_all), as HLO text."""
    model_cfg, tx, schedule, _, state = host_state()
    cfg = make_cfg(2, 4, dispatch)
    model_cfg = with_capacity(model_cfg, cfg)
    with platform.cross_lowering():
        plan = plan_for(cfg, model_cfg)
        model_cfg = plan.model_cfg  # kernels resolved for the H100
        graphdef = abstract_model(model_cfg, plan.dispatcher)[0]
        shardings = plan.state_shardings(state, tx)
        step = plan.jit_train_step(make_train_step(graphdef, model_cfg, tx, schedule, 1,
                                                   parallel=plan), shardings)
        placed = plan.place_batch(batches(1)[0])
        args = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                            state, shardings)
        lowered = step.trace(args, jax.ShapeDtypeStruct(placed.shape, placed.dtype,
                                                        sharding=placed.sharding))
        return lowered.lower(lowering_platforms=("cuda",)).as_text(dialect="hlo")


def _cpu_lowered_step(dispatch: str) -> str:
    model_cfg, tx, schedule, _, state = host_state()
    cfg = make_cfg(2, 4, dispatch)
    model_cfg = with_capacity(model_cfg, cfg)
    plan = plan_for(cfg, model_cfg)
    graphdef = abstract_model(model_cfg, plan.dispatcher)[0]
    shardings = plan.state_shardings(state, tx)
    step = plan.jit_train_step(make_train_step(graphdef, model_cfg, tx, schedule, 1,
                                               parallel=plan), shardings)
    args = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                        state, shardings)
    placed = plan.place_batch(batches(1)[0])
    return step.lower(args, jax.ShapeDtypeStruct(placed.shape, placed.dtype,
                                                  sharding=placed.sharding)).as_text(dialect="hlo")


_OP = re.compile(r"=\s*(\w+)\[[^\]]*\]\S*\s+(all-reduce|all-to-all|all-gather|reduce-scatter"
                 r"|collective-permute|ragged-all-to-all)(?:-start)?\(")


def collective_counts(hlo: str) -> dict[str, int]:
    """Collectives of an HLO module by kind; all-to-alls also by element type."""
    counts: dict[str, int] = {}
    for m in _OP.finditer(hlo):
        dtype, kind = m.groups()
        key = f"{kind}:{'int' if dtype.startswith(('s', 'u')) else 'float'}" \
            if kind == "all-to-all" else kind
        counts[key] = counts.get(key, 0) + 1
    return counts


@pytest.mark.jax011
def test_native_ragged_step_has_the_emulated_steps_collectives():
    """Same config, same plan: the CUDA-lowered step (native ragged_all_to_all) against the
    CPU step (its emulation). Every collective but the exchanges themselves is the same,
    all-reduces included: the backward pass psums no receive or combine buffer (with
    device-invariant buffers it psummed both: 3 all-reduces more; the LM loss's sums, labels
    and positions share one all-reduce, objective.loss_parts). The rows
    move once per exchange either way (the primitive, or the emulation's float
    all_to_all); the integer all_to_alls are offsets (the emulation's forward sends the
    output offsets, the primitive's transpose rule exchanges them for the backward)."""
    native = collective_counts(_cuda_lowered_step("ragged"))
    emulated = collective_counts(_cpu_lowered_step("ragged"))
    exchanges = native.pop("ragged-all-to-all")
    assert exchanges == 4, native  # dispatch + combine, forward and backward
    assert emulated.pop("all-to-all:float") == exchanges
    assert native.pop("all-to-all:int") == 2 * (exchanges // 2)  # 2 per transposed exchange
    assert emulated.pop("all-to-all:int") == exchanges // 2  # 1 per forward exchange
    assert "all-to-all:float" not in native
    assert native == emulated, (native, emulated)
    assert native["all-reduce"] == 7
