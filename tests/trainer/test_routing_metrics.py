"""The train step's routing metrics cannot be gerrymandered: router outputs built so that
the LB loss improves while the load per expert-parallel rank gets worse, and the metrics
report both; per-block keys; local (per-shard) imbalance."""

import math

import jax
import jax.numpy as jnp
import numpy as np

from olmo_jax.model import MoEConfig, TransformerConfig
from olmo_jax.model.moe.losses import RouterStats, router_stats
from olmo_jax.model.moe.router import route
from olmo_jax.objective import BatchReduction, LossParts, routing_parts
from olmo_jax.trainer.routing_metrics import PER_BLOCK, routing_metrics

E, K, RANKS, S = 8, 2, 4, 64  # rank r owns experts 2r, 2r + 1
CFG = TransformerConfig(n_dense_layers=1, moe=MoEConfig(num_experts=E, top_k=K))
AXIS = "shards"


class VmapShards:
    """The batch reductions of a plan (objective.BatchReduction) whose batch devices are
    the instances of a jax.vmap over the named axis AXIS: the psum / all_gather that a
    mesh's batch devices run, on one device."""

    def allsum(self, tree):
        return jax.lax.psum(tree, AXIS)

    def allgather(self, x):
        return jax.lax.all_gather(x, AXIS)


def _sharded_routing_parts(stacked: RouterStats, shards: int) -> dict:
    """routing_parts with the batch rows split into `shards` contiguous slices, one per
    (vmapped) device, as a mesh splits the batch."""
    def split(x_LB):  # [L, B, ...] -> [shards, L, B / shards, ...]
        L, B = x_LB.shape[:2]
        return jnp.moveaxis(x_LB.reshape(L, shards, B // shards, *x_LB.shape[2:]), 1, 0)

    dropped = jnp.zeros((shards,) + stacked.dropped.shape).at[0].set(stacked.dropped)
    per_shard = RouterStats(split(stacked.counts_LBE), split(stacked.prob_sum_LBE),
                            split(stacked.z_sum_LB), dropped, stacked.tokens_per_row)
    out = jax.vmap(lambda st: routing_parts(st, CFG, VmapShards()), axis_name=AXIS,
                   in_axes=(RouterStats(0, 0, 0, 0, None),))(per_shard)
    for v in jax.tree.leaves(out):  # the reductions leave every device the same parts
        np.testing.assert_array_equal(v, np.broadcast_to(v[0], v.shape))
    return jax.tree.map(lambda v: v[0], out)


def _metrics(logits_SE, shards=1):
    r = route(jnp.asarray(logits_SE, jnp.float32), top_k=K)
    stats = router_stats(r.probs_SE, r.logits_SE, r.idx_Sk, E, rows=4)
    stacked = type(stats)(*(jnp.stack([f]) for f in stats))  # one MoE block
    routing = (routing_parts(stacked, CFG) if shards == 1
               else _sharded_routing_parts(stacked, shards))
    parts = LossParts(jnp.zeros(()), jnp.ones(()), lm_z_sum=jnp.zeros(()), **routing)
    return routing_metrics(parts, expert_ranks=RANKS, first_block=1), r


def _tokens(hot_pairs, high):
    """Half the tokens prefer the first pair of experts, half the second, by `high`."""
    logits = np.zeros((S, E), np.float32)
    for s in range(S):
        logits[s, list(hot_pairs[s % 2])] = high
    return logits


def test_lb_loss_falls_while_rank_imbalance_rises():
    # Before: confident router, experts 0, 2 | 4, 6 -> one hot expert on every rank.
    before, r0 = _metrics(_tokens([(0, 2), (4, 6)], 3.0))
    # After: a nearly indifferent router, experts 0, 1 | 2, 3 -> ranks 0 and 1 only.
    after, r1 = _metrics(_tokens([(0, 1), (2, 3)], 0.1))

    # By hand: 4 experts take S / 2 assignments each (mean S * K / E = S / 4) -> 2.0 both.
    assert float(before["expert_imbalance"]) == 2.0 == float(after["expert_imbalance"])
    # Per rank: before S / 2 each -> 1.0; after S, S, 0, 0 -> 2.0.
    assert float(before["rank_imbalance"]) == 1.0
    assert float(after["rank_imbalance"]) == 2.0
    # LB = E * sum_i f_i P_i with f = 1/4 on the 4 hot experts, P the mean router prob.
    def lb(high):
        p_hot = math.exp(high) / (2 * math.exp(high) + E - 2)
        p_cold = 1 / (2 * math.exp(high) + E - 2)
        return E * 4 * 0.25 * (p_hot + p_cold) / 2

    np.testing.assert_allclose(before["lb_loss"], lb(3.0), rtol=1e-6)
    np.testing.assert_allclose(after["lb_loss"], lb(0.1), rtol=1e-6)
    drop = 1 - float(after["lb_loss"]) / float(before["lb_loss"])
    assert drop > 0.4, drop  # the loss "improved" by more than 40% ...
    # ... while the slowest rank got twice the mean load: the metrics say so.
    assert after["rank_imbalance/block1"] == after["rank_imbalance"]
    assert set(f"{n}/block1" for n in PER_BLOCK) <= set(after)


def test_local_imbalance_sees_shards_the_global_count_hides():
    # First half of the rows -> experts 0, 1; second half -> experts 2, 3 (peaked router).
    logits = np.zeros((S, E), np.float32)
    logits[: S // 2, [0, 1]] = 5.0
    logits[S // 2:, [2, 3]] = 5.0
    assert isinstance(VmapShards(), BatchReduction)
    m, _ = _metrics(logits, shards=2)
    assert float(m["expert_imbalance"]) == 2.0  # 4 of 8 experts busy over the whole batch
    assert float(m["expert_imbalance_local"]) == 4.0  # 2 of 8 within each shard
    np.testing.assert_array_equal(m["expert_counts"], [[S / 2] * 4 + [0] * 4])
    assert float(m["dropped_frac"]) == 0.0
