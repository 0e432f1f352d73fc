"""The kernel choice (olmo_jax/kernels/select.py): model.moe.gmm_impl,
model.attention_impl, model.norm_impl and model.mxfp8_gemm_impl resolved for an explicit
target, once, by the parallel plan; the
config fields of the kernels and MXFP8 (clear errors naming the field and the fix); and
no model module choosing a kernel from a context variable."""

import ast
import dataclasses
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
import pytest

from olmo_jax import targets
from olmo_jax.errors import ConfigError
from olmo_jax.kernels import platform, select
from olmo_jax.kernels.select import (
    KernelChoice,
    resolve_attention_impl,
    resolve_gmm_impl,
    resolve_kernels,
    resolve_mxfp8_gemm_impl,
    resolve_norm_impl,
)
from olmo_jax.model.config import MoEConfig, TransformerConfig

CPU = platform.Target("cpu")


def _gpu(cc):
    """A GPU of capability cc (as the target of a mesh of such devices)."""
    return platform.Target("gpu", cc, 132, abstract=True)


def _kind(kind):
    g = targets.spec(kind)
    return platform.Target("gpu", g.capability, g.num_sms, abstract=True)


def test_auto_on_cpu_is_the_tiled_loop():
    assert resolve_gmm_impl("auto", CPU, jnp.bfloat16) == "tiled"
    assert resolve_gmm_impl("auto", CPU, jnp.float32, "mxfp8") == "einsum"  # no MXFP8 tiled loop
    assert resolve_gmm_impl("ragged_dot", CPU) == "ragged_dot"


def test_auto_on_cpu_in_float32_is_the_blas_kernel_and_blas_is_checked():
    assert resolve_gmm_impl("auto", CPU, jnp.float32) == "blas"  # g++ and numpy's OpenBLAS here
    assert resolve_gmm_impl("blas", CPU, jnp.float32) == "blas"
    with pytest.raises(ValueError, match="gmm_impl=blas runs float32.*model.dtype=float32"):
        resolve_gmm_impl("blas", CPU, jnp.bfloat16)
    with pytest.raises(ValueError, match="gmm_impl=blas has no MXFP8 version"):
        resolve_gmm_impl("blas", CPU, jnp.float32, "mxfp8")
    with pytest.raises(ValueError, match="gmm_impl=blas runs on a CPU"):
        resolve_gmm_impl("blas", _gpu((9, 0)), jnp.float32)


def test_tiled_with_mxfp8_is_refused_naming_the_fix():
    with pytest.raises(ValueError, match="gmm_impl=tiled has no MXFP8 version.*gmm_impl=auto"):
        resolve_gmm_impl("tiled", CPU, jnp.bfloat16, "mxfp8")


@pytest.mark.parametrize(
    "cc,dtype,precision,dims,want",
    [
        ((9, 0), jnp.bfloat16, "bf16", (64, 128), "pallas"),  # Hopper: the wgmma kernel
        ((9, 0), jnp.bfloat16, "bf16", (32, 128), "einsum"),  # d_model off the 64 tiles
        ((9, 0), jnp.float32, "bf16", None, "einsum"),  # the kernel takes 16-bit operands
        ((9, 0), jnp.bfloat16, "mxfp8", None, "pallas"),  # no block-scaled MMA on Hopper
        ((10, 0), jnp.bfloat16, "bf16", None, "pallas_tcgen05"),  # B200: the tcgen05 kernel
        ((10, 3), jnp.bfloat16, "bf16", (4096, 4096), "pallas_tcgen05"),  # B300
        ((10, 3), jnp.bfloat16, "bf16", (4096, 96), "einsum"),  # expert width off the tiles
        ((12, 0), jnp.bfloat16, "bf16", None, "einsum"),  # consumer Blackwell: no tcgen05
        ((10, 0), jnp.float32, "bf16", None, "einsum"),
        ((10, 0), jnp.bfloat16, "mxfp8", None, "einsum"),  # blocked layout: scaled_matmul
        ((10, 3), jnp.bfloat16, "mxfp8", None, "einsum"),
        ((8, 0), jnp.bfloat16, "bf16", None, "einsum"),  # Ampere
    ],
)
def test_auto_on_gpus(cc, dtype, precision, dims, want):
    """auto never picks ragged_dot on a GPU: XLA:GPU lowers it as a dense product over the
    expert groups (tests/gpu/test_compile_matrix.py sees it in the compiled step)."""
    assert resolve_gmm_impl("auto", _gpu(cc), dtype, precision, dims) == want
    # XLA:TPU has a grouped matmul of its own
    assert resolve_gmm_impl("auto", platform.Target("tpu"), dtype, precision, dims) == "ragged_dot"


