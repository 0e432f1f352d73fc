"""Router losses and load metrics against hand-computed values: OLMo-core per-layer vs
Hugging Face pooled LB loss, global vs local (per data-parallel shard) granularity,
z-loss, imbalance per expert and per expert-parallel rank."""

import jax.numpy as jnp
import numpy as np
import pytest

from olmo_jax.model.moe.losses import (
    imbalance,
    load_balancing_loss,
    load_balancing_per_layer,
    rank_counts,
    router_stats,
    shard_sums,
    z_loss,
    z_loss_per_layer,
)
from olmo_jax.model.moe.router import route


def _stack(*stats):
    return type(stats[0])(*(jnp.stack(f) for f in zip(*stats, strict=True)))


def _stats(probs, idx, rows, shift=None):
    """RouterStats of tokens with the given probabilities (logits = log p + shift, so each
    token's logsumexp is its shift) and chosen experts."""
    probs = jnp.asarray(probs, jnp.float32)
    shift = jnp.zeros(len(probs)) if shift is None else jnp.asarray(shift, jnp.float32)
    logits = jnp.log(probs) + shift[:, None]
    return router_stats(probs, logits, jnp.asarray(idx, jnp.int32), probs.shape[1], rows=rows)


# Layer A: 2 rows of 2 tokens, 2 experts, top-1. Row 0 goes to expert 0, row 1 to expert 1.
A = _stats([[0.9, 0.1], [0.8, 0.2], [0.3, 0.7], [0.4, 0.6]], [[0], [0], [1], [1]], rows=2,
           shift=[0.0, 1.0, 2.0, 3.0])
# Layer B: every token to expert 0 with probabilities 0.5 / 0.5.
B = _stats([[0.5, 0.5]] * 4, [[0]] * 4, rows=2)


def test_router_stats_keep_rows_apart():
    np.testing.assert_array_equal(A.counts_LBE, [[2, 0], [0, 2]])
    np.testing.assert_allclose(A.prob_sum_LBE, [[1.7, 0.3], [0.7, 1.3]], atol=1e-6)
    np.testing.assert_allclose(A.z_sum_LB, [0 + 1, 4 + 9], atol=1e-5)
    np.testing.assert_array_equal(A.counts_E, [2, 2])
    assert float(A.tokens_per_row) == 2.0


def test_load_balancing_per_layer_global_and_local_by_hand():
    L = _stack(A, B)
    # Global: A f = (.5, .5), P = (.6, .4) -> 2 * (.3 + .2) = 1.0;  B f = (1, 0), P = .5 -> 1.0
    np.testing.assert_allclose(load_balancing_per_layer(L, top_k=1), [1.0, 1.0], atol=1e-6)
    np.testing.assert_allclose(load_balancing_loss(L, top_k=1), 2.0, atol=1e-6)
    # Local (2 shards = the 2 rows): A shard 0 f = (1, 0), P = (.85, .15) -> 1.7; shard 1
    # f = (0, 1), P = (.35, .65) -> 1.3; mean 1.5. B: both shards 1.0.
    np.testing.assert_allclose(load_balancing_per_layer(L, top_k=1, shards=2), [1.5, 1.0],
                               atol=1e-6)
    np.testing.assert_allclose(load_balancing_loss(L, top_k=1, shards=2), 2.5, atol=1e-6)


def test_load_balancing_pooled_by_hand():
    L = _stack(A, B)
    # Pooled over layers: f = ([2, 2] + [4, 0]) / 8 = (.75, .25);
    # P = ([2.4, 1.6] + [2, 2]) / 8 = (.55, .45) -> 2 * (.4125 + .1125) = 1.05.
    np.testing.assert_allclose(load_balancing_loss(L, top_k=1, kind="pooled"), 1.05, atol=1e-6)
    # Local pooled: shard 0 f = (1, 0), P = ((1.7 + 1) / 4, .) -> 2 * .675 = 1.35; shard 1:
    # f = (.5, .5), P = ((.7 + 1) / 4, (1.3 + 1) / 4) -> 2 * (.2125 + .2875) = 1.0; mean 1.175.
    np.testing.assert_allclose(load_balancing_loss(L, top_k=1, kind="pooled", shards=2), 1.175,
                               atol=1e-6)
    with pytest.raises(ValueError, match="unknown load-balancing"):
        load_balancing_loss(L, top_k=1, kind="mean")


def test_balanced_values_per_layer_one_pooled_k():
    E, k, S = 4, 2, 8
    r = route(jnp.zeros((S, E)), top_k=k, mode="uniform")  # uniform probs, balanced counts
    L = _stack(router_stats(r.probs_SE, r.logits_SE, r.idx_Sk, E, rows=2))
    np.testing.assert_allclose(load_balancing_loss(L, k), 1.0, atol=1e-6)
    np.testing.assert_allclose(load_balancing_loss(L, k, kind="pooled"), float(k), atol=1e-6)


def test_z_loss_by_hand():
    # logsumexp of each token's logits is its shift 0, 1, 2, 3 -> mean of squares 3.5.
    L = _stack(A, B)
    np.testing.assert_allclose(z_loss_per_layer(L), [3.5, 0.0], atol=1e-5)
    np.testing.assert_allclose(z_loss(L), 3.5, atol=1e-5)


def test_imbalance_per_expert_rank_and_shard():
    counts_LE = jnp.array([[4.0, 0, 2, 2], [1, 1, 1, 1]])
    np.testing.assert_allclose(imbalance(counts_LE), [2.0, 1.0])
    # 2 ranks own experts (0, 1) and (2, 3): 4 vs 4 -> balanced although experts are not.
    np.testing.assert_array_equal(rank_counts(counts_LE, 2), [[4, 4], [2, 2]])
    np.testing.assert_allclose(imbalance(rank_counts(counts_LE, 2)), [1.0, 1.0])
    np.testing.assert_allclose(imbalance(rank_counts(counts_LE, 1)), [1.0, 1.0])
    with pytest.raises(ValueError, match="expert-parallel"):
        rank_counts(counts_LE, 3)
    counts_LBE = jnp.arange(2 * 4 * 3, dtype=jnp.float32).reshape(2, 4, 3)
    np.testing.assert_array_equal(shard_sums(counts_LBE, 2)[0], [[3, 5, 7], [15, 17, 19]])
