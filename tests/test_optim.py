"""Learning-rate schedules: warmup, cosine floor, WSD plateau and decay; which weights
AdamW decays."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from olmo_jax.optim import build_optimizer, lr_schedule
from olmo_jax.optim.config import OptimConfig


def test_cosine_warmup_and_floor():
    s = lr_schedule("cosine", 1.0, 100, 10, min_lr_ratio=0.1)
    assert s(0) == pytest.approx(0.1)
    assert s(10) == pytest.approx(1.0)
    assert s(55) == pytest.approx(0.55, abs=1e-6)  # halfway through the cosine
    assert s(100) == pytest.approx(0.1)


def test_wsd_is_flat_then_decays_linearly():
    s = lr_schedule("wsd", 2.0, 110, 10, min_lr_ratio=0.0, decay_fraction=0.2)
    assert [float(s(i)) for i in (10, 50, 89)] == [2.0, 2.0, 2.0]
    assert float(s(100)) == pytest.approx(1.0)
    assert float(s(110)) == pytest.approx(0.0)
    assert np.all(np.diff([float(s(i)) for i in range(90, 111)]) <= 0)


@pytest.mark.parametrize("decay_embeddings", [True, False])
def test_weight_decay_skips_norms_and_optionally_the_embedding(decay_embeddings):
    """One AdamW step with zero gradients moves only the decayed weights: w -= lr * wd * w."""
    o = dataclasses.replace(OptimConfig(), lr=0.5, warmup_steps=0, schedule="constant",
                            weight_decay=0.1, decay_embeddings=decay_embeddings)
    tx, _ = build_optimizer(o, total_steps=10)
    params = {"embedding": jnp.ones((4, 3)), "lm_head": jnp.ones((3, 4)), "final_norm": jnp.ones(3)}
    updates, _ = tx.update(jax.tree.map(jnp.zeros_like, params), tx.init(params), params)
    moved = {k: float(jnp.abs(v).max()) for k, v in updates.items()}
    assert moved["lm_head"] == pytest.approx(0.05) and moved["final_norm"] == 0.0
    assert moved["embedding"] == (pytest.approx(0.05) if decay_embeddings else 0.0)