def test_pallas_is_refused_where_it_cannot_run():
    with pytest.raises(ValueError, match=r"gmm_impl=pallas needs an NVIDIA Hopper.*target is cpu"):
        resolve_gmm_impl("pallas", CPU, jnp.bfloat16)
    # Pallas' GPU interpret mode (tests on a CPU) runs it, in float32 too
    assert resolve_gmm_impl("pallas", CPU, jnp.bfloat16, interpret=True) == "pallas"
    assert resolve_gmm_impl("pallas", CPU, jnp.float32, interpret=True) == "pallas"
    with pytest.raises(ValueError, match="model.dtype=bfloat16"):
        resolve_gmm_impl("pallas", _gpu((9, 0)), jnp.float32)
    with pytest.raises(ValueError, match=r"model.d_model=96 .* blocks of 64"):
        resolve_gmm_impl("pallas", _gpu((9, 0)), jnp.bfloat16, dims=(96, 128))
    with pytest.raises(ValueError, match=r"compute capability \(10, 0\)"):
        resolve_gmm_impl("pallas", _gpu((10, 0)), jnp.bfloat16)


def test_pallas_tcgen05_is_refused_where_it_cannot_run():
    assert resolve_gmm_impl("pallas_tcgen05", _gpu((10, 3)), jnp.bfloat16) == "pallas_tcgen05"
    with pytest.raises(ValueError, match=r"gmm_impl=pallas_tcgen05 needs an NVIDIA B200/B300"
                                         r".*capability \(9, 0\)"):
        resolve_gmm_impl("pallas_tcgen05", _gpu((9, 0)), jnp.bfloat16)
    with pytest.raises(ValueError, match="capability \\(12, 0\\)"):
        resolve_gmm_impl("pallas_tcgen05", _gpu((12, 0)), jnp.bfloat16)
    assert resolve_gmm_impl("pallas_tcgen05", CPU, jnp.float32, interpret=True) == "pallas_tcgen05"
    with pytest.raises(ValueError, match="model.dtype=bfloat16"):
        resolve_gmm_impl("pallas_tcgen05", _gpu((10, 0)), jnp.float32)
    with pytest.raises(ValueError, match=r"model.moe.expert_hidden=96 .* blocks of 64"):
        resolve_gmm_impl("pallas_tcgen05", _gpu((10, 0)), jnp.bfloat16, dims=(128, 96))
    with pytest.raises(ValueError, match="pallas_tcgen05 has no MXFP8 version.*gmm_impl=auto"):
        resolve_gmm_impl("pallas_tcgen05", _gpu((10, 0)), jnp.bfloat16, "mxfp8")


def test_config_fields_are_validated():
    MoEConfig(gmm_impl="pallas", precision="mxfp8", expert_hidden=64).validate()
    with pytest.raises(ConfigError, match="model.moe.gmm_impl"):
        MoEConfig(gmm_impl="triton").validate()
    with pytest.raises(ConfigError, match="model.moe.precision='fp8': choose bf16 or mxfp8"):
        MoEConfig(precision="fp8").validate()
    with pytest.raises(ConfigError, match="expert_hidden=48 must be a multiple of 32"):
        MoEConfig(precision="mxfp8", expert_hidden=48).validate()
    with pytest.raises(ConfigError, match="attention_precision"):
        TransformerConfig(d_model=64, attention_precision="fp4").validate()
    with pytest.raises(ConfigError, match=r"multiples of 32"):
        TransformerConfig(d_model=48, n_heads=3, attention_precision="mxfp8").validate()
    with pytest.raises(ConfigError, match="d_model=48 must be a multiple of 32"):
        TransformerConfig(d_model=48, n_heads=3, moe=MoEConfig(precision="mxfp8")).validate()


