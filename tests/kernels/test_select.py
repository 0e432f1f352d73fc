"""Choosing the grouped-matmul implementation by platform and config, and the config
fields of the kernels and MXFP8 (clear errors naming the field and the fix)."""

import jax
import jax.numpy as jnp
import pytest

from olmo_jax.errors import ConfigError
from olmo_jax.kernels import platform, resolve_gmm_impl
from olmo_jax.model.config import MoEConfig, TransformerConfig


def _gpu(cc):
    """Choices made for a GPU of capability cc (as for a mesh of such devices)."""
    return platform.targeting(platform.Target("gpu", cc, 132, abstract=True))


def test_auto_on_cpu_is_the_tiled_loop():
    assert jax.default_backend() == "cpu"
    assert platform.current_target() == platform.Target("cpu")
    assert resolve_gmm_impl("auto", jnp.bfloat16) == "tiled"
    assert resolve_gmm_impl("auto", jnp.float32, "mxfp8") == "einsum"  # no MXFP8 tiled loop
    assert resolve_gmm_impl("ragged_dot") == "ragged_dot"


def test_auto_on_cpu_in_float32_is_the_blas_kernel_and_blas_is_checked():
    assert resolve_gmm_impl("auto", jnp.float32) == "blas"  # g++ and numpy's OpenBLAS here
    assert resolve_gmm_impl("blas", jnp.float32) == "blas"
    with pytest.raises(ValueError, match="gmm_impl=blas runs float32.*model.dtype=float32"):
        resolve_gmm_impl("blas", jnp.bfloat16)
    with pytest.raises(ValueError, match="gmm_impl=blas has no MXFP8 version"):
        resolve_gmm_impl("blas", jnp.float32, "mxfp8")
    with _gpu((9, 0)), pytest.raises(ValueError, match="gmm_impl=blas runs on a CPU"):
        resolve_gmm_impl("blas", jnp.float32)


def test_tiled_with_mxfp8_is_refused_naming_the_fix():
    with pytest.raises(ValueError, match="gmm_impl=tiled has no MXFP8 version.*gmm_impl=auto"):
        resolve_gmm_impl("tiled", jnp.bfloat16, "mxfp8")


@pytest.mark.parametrize(
    "cc,dtype,precision,dims,want",
    [
        ((9, 0), jnp.bfloat16, "bf16", (64, 128), "pallas"),  # Hopper: the wgmma kernel
        ((9, 0), jnp.bfloat16, "bf16", (32, 128), "ragged_dot"),  # d_model off the 64 tiles
        ((9, 0), jnp.float32, "bf16", None, "ragged_dot"),  # the kernel takes 16-bit operands
        ((9, 0), jnp.bfloat16, "mxfp8", None, "pallas"),  # no block-scaled MMA on Hopper
        ((10, 0), jnp.bfloat16, "bf16", None, "ragged_dot"),  # Blackwell: no wgmma
        ((10, 0), jnp.bfloat16, "mxfp8", None, "einsum"),  # blocked layout: scaled_matmul
        ((10, 3), jnp.bfloat16, "mxfp8", None, "einsum"),
        ((8, 0), jnp.bfloat16, "bf16", None, "ragged_dot"),  # Ampere
    ],
)
def test_auto_on_gpus(cc, dtype, precision, dims, want):
    with _gpu(cc):
        assert resolve_gmm_impl("auto", dtype, precision, dims) == want


def test_the_target_comes_from_the_mesh_not_the_default_backend():
    """The CPU host lowering for GPUs: a plan over GPU devices resolves for them."""
    with _gpu((10, 0)):
        assert resolve_gmm_impl("auto", jnp.bfloat16, "mxfp8") == "einsum"
    assert resolve_gmm_impl("auto", jnp.bfloat16, "mxfp8") == "einsum"  # CPU again
    with _gpu((9, 0)):
        assert resolve_gmm_impl("auto", jnp.bfloat16) == "pallas"
    assert resolve_gmm_impl("auto", jnp.bfloat16) == "tiled"


def test_pallas_is_refused_where_it_cannot_run():
    with pytest.raises(ValueError, match=r"gmm_impl=pallas needs an NVIDIA Hopper.*target is cpu"):
        resolve_gmm_impl("pallas", jnp.bfloat16)
    with platform.interpret():
        assert resolve_gmm_impl("pallas", jnp.bfloat16) == "pallas"
        assert resolve_gmm_impl("pallas", jnp.float32) == "pallas"  # interpreted: f32 tests
    with _gpu((9, 0)):
        with pytest.raises(ValueError, match="model.dtype=bfloat16"):
            resolve_gmm_impl("pallas", jnp.float32)
        with pytest.raises(ValueError, match=r"model.d_model=96 .* blocks of 64"):
            resolve_gmm_impl("pallas", jnp.bfloat16, dims=(96, 128))
    with _gpu((10, 0)):
        with pytest.raises(ValueError, match=r"compute capability \(10, 0\)"):
            resolve_gmm_impl("pallas", jnp.bfloat16)


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
    from olmo_jax.model.attention import resolve_attention_impl

    assert resolve_attention_impl("auto", jnp.bfloat16) == "xla"  # CPU
    assert resolve_attention_impl("auto", jnp.float32) == "blas"  # CPU, float32: the FFI kernel
    assert resolve_attention_impl("blas", jnp.float32) == "blas"
    with pytest.raises(ValueError, match="attention_impl=blas .* model.dtype is bfloat16"):
        resolve_attention_impl("blas", jnp.bfloat16)
    with _gpu((9, 0)):
        with pytest.raises(ValueError, match="attention_impl=blas .* the target is a GPU"):
            resolve_attention_impl("blas", jnp.float32)
        assert resolve_attention_impl("auto", jnp.bfloat16) == "cudnn"
        assert resolve_attention_impl("auto", jnp.float32) == "xla"
        assert resolve_attention_impl("xla", jnp.bfloat16) == "xla"
        with pytest.raises(ValueError, match="attention_impl=cudnn .* model.dtype is float32"):
            resolve_attention_impl("cudnn", jnp.float32)
    with pytest.raises(ValueError, match="attention_impl=cudnn .* the target is cpu"):
        resolve_attention_impl("cudnn", jnp.bfloat16)
    with pytest.raises(ConfigError, match="model.attention_impl='flash'"):
        TransformerConfig(attention_impl="flash").validate()
