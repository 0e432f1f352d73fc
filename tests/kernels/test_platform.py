"""platform.targeting answers jax's own cuDNN capability checks for the GPU being
compiled for: jax's cuDNN attention asks its default backend's first GPU (Hopper or later
for document masking's packed layout), and a deviceless compile on a CPU host has none,
so without this a doc-masked step for abstract B300s is refused ("Packed layout requires
a GPU with at least Hopper architecture") while the same step compiles on the GPU."""

from __future__ import annotations

import jax
import pytest
from jax._src.cudnn import fused_attention_stablehlo as fused

from olmo_jax.kernels import platform

pytestmark = pytest.mark.jax011  # jax's private cuDNN module: the image's jax has its own

B300 = platform.Target("gpu", (10, 3), 148, abstract=True)
A100 = platform.Target("gpu", (8, 0), 108, abstract=True)


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="jax answers from its own GPU here")
def test_cudnn_capability_checks_answer_for_the_target_while_tracing():
    assert not fused.check_compute_capability("9.0")  # a CPU host: "no GPU"
    with platform.targeting(B300):
        assert fused.check_compute_capability("9.0") and fused.check_compute_capability("10.3")
        assert not fused.check_compute_capability("12.0")
        assert fused.is_cuda_compute_capability_equal("10.3")
        with platform.targeting(A100):  # nested: the inner target, then the outer again
            assert not fused.check_compute_capability("9.0")
        assert fused.check_compute_capability("9.0")
    assert not fused.check_compute_capability("9.0")  # restored
    with platform.targeting(platform.Target("cpu")):
        assert not fused.check_compute_capability("9.0")