def test_attention_impl_is_chosen_for_the_target():
    assert resolve_attention_impl("auto", CPU, jnp.bfloat16) == "xla"
    assert resolve_attention_impl("auto", CPU, jnp.float32) == "blas"  # float32: the FFI kernel
    assert resolve_attention_impl("blas", CPU, jnp.float32) == "blas"
    with pytest.raises(ValueError, match="attention_impl=blas .* model.dtype is bfloat16"):
        resolve_attention_impl("blas", CPU, jnp.bfloat16)
    h100 = _gpu((9, 0))
    with pytest.raises(ValueError, match="attention_impl=blas .* the target is a GPU"):
        resolve_attention_impl("blas", h100, jnp.float32)
    assert resolve_attention_impl("auto", h100, jnp.bfloat16) == "cudnn"
    assert resolve_attention_impl("auto", h100, jnp.float32) == "xla"
    assert resolve_attention_impl("xla", h100, jnp.bfloat16) == "xla"
    with pytest.raises(ValueError, match="attention_impl=cudnn .* model.dtype is float32"):
        resolve_attention_impl("cudnn", h100, jnp.float32)
    with pytest.raises(ValueError, match="attention_impl=cudnn .* the target is cpu"):
        resolve_attention_impl("cudnn", CPU, jnp.bfloat16)
    with pytest.raises(ConfigError, match="model.attention_impl='flash'"):
        TransformerConfig(attention_impl="flash").validate()


def test_norm_impl_is_chosen_for_the_target():
    assert resolve_norm_impl("auto", CPU) == "blas"  # the CPU FFI library builds here
    assert resolve_norm_impl("auto", _kind("h200")) == "xla"
    assert resolve_norm_impl("xla", CPU) == "xla"
    with pytest.raises(ValueError, match=r"model.norm_impl=blas .* the target is a GPU.*norm_impl=auto"):
        resolve_norm_impl("blas", _kind("b300"))
    with pytest.raises(ConfigError, match="model.norm_impl='fused': choose one of auto, blas, xla"):
        TransformerConfig(norm_impl="fused").validate()


def test_mxfp8_gemm_impl_is_chosen_for_the_target():
    assert resolve_mxfp8_gemm_impl("auto", CPU) == "dequantize"
    assert resolve_mxfp8_gemm_impl("auto", _kind("h200")) == "dequantize"  # no block-scaled MMA
    assert resolve_mxfp8_gemm_impl("auto", _kind("b300")) == "scaled_matmul"
    assert resolve_mxfp8_gemm_impl("auto", _gpu((10, 3))) == "scaled_matmul"
    assert resolve_mxfp8_gemm_impl("dequantize", _kind("b300")) == "dequantize"
    with pytest.raises(ValueError, match=r"mxfp8_gemm_impl=scaled_matmul .* compute capability \(9, 0\)"):
        resolve_mxfp8_gemm_impl("scaled_matmul", _kind("h200"))
    assert resolve_mxfp8_gemm_impl("scaled_matmul", CPU, used=False) == "scaled_matmul"
    with pytest.raises(ConfigError, match="model.mxfp8_gemm_impl='cublas'"):
        TransformerConfig(mxfp8_gemm_impl="cublas").validate()


def _model(dtype="bfloat16", precision="bf16", gmm="auto", attention="auto", d_model=128,
           norm="auto", mxfp8_gemm="auto"):
    return TransformerConfig(d_model=d_model, n_heads=4, n_layers=2, dtype=dtype,
                             attention_impl=attention, norm_impl=norm, mxfp8_gemm_impl=mxfp8_gemm,
                             moe=MoEConfig(num_experts=8, top_k=2, expert_hidden=256,
                                           gmm_impl=gmm, precision=precision))


@pytest.mark.parametrize(
    "kind,dtype,precision,want",
    [
        ("cpu", "float32", "bf16", KernelChoice("blas", "blas", "none", "blas", "dequantize")),
        ("cpu", "bfloat16", "bf16", KernelChoice("tiled", "xla", "tiles", "blas", "dequantize")),
        ("cpu", "float32", "mxfp8", KernelChoice("einsum", "blas", "blocks", "blas", "dequantize")),
        ("h200", "bfloat16", "bf16", KernelChoice("pallas", "cudnn", "none", "xla", "dequantize")),
        ("h200", "float32", "bf16", KernelChoice("einsum", "xla", "blocks", "xla", "dequantize")),
        ("h200", "bfloat16", "mxfp8", KernelChoice("pallas", "cudnn", "none", "xla", "dequantize")),
        ("b300", "bfloat16", "bf16", KernelChoice("pallas_tcgen05", "cudnn", "none", "xla",
                                                  "scaled_matmul")),
        ("b300", "bfloat16", "mxfp8", KernelChoice("einsum", "cudnn", "blocks", "xla",
                                                   "scaled_matmul")),
    ],
)
def test_the_table_for_cpu_h200_and_b300(kind, dtype, precision, want):
    """resolve_kernels: every choice and the buffer layout they need, for one target."""
    target = CPU if kind == "cpu" else _kind(kind)
    assert resolve_kernels(_model(dtype, precision), target) == want


