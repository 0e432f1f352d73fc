"""Routing inside the jitted train step: the aux-loss-free bias update rule (from the
step's global counts, never through gradients or the optimizer), training randomness
seeded from TrainState.rng folded with the step (jitter on in training, off in eval),
and global counts summed over micro-batches and data-parallel shards (per-shard counts
for the local imbalance)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from olmo_jax.config import default_config
from olmo_jax.model import MoEConfig, TransformerConfig
from olmo_jax.model.moe.bias_balancing import bias_update
from olmo_jax.model.moe.router import RouterBias, route
from olmo_jax.objective import SINGLE_DEVICE, Plan, forward_losses
from olmo_jax.trainer.state import init_state
from olmo_jax.trainer.step import make_train_step
from tests.sections import plan_for

RATE = 0.01


def _cfg(**moe_kw):
    moe = MoEConfig(num_experts=4, top_k=2, expert_hidden=16, **moe_kw)
    return TransformerConfig(vocab_size=64, d_model=16, n_layers=2, n_heads=2, init_std=0.3,
                             moe=moe)


def _batch(n=4):
    return jax.random.randint(jax.random.key(1), (n, 9), 0, 64)


def _bias_leaves(tree):
    leaves = jax.tree_util.tree_flatten_with_path(
        tree, is_leaf=lambda x: isinstance(x, nnx.Variable))[0]
    return [(p, v) for p, v in leaves if isinstance(v, RouterBias)]


def test_bias_update_rule_by_hand():
    counts_LE = jnp.array([[4.0, 0.0, 2.0, 2.0], [1.0, 3.0, 2.0, 2.0]])  # means 2 and 2
    new = bias_update(jnp.ones((2, 4)), counts_LE, 0.5)
    np.testing.assert_allclose(new, [[0.5, 1.5, 1.0, 1.0], [1.5, 0.5, 1.0, 1.0]])


def test_train_step_updates_bias_from_global_counts_without_gradients():
    cfg = _cfg(bias_rate=RATE, lb_loss_coef=0.0, router_jitter=0.1)
    tx = optax.adamw(1e-2)
    graphdef, state = init_state(cfg, tx, seed=0)
    # The bias is model state, stacked per MoE block; params and optimizer never hold it.
    [(path, bias)] = _bias_leaves(state.model_state)
    assert "moe_blocks" in jax.tree_util.keystr(path) and bias.shape == (2, 4)
    assert not _bias_leaves(state.params) and not _bias_leaves(state.opt_state)
    n_params = len(jax.tree.leaves(state.params))
    assert len(jax.tree.leaves(state.opt_state)) == 2 * n_params + 1  # mu, nu, count

    step = jax.jit(make_train_step(graphdef, cfg, tx, optax.constant_schedule(1e-2)))
    batch = _batch()
    state1, m1 = step(state, batch)
    counts = np.asarray(m1["expert_counts"])
    assert counts.sum() == 2 * 4 * 8 * 2  # 2 blocks x 32 tokens x top-2: every assignment
    expected = RATE * np.sign(counts.mean(-1, keepdims=True) - counts)
    np.testing.assert_allclose(_bias_leaves(state1.model_state)[0][1][...], expected, atol=0)
    state2, m2 = step(state1, batch)
    expected = expected + RATE * np.sign(np.asarray(m2["expert_counts"]).mean(-1, keepdims=True)
                                         - np.asarray(m2["expert_counts"]))
    np.testing.assert_allclose(_bias_leaves(state2.model_state)[0][1][...], expected, atol=1e-7)

    # The step's key is TrainState.rng folded with the step number; eval has no jitter.
    key = jax.random.fold_in(jax.random.wrap_key_data(state.rng), 0)

    @jax.jit
    def forwards(model_state):
        trained = forward_losses(graphdef, state.params, model_state, batch, cfg, rng=key)
        return trained, forward_losses(graphdef, state.params, model_state, batch, cfg)

    trained, plain = forwards(state.model_state)
    np.testing.assert_allclose(m1["loss"], trained.ce_sum / trained.n_tokens, rtol=1e-6)
    assert abs(float(plain.ce_sum - trained.ce_sum)) > 1e-4


def test_bias_gets_no_gradient():
    # Whatever the bias, d(weights, probs) / d bias is exactly zero: it only selects.
    logits = jax.random.normal(jax.random.key(0), (32, 4))

    def f(bias_E):
        r = route(logits, top_k=2, gating="sigmoid", bias_E=bias_E, n_group=2, topk_group=1)
        return jnp.sum(r.weights_Sk * jnp.arange(2)) + jnp.sum(r.probs_SE ** 2)

    g = jax.grad(f)(jnp.array([0.3, -0.2, 0.1, 0.0]))
    np.testing.assert_array_equal(g, np.zeros(4))
    # ... while the bias does change the selection.
    r0 = route(logits, top_k=2, bias_E=jnp.zeros(4))
    r1 = route(logits, top_k=2, bias_E=jnp.array([0.0, 0.0, 0.0, 5.0]))
    assert (np.asarray(r1.idx_Sk) == 3).any(axis=1).all()
    assert not (np.asarray(r0.idx_Sk) == 3).any(axis=1).all()


def _data_parallel_plan(model_cfg, data, grad_accum, global_batch):
    """A ParallelPlan splitting the batch over `data` devices (no expert parallelism)."""
    c = default_config()
    c.parallel.data, c.parallel.expert = data, 1
    c.trainer.global_batch_size, c.trainer.grad_accum = global_batch, grad_accum
    return plan_for(c, model_cfg, devices=jax.devices()[:data])


def test_counts_are_summed_over_micro_batches_and_shards():
    cfg = _cfg(bias_rate=RATE)  # no jitter: the step routes the tokens as a plain forward
    tx = optax.sgd(0.0)
    graphdef, state = init_state(cfg, tx, seed=0)
    # Two data-parallel shards of each of two micro-batches: per-shard (local) counts.
    plan = _data_parallel_plan(cfg, data=2, grad_accum=2, global_batch=8)
    assert isinstance(plan, Plan) and plan.pipeline is None and isinstance(SINGLE_DEVICE, Plan)
    shardings = plan.state_shardings(state, tx)
    micro = plan.jit_train_step(make_train_step(graphdef, cfg, tx, optax.constant_schedule(0.0),
                                                grad_accum=2, parallel=plan, expert_ranks=2),
                                shardings)
    batch = _batch(8)
    count = jax.jit(lambda rows: forward_losses(graphdef, state.params, state.model_state, rows,
                                                cfg).counts_LE)
    counts_LE = np.asarray(count(batch))  # the whole batch in one forward
    # Shard d holds rows 2d, 2d + 1 of each micro-batch of 4 rows (strategy.py's layout).
    shard_LE = [np.asarray(count(batch[np.r_[2 * d:2 * d + 2, 4 + 2 * d:6 + 2 * d]]))
                for d in range(2)]
    new_state, m = micro(jax.device_put(state, shardings), plan.place_batch(batch))  # donated
    assert counts_LE.sum() == 2 * 8 * 8 * 2
    np.testing.assert_array_equal(m["expert_counts"], counts_LE)
    np.testing.assert_array_equal(_bias_leaves(new_state.model_state)[0][1][...],
                                  RATE * np.sign(counts_LE.mean(-1, keepdims=True) - counts_LE))
    ranks = counts_LE.reshape(2, 2, 2).sum(-1)  # 2 ranks x 2 experts each
    np.testing.assert_allclose(m["rank_imbalance"], (ranks.max(-1) / ranks.mean(-1)).max(),
                               rtol=1e-6)
    np.testing.assert_array_equal(sum(shard_LE), counts_LE)
    local = max(float((c.max(-1) / c.mean(-1)).max()) for c in shard_LE)
    np.testing.assert_allclose(m["expert_imbalance_local"], local, rtol=1e-6)
    assert m["expert_imbalance_local"] >= m["expert_imbalance"] - 1e-6
    assert set(m) >= {f"rank_imbalance/block{b}" for b in (0, 1)}
