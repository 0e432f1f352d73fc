"""The LM loss against OLMo-core's (`cross_entropy_loss` with its z-loss, labels from
`get_labels`, the DDP train module's denominator) and the router losses with that
denominator (OLMo-core's `loss_div_factor`), by subprocess in .venv-oracle."""

from __future__ import annotations

import subprocess
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from olmo_jax.labels import FILTERED, NO_LABEL
from olmo_jax.model import MoEConfig, TransformerConfig
from olmo_jax.model.moe.losses import router_stats
from olmo_jax.model.moe.router import route
from olmo_jax.objective import loss_parts, total_loss

ROOT = Path(__file__).resolve().parents[2]
ORACLE_PY = ROOT / ".venv-oracle" / "bin" / "python"
pytestmark = pytest.mark.skipif(not ORACLE_PY.exists(), reason="no .venv-oracle (make oracle)")


def test_cross_entropy_z_loss_and_denominator_match_olmo_core(tmp_path):
    rng = np.random.default_rng(0)
    B, S, V, coef = 4, 16, 50, 1e-4
    logits_BSV = (3 * rng.normal(size=(B, S, V))).astype(np.float32)
    input_ids_BS = rng.integers(0, V, (B, S)).astype(np.int32)
    kept_B = np.array([True, False, True, True])  # instance 1 failed the repetition filter
    E, k = 8, 2
    router_logits_SE = (2 * rng.normal(size=(B * S, E))).astype(np.float32)
    r = route(jnp.asarray(router_logits_SE), top_k=k)
    np.savez(tmp_path / "in.npz", logits=logits_BSV, input_ids=input_ids_BS,
             instance_mask=kept_B, z_loss_multiplier=coef,
             router_logits=router_logits_SE.reshape(B, S, E),
             scores=np.asarray(r.probs_SE).reshape(B, S, E),
             expert_ids=np.asarray(r.idx_Sk).reshape(B, S, k))
    subprocess.run([str(ORACLE_PY), str(Path(__file__).with_name("loss_oracle.py")),
                    str(tmp_path / "in.npz"), str(tmp_path / "out.npz")], check=True, timeout=300)
    want = np.load(tmp_path / "out.npz")

    # olmo_jax's batch row: the instance's tokens, then its sentinel (olmo_jax/labels.py).
    rows_BL = np.concatenate([input_ids_BS, np.where(kept_B, NO_LABEL, FILTERED)[:, None]], 1)
    cfg = TransformerConfig(vocab_size=V, d_model=8, n_layers=2, n_heads=1, lm_z_loss_coef=coef,
                            n_dense_layers=1, moe=MoEConfig(num_experts=E, top_k=k))
    stats = router_stats(r.probs_SE, r.logits_SE, r.idx_Sk, E, rows=B)
    stacked = type(stats)(*(jnp.stack([f]) for f in stats))  # one MoE block
    parts = loss_parts(jnp.asarray(logits_BSV), jnp.asarray(rows_BL[:, 1:]), stacked, cfg)
    assert float(parts.n_tokens) == int(want["denominator"]) == B * (S - 1)
    ce = float(parts.ce_sum / parts.n_tokens)
    z = coef * float(parts.lm_z_sum / parts.n_tokens)
    np.testing.assert_allclose(ce, float(want["ce"]), rtol=1e-6)
    np.testing.assert_allclose(z, float(want["z"]), rtol=1e-6)
    # The router losses divided by the label count, as OLMo-core's train module has them.
    np.testing.assert_allclose(float(parts.lb_loss), float(want["lb"]), rtol=1e-6)
    np.testing.assert_allclose(float(parts.z_loss), float(want["router_z"]), rtol=1e-6)
    np.testing.assert_allclose(
        float(total_loss(parts, cfg)),
        ce + z + cfg.moe.lb_loss_coef * float(want["lb"]) + cfg.moe.z_loss_coef * float(want["router_z"]),
        rtol=1e-6)
