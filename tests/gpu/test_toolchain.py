"""The trimmed CUDA wheel set of .venv-gpu (tools/requirements/gpu.txt) compiles each kind
of program the GPU paths use, for abstract GPUs: a shard_map all_to_all and
ragged_all_to_all over 8 GPUs, cuDNN fused attention forward + backward, Pallas Mosaic GPU
kernels (a plain one, the Hopper grouped matmul and the Blackwell one for B200 and B300),
and jax.nn.scaled_matmul as cuDNN's
block-scaled GEMM on Blackwell. Each is found in the compiled HLO by the helpers of
olmo_jax.planner.gpu_hlo, which this also checks."""

import functools
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from olmo_jax import targets
from olmo_jax.kernels import grouped_matmul_tcgen05, platform
from olmo_jax.kernels.grouped_matmul import grouped_matmul
from olmo_jax.planner import gpu_hlo
from tests import allocator


def _spec(mesh, shape, dtype, spec=None):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec or P()))


@pytest.fixture(scope="module")
def mesh8():
    return targets.make_mesh("h200", (8,), ("x",))


def test_all_to_all_and_ragged_all_to_all(mesh8):
    a2a = jax.shard_map(lambda x: jax.lax.all_to_all(x, "x", 0, 0, tiled=True),
                        mesh=mesh8, in_specs=P("x"), out_specs=P("x"))
    x = _spec(mesh8, (64, 16), jnp.bfloat16, P("x"))
    counts = gpu_hlo.collective_counts(jax.jit(a2a).lower(x).compile())
    assert counts["all-to-all"] == 1 and counts["ragged-all-to-all"] == 0

    def ragged(x, out, io, ss, oo, rs):
        return jax.lax.ragged_all_to_all(x, out, io, ss, oo, rs, axis_name="x")

    f = jax.shard_map(ragged, mesh=mesh8, in_specs=(P("x"),) * 6, out_specs=P("x"))
    sizes = _spec(mesh8, (64,), jnp.int32, P("x"))
    counts = gpu_hlo.collective_counts(jax.jit(f).lower(x, x, sizes, sizes, sizes, sizes).compile())
    assert counts["ragged-all-to-all"] == 1


# A matmul and an elementwise fusion for one abstract H200: LLVM's PTX for each kernel.
_ASSEMBLE = textwrap.dedent("""
    import os
    os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
    import jax, jax.numpy as jnp
    from olmo_jax import targets
    x = jax.ShapeDtypeStruct((256, 256), jnp.float32,
                             sharding=jax.sharding.SingleDeviceSharding(targets.abstract_devices("h200", 1)[0]))
    jax.jit(lambda a, b: jnp.tanh(a @ b) + 1.0).lower(x, x).compile()
    print("compiled")
""")


def test_ptx_is_assembled_in_process_by_nvjitlink(tmp_path):
    """XLA:GPU turns each kernel's PTX into GPU code in the compiling process, with nvJitLink
    (the nvidia-nvjitlink-cu12 wheel of tools/requirements/gpu.txt), as a jax[cuda12]
    install does: it runs no ptxas. Without the wheel XLA runs a ptxas binary from the
    machine's PATH or CUDA folder for every kernel (one process each: 161 for an 8-GPU
    matrix cell), so the compiles depended on the machine's CUDA toolkit and spent a fifth
    of the GPU stages' CPU time in the kernel. Here a ptxas put first on the PATH records
    that it ran and fails."""
    fake = tmp_path / "bin"
    fake.mkdir()
    marker = tmp_path / "ptxas-ran"
    (fake / "ptxas").write_text(f"#!/bin/sh\ntouch {marker}\nexit 1\n")
    (fake / "ptxas").chmod(0o755)
    env = {**os.environ, "PATH": f"{fake}{os.pathsep}{os.environ['PATH']}"}
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run([sys.executable, "-c", _ASSEMBLE], env=env, capture_output=True,
                          text=True, timeout=300)
    assert not marker.exists(), "XLA:GPU ran ptxas: is nvidia-nvjitlink-cu12 installed?"
    assert proc.returncode == 0 and "compiled" in proc.stdout, proc.stderr[-3000:]


def test_make_compiles_on_jemalloc():
    """`make test-gpu`'s processes allocate with jemalloc (tests/allocator.py), as the CPU
    stages' do: the Hopper stage took 2:35 instead of 3:14 with it."""
    if reason := allocator.skip_reason():
        pytest.skip(reason)
    assert allocator.preloaded(), f"{allocator.jemalloc_library()} is not preloaded (TEST_MALLOC)"


