"""Sliding-window attention against OLMo-core's own (ai2-olmo-core in .venv-oracle, by
subprocess): the xla core and the blas kernel with window W equal OLMo-core's torch SDPA
backend built for window_size W, output and gradients, float32, grouped-query heads."""

from __future__ import annotations

import subprocess
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from olmo_jax.kernels import cpu_attention
from olmo_jax.model.attention import causal_attention

ROOT = Path(__file__).resolve().parents[2]
ORACLE_PY = ROOT / ".venv-oracle" / "bin" / "python"
pytestmark = pytest.mark.skipif(not ORACLE_PY.exists(), reason="no .venv-oracle (make oracle)")


def test_window_cores_match_olmo_core_torch_backend(tmp_path):
    B, T, N, K, H, W = 2, 256, 4, 2, 16, 50
    rng = np.random.default_rng(7)
    arrays = {n: rng.standard_normal(s).astype(np.float32) for n, s in
              [("q", (B, T, N, H)), ("k", (B, T, K, H)), ("v", (B, T, K, H)),
               ("probe", (B, T, N, H))]}
    np.savez(tmp_path / "in.npz", window=W, **arrays)
    subprocess.run([str(ORACLE_PY), str(Path(__file__).with_name("window_oracle.py")),
                    str(tmp_path / "in.npz"), str(tmp_path / "out.npz")], check=True,
                   cwd=tmp_path, timeout=300)
    ref = np.load(tmp_path / "out.npz")
    q, k, v, probe = (jnp.asarray(arrays[n]) for n in ("q", "k", "v", "probe"))
    for core in (causal_attention, cpu_attention.causal_attention):
        def loss(q, k, v, core=core):
            out = core(q, k, v, window=W)
            return jnp.sum(jnp.sin(out) * probe), out

        (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
        np.testing.assert_allclose(out, ref["out"], atol=1e-5, rtol=0)
        for g, name in zip(grads, ("dq", "dk", "dv"), strict=True):
            np.testing.assert_allclose(g, ref[name], atol=1e-5, rtol=0)
