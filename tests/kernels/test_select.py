"""Choosing the grouped-matmul implementation by platform and config, and the config
fields of the kernels and MXFP8 (clear errors naming the field and the fix)."""

import jax
import jax.numpy as jnp
import pytest

from olmo_jax.kernels import platform, resolve_gmm_impl
from olmo_jax.model.config import ConfigError, MoEConfig, TransformerConfig


def _fake_gpu(monkeypatch, cc):
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(platform, "gpu_capability", lambda: cc)


def test_auto_on_cpu_is_the_padded_einsum():
    assert jax.default_backend() == "cpu"
    assert resolve_gmm_impl("auto", jnp.bfloat16) == "einsum"
    assert resolve_gmm_impl("ragged_dot") == "ragged_dot"


@pytest.mark.parametrize(
    "cc,dtype,want",
    [
        ((9, 0), jnp.bfloat16, "pallas"),  # Hopper: the wgmma kernel
        ((9, 0), jnp.float32, "ragged_dot"),  # the kernel takes 16-bit operands only
        ((10, 0), jnp.bfloat16, "ragged_dot"),  # Blackwell: no wgmma
        ((8, 0), jnp.bfloat16, "ragged_dot"),  # Ampere
    ],
)
def test_auto_on_gpus(monkeypatch, cc, dtype, want):
    _fake_gpu(monkeypatch, cc)
    assert resolve_gmm_impl("auto", dtype) == want


def test_pallas_is_refused_where_it_cannot_run(monkeypatch):
    with pytest.raises(ValueError, match=r"gmm_impl=pallas needs an NVIDIA Hopper.*found cpu"):
        resolve_gmm_impl("pallas", jnp.bfloat16)
    with platform.interpret():
        assert resolve_gmm_impl("pallas", jnp.bfloat16) == "pallas"
        with pytest.raises(ValueError, match="model.dtype=bfloat16"):
            resolve_gmm_impl("pallas", jnp.float32)
    _fake_gpu(monkeypatch, (10, 0))
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