def test_cudnn_attention_forward_and_backward(mesh8):
    def loss(q, k, v):
        o = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
        return o.astype(jnp.float32).sum()

    q = _spec(mesh8, (2, 128, 4, 64), jnp.bfloat16)
    compiled = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))).lower(q, q, q).compile()
    calls = {c.target for c in gpu_hlo.cudnn_attention(compiled)}
    assert calls == {"__cudnn$fmhaSoftmax", "__cudnn$fmhaSoftmaxBackward"}, calls


def test_pallas_mosaic_gpu_kernels(mesh8):
    @functools.partial(plgpu.kernel, out_type=jax.ShapeDtypeStruct((128,), jnp.float32))
    def add_one(x_ref, o_ref):
        o_ref[...] = x_ref[...] + 1.0

    plain = gpu_hlo.mosaic_gpu_kernels(
        jax.jit(add_one).lower(_spec(mesh8, (128,), jnp.float32)).compile())
    assert [(k.wgmma, k.tcgen05) for k in plain] == [(False, False)]

    M, K, N, G, R = 256, 128, 128, 8, 96  # R: the rows routed at balanced routing

    def loss(x, w, gs):
        return grouped_matmul(x, w, gs, priced_rows=R).astype(jnp.float32).sum()

    args = (_spec(mesh8, (M, K), jnp.bfloat16), _spec(mesh8, (G, K, N), jnp.bfloat16),
            _spec(mesh8, (G,), jnp.int32))
    with platform.cross_lowering():  # the kernel's own platform check reads jax.devices()
        compiled = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(*args).compile()
    kernels = gpu_hlo.mosaic_gpu_kernels(compiled)
    assert len(kernels) == 3 and all(k.wgmma and not k.tcgen05 for k in kernels)  # fwd, dx, dw
    # Each declares its FLOPs over the R priced rows of the M-row buffer.
    module = gpu_hlo._module(compiled)
    flops = [gpu_hlo.custom_call_dot_flops(module, module.instruction(k.name)) for k in kernels]
    assert flops == [2.0 * R * K * N] * 3, flops


@pytest.mark.parametrize("kind", ["b200", "b300"])
def test_blackwell_grouped_matmul_compiles_to_tcgen05_kernels(kind):
    """The tcgen05 kernels (forward, dx, dw) lowered through Mosaic GPU and assembled by
    ptxas for sm_100a / sm_103a at bf16 shapes with full 128-row tiles and a 4-stage K
    pipeline (the tgmm's pipeline cut to fit SMEM), each declaring its FLOPs: over the
    whole buffer on a B200, over the priced rows (balanced routing's) on a B300."""
    mesh = targets.make_mesh(kind, (1,), ("x",))
    M, K, N, G = 512, 256, 256, 4
    R = {"b200": 0, "b300": 320}[kind]

    def loss(x, w, gs):
        y = grouped_matmul_tcgen05.grouped_matmul(x, w, gs, priced_rows=R)
        return y.astype(jnp.float32).sum()

    args = (_spec(mesh, (M, K), jnp.bfloat16), _spec(mesh, (G, K, N), jnp.bfloat16),
            _spec(mesh, (G,), jnp.int32))
    with platform.targeting(platform.target_of(mesh.devices)):
        compiled = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(*args).compile()
    kernels = gpu_hlo.mosaic_gpu_kernels(compiled)
    assert len(kernels) == 3 and all(k.tcgen05 and not k.wgmma for k in kernels), kernels
    module = gpu_hlo._module(compiled)
    flops = [gpu_hlo.custom_call_dot_flops(module, module.instruction(k.name)) for k in kernels]
    assert flops == [2.0 * (R or M) * K * N] * 3, flops


@pytest.mark.parametrize("kind, cudnn", [("b300", 1), ("b200", 1), ("h200", 0)])
def test_scaled_matmul_is_cudnn_block_scaled_on_blackwell(kind, cudnn):
    mesh = targets.make_mesh(kind, (1,), ("x",))
    a = _spec(mesh, (1, 256, 256), jnp.float8_e4m3fn)
    s = _spec(mesh, (1, 256, 8), jnp.float8_e8m0fnu)
    compiled = jax.jit(jax.nn.scaled_matmul).lower(a, a, s, s).compile()
    assert gpu_hlo.block_scaled_dots(compiled) == cudnn
    assert not gpu_hlo.custom_calls(compiled, gpu_hlo.UNREWRITTEN_BLOCK_SCALED_DOT)