def test_a_choice_applied_to_a_model_config_names_the_kernels():
    cfg = _model()
    resolved = KernelChoice("pallas", "cudnn", "none", "xla", "dequantize").apply(cfg)
    assert (resolved.moe.gmm_impl, resolved.attention_impl, resolved.norm_impl,
            resolved.mxfp8_gemm_impl) == ("pallas", "cudnn", "xla", "dequantize")
    assert dataclasses.replace(resolved, attention_impl="auto", norm_impl="auto",
                               mxfp8_gemm_impl="auto",
                               moe=dataclasses.replace(resolved.moe, gmm_impl="auto")) == cfg
    # the resolved config resolves to itself on the same target
    assert resolve_kernels(resolved, _kind("h200")) == resolve_kernels(cfg, _kind("h200"))


def test_dense_models_refuse_no_expert_kernel():
    """Without MoE layers model.moe.gmm_impl runs nowhere: nothing to refuse."""
    dense = dataclasses.replace(_model(gmm="pallas"), n_dense_layers=2)
    assert dense.n_moe_layers == 0
    assert resolve_kernels(dense, CPU).gmm == "pallas"
    with pytest.raises(ValueError, match="gmm_impl=pallas"):
        resolve_kernels(_model(gmm="pallas"), CPU)


def test_scaled_matmul_is_refused_only_where_a_gemm_runs_in_mxfp8():
    """model.mxfp8_gemm_impl=scaled_matmul on a Hopper: kept while no GEMM is MXFP8,
    refused (naming the field) when the experts or the attention projections are."""
    assert resolve_kernels(_model(mxfp8_gemm="scaled_matmul"), _kind("h200")).mxfp8_gemm == \
        "scaled_matmul"
    with pytest.raises(ValueError, match="model.mxfp8_gemm_impl=scaled_matmul"):
        resolve_kernels(_model(precision="mxfp8", mxfp8_gemm="scaled_matmul"), _kind("h200"))
    attn = dataclasses.replace(_model(mxfp8_gemm="scaled_matmul"), attention_precision="mxfp8")
    with pytest.raises(ValueError, match="model.mxfp8_gemm_impl=scaled_matmul"):
        resolve_kernels(attn, _kind("h200"))


def _run_cfg(data, expert):
    from olmo_jax.config import default_config

    c = default_config()
    c.parallel.data, c.parallel.expert, c.parallel.dispatch = data, expert, "ragged"
    c.trainer.global_batch_size, c.trainer.grad_accum = 8, 1
    return c


def _build_plan(run_cfg, model_cfg, devices):
    from tests.sections import plan_for

    return plan_for(run_cfg, model_cfg, devices=devices)


def test_the_plan_resolves_the_kernels_once_for_its_mesh():
    """build_plan stores the choice for the mesh's devices (8 fake CPUs here) and the model
    config the steps are built with; a CPU host lowering for CUDA plans for an H100."""
    model_cfg = dataclasses.replace(_model("float32"), moe=dataclasses.replace(
        _model().moe, capacity_factor=0.0))
    plan = _build_plan(_run_cfg(2, 4), model_cfg, jax.devices()[:8])
    assert plan.kernels == resolve_kernels(model_cfg, CPU) == KernelChoice(
        "blas", "blas", "none", "blas", "dequantize")
    assert plan.model_cfg == plan.kernels.apply(model_cfg)
    assert (plan.model_cfg.moe.gmm_impl, plan.model_cfg.attention_impl,
            plan.model_cfg.norm_impl, plan.model_cfg.mxfp8_gemm_impl) == (
        "blas", "blas", "blas", "dequantize")

    with platform.cross_lowering():
        gpu_plan = _build_plan(_run_cfg(1, 1), _model("bfloat16"), jax.devices()[:1])
    assert gpu_plan.kernels == KernelChoice("pallas", "cudnn", "none", "xla", "dequantize")
    assert gpu_plan.model_cfg.moe.gmm_impl == "pallas"


def test_the_plan_refuses_an_explicit_kernel_naming_the_field():
    with pytest.raises(ConfigError, match=r"model.moe.gmm_impl=pallas needs an NVIDIA Hopper"):
        _build_plan(_run_cfg(1, 1), _model(gmm="pallas"), jax.devices()[:1])
    with pytest.raises(ConfigError, match=r"model.attention_impl=cudnn"):
        _build_plan(_run_cfg(1, 1), _model(attention="cudnn"), jax.devices()[:1])
    with pytest.raises(ConfigError, match=r"model.mxfp8_gemm_impl=scaled_matmul"):
        _build_plan(_run_cfg(1, 1), _model(precision="mxfp8", mxfp8_gemm="scaled_matmul"),
                    jax.devices()[:1])


