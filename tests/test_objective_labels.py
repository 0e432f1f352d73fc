"""The loss over OLMo-core instance rows (olmo_jax/labels.py): the unlabelled last position adds
nothing and is not counted; a row the repetition filter dropped adds nothing but its
seq_len - 1 labels are counted, as in OLMo-core's train module."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from olmo_jax.labels import FILTERED, NO_LABEL
from olmo_jax.objective import cross_entropy_sum, labelled


def reference_ce(logits_BTV: np.ndarray, targets_BT: np.ndarray, dropped_B: np.ndarray):
    """(sum, count) of -log softmax at each labelled target, by loops."""
    total, count = 0.0, 0
    for b in range(targets_BT.shape[0]):
        for t in range(targets_BT.shape[1]):
            if targets_BT[b, t] < 0:
                continue
            count += 1
            if not dropped_B[b]:
                row = logits_BTV[b, t].astype(np.float64)
                total += np.log(np.exp(row - row.max()).sum()) + row.max() - row[targets_BT[b, t]]
    return total, count


def test_sentinels_against_a_loop_reference():
    rng = np.random.default_rng(0)
    B, T, V = 4, 6, 11
    logits_BTV = rng.normal(size=(B, T, V)).astype(np.float32)
    targets_BT = rng.integers(0, V, (B, T)).astype(np.int32)
    targets_BT[:, -1] = NO_LABEL
    targets_BT[2, -1] = FILTERED  # row 2 failed the repetition filter
    loss_BT, counted_BT = labelled(jnp.asarray(targets_BT))
    ce_sum = float(cross_entropy_sum(jnp.asarray(logits_BTV), jnp.asarray(targets_BT)))
    want_sum, want_count = reference_ce(logits_BTV, targets_BT, np.arange(B) == 2)
    np.testing.assert_allclose(ce_sum, want_sum, rtol=1e-6)
    assert int(counted_BT.sum()) == want_count == B * (T - 1)  # OLMo-core's B * (S - 1)
    assert int(loss_BT.sum()) == (B - 1) * (T - 1)


def test_fully_labelled_rows_are_unchanged():
    rng = np.random.default_rng(1)
    logits_BTV = rng.normal(size=(3, 5, 7)).astype(np.float32)
    targets_BT = rng.integers(0, 7, (3, 5)).astype(np.int32)  # data.instances='plus_one'
    want_sum, want_count = reference_ce(logits_BTV, targets_BT, np.zeros(3, bool))
    np.testing.assert_allclose(float(cross_entropy_sum(jnp.asarray(logits_BTV),
                                                       jnp.asarray(targets_BT))), want_sum, rtol=1e-6)
    assert int(labelled(jnp.asarray(targets_BT))[1].sum()) == want_count == 15
