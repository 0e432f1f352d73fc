"""Routing options against hand-computed cases (ties included) and the naive per-token
reference: gating modes, any top-k, norm_topk_prob, weight scale, selection bias,
group-limited selection, random and uniform modes, jitter, float32, config errors."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from olmo_jax.errors import ConfigError
from olmo_jax.model import MoEConfig
from olmo_jax.model.moe.losses import expert_imbalance, router_stats
from olmo_jax.model.moe.router import Router, route
from tests.reference import naive_gate_scores, naive_select, naive_weights

ln = math.log


def _route(logits, **kw):
    return route(jnp.asarray([logits], jnp.float32), **kw)


def _check(r, idx, weights, atol=1e-6):
    np.testing.assert_array_equal(np.asarray(r.idx_Sk[0]), idx)
    np.testing.assert_allclose(np.asarray(r.weights_Sk[0]), weights, atol=atol, rtol=0)


def test_softmax_gating_by_hand():
    logits = [ln(1), ln(2), ln(3), ln(4)]  # probs 0.1, 0.2, 0.3, 0.4
    _check(_route(logits, top_k=2), [3, 2], [0.4, 0.3])
    _check(_route(logits, top_k=2, norm_topk_prob=True), [3, 2], [4 / 7, 3 / 7])
    _check(_route(logits, top_k=2, norm_topk_prob=True, weight_scale=2.5), [3, 2],
           [10 / 7, 7.5 / 7])
    _check(_route(logits, top_k=4), [3, 2, 1, 0], [0.4, 0.3, 0.2, 0.1])  # any k, up to E
    np.testing.assert_allclose(_route(logits, top_k=1).probs_SE[0], [0.1, 0.2, 0.3, 0.4],
                               atol=1e-6)
    # Ties: three equal logits, the lower expert ids win.
    e = math.e
    _check(_route([1.0, 1.0, 1.0, 0.0], top_k=2), [0, 1], [e / (3 * e + 1)] * 2)


def test_sigmoid_gating_by_hand():
    logits = [0.0, ln(3), -ln(3), ln(3)]  # sigmoid 0.5, 0.75, 0.25, 0.75
    r = _route(logits, top_k=2, gating="sigmoid")  # tie between experts 1 and 3, lower first
    _check(r, [1, 3], [0.5, 0.5])
    _check(_route(logits, top_k=3, gating="sigmoid"), [1, 3, 0], [0.375, 0.375, 0.25])
    _check(_route(logits, top_k=3, gating="sigmoid", weight_scale=2.0), [1, 3, 0],
           [0.75, 0.75, 0.5])
    probs = _route(logits, top_k=1, gating="sigmoid").probs_SE[0]
    np.testing.assert_allclose(probs, np.array([0.5, 0.75, 0.25, 0.75]) / 2.25, atol=1e-6)
    assert r.idx_Sk.dtype == jnp.int32


def test_topk_softmax_gating_by_hand():
    e = math.e
    # Softmax over the chosen logits only; tie between experts 2 and 3 -> expert 2.
    _check(_route([2.0, 0.0, 1.0, 1.0], top_k=2, gating="topk_softmax"), [0, 2],
           [e / (e + 1), 1 / (e + 1)])
    _check(_route([2.0, 0.0, 1.0, 1.0], top_k=1, gating="topk_softmax"), [0], [1.0])
    _check(_route([0.5, 0.5, 0.5, 0.5], top_k=3, gating="topk_softmax"), [0, 1, 2], [1 / 3] * 3)


def test_bias_changes_selection_not_weights():
    logits = [ln(1), ln(2), ln(3), ln(4)]  # probs 0.1, 0.2, 0.3, 0.4
    bias = jnp.array([0.5, 0.0, 0.0, 0.0])  # selection scores 0.6, 0.2, 0.3, 0.4
    _check(_route(logits, top_k=2, bias_E=bias), [0, 3], [0.1, 0.4])
    # Tie made by the bias: 0.2 + 0.1 == 0.3 -> the lower id (1) wins over expert 2.
    bias = jnp.array([0.0, 0.1, 0.0, -1.0])
    _check(_route(logits, top_k=1, bias_E=bias), [1], [0.2])
    # sigmoid + bias (DeepSeek-V3): the weights renormalize the unbiased scores.
    r = _route([0.0, ln(3), -ln(3), 0.0], top_k=2, gating="sigmoid",
               bias_E=jnp.array([0.0, 0.0, 1.0, 0.0]))
    _check(r, [2, 1], [0.25, 0.75])


def test_group_limited_selection_by_hand():
    # 8 experts in 4 groups of 2; group score = sum of its top-2 scores (logits here).
    logits = [5.0, 0.0, 3.0, 3.0, 4.0, -1.0, 1.0, 1.0]  # groups: 5, 6, 3, 2
    kw = dict(top_k=2, gating="topk_softmax")
    _check(_route(logits, **kw), [0, 4], jax.nn.softmax(jnp.array([5.0, 4.0])))  # no groups
    # Best 2 groups: g1 (6) and g0 (5); expert 4 (group 2) is masked; 2 ties 3 -> 2 wins.
    _check(_route(logits, n_group=4, topk_group=2, **kw), [0, 2],
           jax.nn.softmax(jnp.array([5.0, 3.0])))
    # One group: only group 1 (experts 2, 3) is eligible.
    _check(_route(logits, n_group=4, topk_group=1, **kw), [2, 3], [0.5, 0.5])
    # Tied groups (both 4.0): the lower group wins.
    _check(_route([2.0, 2.0, 3.0, 1.0], top_k=1, n_group=2, topk_group=1, **{
        "gating": "topk_softmax"}), [0], [1.0])
    # Bias enters the group scores too: group 2 rises to 4 + 9 - 1 = 12.
    bias = jnp.array([0, 0, 0, 0, 9.0, 0, 0, 0])
    _check(_route(logits, n_group=4, topk_group=1, bias_E=bias, **kw), [4, 5],
           jax.nn.softmax(jnp.array([4.0, -1.0])))


@pytest.mark.parametrize(
    "gating,top_k,norm,n_group,topk_group,bias",
    [
        ("softmax", 2, False, 1, 1, False),
        ("softmax", 3, True, 4, 2, True),
        ("sigmoid", 4, False, 4, 3, True),
        ("sigmoid", 1, False, 8, 2, False),
        ("topk_softmax", 2, False, 2, 1, True),
        ("topk_softmax", 8, False, 1, 1, False),
    ],
)
def test_route_matches_naive_reference(gating, top_k, norm, n_group, topk_group, bias):
    E = 8
    logits = jax.random.normal(jax.random.key(1), (64, E)) * 2.0
    bias_E = jax.random.normal(jax.random.key(2), (E,)) * 0.3 if bias else None
    r = route(logits, top_k=top_k, gating=gating, norm_topk_prob=norm, weight_scale=1.5,
              bias_E=bias_E, n_group=n_group, topk_group=topk_group)
    idx = naive_select(naive_gate_scores(np.asarray(logits), gating), top_k,
                       None if bias_E is None else np.asarray(bias_E), n_group, topk_group)
    np.testing.assert_array_equal(np.asarray(r.idx_Sk), idx)
    w = naive_weights(logits, jnp.asarray(idx), gating, norm, 1.5)
    np.testing.assert_allclose(r.weights_Sk, w, atol=1e-6, rtol=0)


def test_random_choice_mode_draws_from_the_key_and_gradients_flow():
    S, E, k = 512, 8, 2
    logits = jax.random.normal(jax.random.key(0), (S, E))
    key = jax.random.key(7)
    r = route(logits, top_k=k, mode="random_choice", key=key)
    # The documented draw: uniform scores from the key, then the same top-k.
    idx = naive_select(np.asarray(jax.random.uniform(key, (S, E))), k)
    np.testing.assert_array_equal(np.asarray(r.idx_Sk), idx)
    np.testing.assert_allclose(r.weights_Sk, naive_weights(logits, jnp.asarray(idx), "softmax"),
                               atol=1e-6)
    other = route(logits, top_k=k, mode="random_choice", key=jax.random.key(8)).idx_Sk
    assert (np.asarray(other) != idx).any()
    counts = np.bincount(idx.reshape(-1), minlength=E)
    assert counts.min() > 0.7 * S * k / E  # not learned: close to uniform
    # Random choice, learned weights: the gradient reaches the router logits.
    g = jax.grad(lambda lg: jnp.sum(route(lg, top_k=k, mode="random_choice", key=key).weights_Sk
                                    * jnp.arange(k)))(logits)
    assert float(jnp.max(jnp.abs(g))) > 1e-3


@pytest.mark.parametrize("gating", ["softmax", "sigmoid"])
def test_random_mode_is_olmo_core_noise_gate(gating):
    """OLMo-core's random_expert_assignment: U(0,1) noise replaces the gate scores: the
    experts are its top-k, the weights are the noise there, the LB probabilities are the
    noise (normalized for sigmoid), and no gradient reaches the logits through them."""
    S, E, k = 64, 8, 2
    logits = jax.random.normal(jax.random.key(0), (S, E))
    key = jax.random.key(7)
    r = route(logits, top_k=k, gating=gating, mode="random", key=key, sigmoid_renorm=False)
    noise = np.asarray(jax.random.uniform(key, (S, E)))
    idx = naive_select(noise, k)
    np.testing.assert_array_equal(np.asarray(r.idx_Sk), idx)
    np.testing.assert_array_equal(np.asarray(r.weights_Sk), np.take_along_axis(noise, idx, -1))
    probs = noise if gating == "softmax" else noise / noise.sum(-1, keepdims=True)
    np.testing.assert_allclose(r.probs_SE, probs, rtol=1e-6)
    g = jax.grad(lambda lg: jnp.sum(route(lg, top_k=k, gating=gating, mode="random", key=key)
                                    .weights_Sk * jnp.arange(k)))(logits)
    assert float(jnp.max(jnp.abs(g))) == 0.0


def test_sigmoid_without_renormalization_keeps_raw_scores():
    logits = [0.0, ln(3), -ln(3), ln(3)]  # sigmoid 0.5, 0.75, 0.25, 0.75
    _check(_route(logits, top_k=3, gating="sigmoid", sigmoid_renorm=False), [1, 3, 0],
           [0.75, 0.75, 0.5])
    r = _route(logits, top_k=2, gating="sigmoid", sigmoid_renorm=False, sigmoid_eps=1e-3)
    np.testing.assert_allclose(r.weights_Sk[0], [0.751, 0.751], rtol=1e-6)


@pytest.mark.parametrize("gating", ["softmax", "sigmoid", "topk_softmax"])
def test_uniform_mode_is_exactly_balanced(gating):
    S, E, k = 96, 8, 3
    logits = jax.random.normal(jax.random.key(0), (S, E)) * 4.0  # strongly peaked router
    r = route(logits, top_k=k, gating=gating, mode="uniform")
    stats = router_stats(r.probs_SE, r.logits_SE, r.idx_Sk, E)
    np.testing.assert_array_equal(np.asarray(stats.counts_E), np.full(E, S * k / E))
    assert float(expert_imbalance(stats.counts_E[None])) == 1.0
    idx = np.asarray(r.idx_Sk)
    assert all(len(set(row)) == k for row in idx)  # a token's k experts are distinct
    np.testing.assert_array_equal(idx[:3], [[0, 1, 2], [3, 4, 5], [6, 7, 0]])
    np.testing.assert_allclose(r.weights_Sk, naive_weights(logits, r.idx_Sk, gating), atol=1e-6)
    g = jax.grad(lambda lg: jnp.sum(route(lg, top_k=k, gating=gating, mode="uniform")
                                    .weights_Sk[:, 0]))(logits)
    assert float(jnp.max(jnp.abs(g))) > 1e-4


def _router(**kw):
    cfg = MoEConfig(num_experts=4, top_k=2, **kw)
    return Router(8, cfg, 0.5, rngs=nnx.Rngs(0))


def test_router_is_float32_for_bfloat16_inputs():
    router = _router()
    x = jax.random.normal(jax.random.key(0), (16, 8)).astype(jnp.bfloat16)
    r = router(x)
    for a in (r.logits_SE, r.probs_SE, r.weights_Sk):
        assert a.dtype == jnp.float32
    ref = np.asarray(x, np.float32) @ np.asarray(router.weight[...])
    np.testing.assert_allclose(r.logits_SE, ref, atol=1e-5)


def test_jitter_only_with_a_key_and_bounded():
    eps = 0.2
    router = _router(router_jitter=eps)
    x = jax.random.normal(jax.random.key(0), (16, 8))
    plain = router(x).logits_SE  # no key: evaluation / sampling, no jitter
    np.testing.assert_allclose(plain, _router()(x).logits_SE, atol=0)
    key = jax.random.key(3)
    jit1, jit2 = router(x, key).logits_SE, router(x, key).logits_SE
    np.testing.assert_array_equal(jit1, jit2)  # seeded
    assert float(jnp.max(jnp.abs(jit1 - plain))) > 1e-3
    # It is multiplicative noise on the router input, within [1 - eps, 1 + eps].
    noise = jax.random.uniform(jax.random.split(key)[0], x.shape, jnp.float32, 1 - eps, 1 + eps)
    np.testing.assert_allclose(jit1, (x * noise) @ router.weight[...], atol=1e-5)
    assert float(jnp.min(noise)) >= 1 - eps and float(jnp.max(noise)) <= 1 + eps


@pytest.mark.parametrize(
    "kw,field",
    [
        (dict(num_experts=8, n_group=3), "model.moe.n_group"),
        (dict(num_experts=8, n_group=4, topk_group=5), "model.moe.topk_group"),
        (dict(num_experts=8, top_k=5, n_group=4, topk_group=2), "model.moe.top_k"),
        (dict(bias_rate=-1e-3), "model.moe.bias_rate"),
        (dict(routing_mode="greedy"), "model.moe.routing_mode"),
        (dict(router_jitter=1.5), "model.moe.router_jitter"),
        (dict(lb_granularity="micro"), "model.moe.lb_granularity"),
        (dict(gating="relu"), "model.moe.gating"),
        # OLMo-core's refusals: topk_softmax selects by the raw logits.
        (dict(num_experts=8, gating="topk_softmax", n_group=2), "model.moe.n_group"),
        (dict(gating="topk_softmax", routing_mode="random"), "model.moe.routing_mode"),
        (dict(sigmoid_eps=-1.0), "model.moe.sigmoid_eps"),
    ],
)
def test_bad_routing_configs_name_the_field(kw, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        MoEConfig(**kw).validate()