def test_a_model_without_a_plan_resolves_auto_for_its_default_device():
    from olmo_jax.model.attention import attention_impl
    from olmo_jax.model.moe.layer import gmm_impl
    from olmo_jax.model.mxfp8_gemm import gemm_impl
    from olmo_jax.model.norm import norm_impl

    assert select.local_target() == platform.target_of(jax.devices()[:1]) == CPU
    assert attention_impl("auto", jnp.float32) == resolve_attention_impl("auto", CPU, jnp.float32)
    assert attention_impl("cudnn", jnp.float32) == "cudnn"  # a resolved name is used as given
    moe = MoEConfig(num_experts=8, top_k=2, expert_hidden=256)
    assert gmm_impl(moe, jnp.bfloat16, 128) == "tiled"
    assert gmm_impl(dataclasses.replace(moe, gmm_impl="einsum"), jnp.bfloat16, 128) == "einsum"
    assert norm_impl("auto") == resolve_norm_impl("auto", CPU) == "blas"
    assert norm_impl("xla") == "xla"
    assert gemm_impl("auto") == "dequantize"
    assert gemm_impl("scaled_matmul") == "scaled_matmul"
    # the context the parallel plan traces its steps in does not change the model's choice
    with platform.targeting(_kind("b300")):
        assert gmm_impl(moe, jnp.bfloat16, 128) == "tiled"
        assert attention_impl("auto", jnp.bfloat16) == "xla"
        assert norm_impl("auto") == "blas"
        assert gemm_impl("auto") == "dequantize"


# What reads the target from a context variable (olmo_jax/kernels/platform.py).
_CONTEXT_READS = {"current_target", "targeting", "gpu_capability", "pallas_gmm_supported",
                  "block_scaled_mma_supported", "ContextVar", "contextvars", "default_backend"}


def _names(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            out.add(node.attr)
        elif isinstance(node, ast.Name):
            out.add(node.id)
        elif isinstance(node, ast.alias):
            out.add(node.name.split(".")[-1])
    return out


def test_no_model_module_chooses_a_kernel_from_a_context_variable():
    root = Path(select.__file__).resolve().parents[1] / "model"
    found = {}
    for path in sorted(root.rglob("*.py")):
        hits = _names(path) & _CONTEXT_READS
        if hits:
            found[str(path.relative_to(root))] = sorted(hits)
    assert not found, f"model modules reading the target from a context variable: {found}"
    for path in sorted(root.rglob("*.py")):  # the model imports no platform at all
        assert "platform" not in _names(path), path


class _Weights(NamedTuple):
    w_gate_EDF: jax.Array
    w_up_EDF: jax.Array
    w_down_EFD: jax.Array

    def weights(self, dtype):
        return tuple(w.astype(dtype) for w in self)


def test_the_platform_context_does_not_choose_the_models_grouped_matmul():
    """The MoE layer traced inside the context the plan traces its steps in, for a B300:
    the context sets what kernels are lowered for, never which one runs, so gmm_impl=auto
    in a model without a plan stays the default device's (the tiled loop on this CPU, in
    bfloat16), not the B300's ragged_dot."""
    from olmo_jax.model.moe.layer import routed_experts
    from olmo_jax.model.moe.router import Routing

    S, D, F, E, k = 16, 64, 128, 4, 2
    moe = MoEConfig(num_experts=E, top_k=k, expert_hidden=F)
    idx_Sk = (jnp.arange(S * k).reshape(S, k) % E).astype(jnp.int32)
    w_Sk = jnp.full((S, k), 0.5, jnp.float32)
    weights = _Weights(jnp.zeros((E, D, F)), jnp.zeros((E, D, F)), jnp.zeros((E, F, D)))

    def run(x_SD):
        return routed_experts(x_SD, Routing(None, None, w_Sk, idx_Sk), weights, moe, jnp.bfloat16)

    x_SD = jnp.zeros((S, D), jnp.bfloat16)
    with platform.targeting(_kind("b300")):
        in_context = str(jax.make_jaxpr(run)(x_SD))
    assert "ragged_dot" not in in_context
    assert in_context == str(jax.make_jaxpr(run)(x_SD))
