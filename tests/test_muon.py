"""Muon (olmo_jax/optim/muon.py) on one device: the same update as optax.contrib's Muon
for every matrix layout of the model, each expert's matrix orthogonalized on its own,
the scale rule's update RMS, and which parameters Muon takes."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from optax import contrib
from optax.contrib import _muon as optax_muon  # scale_by_shape: the consistent-RMS rule

from olmo_jax.config import default_config, model_config, validate
from olmo_jax.errors import ConfigError
from olmo_jax.model.abstract import abstract_model
from olmo_jax.model.params import path_name
from olmo_jax.optim import build_optimizer
from olmo_jax.optim.muon import matrix_dims, muon_labels, newton_schulz, scale_by_muon

SHAPES = {  # leaf -> (shape, optax's dimension numbers)
    "moe_blocks/attn/q_proj": ((3, 16, 4, 8), contrib.MuonDimensionNumbers((1,), (2, 3))),
    "moe_blocks/attn/o_proj": ((3, 4, 8, 16), contrib.MuonDimensionNumbers((1, 2), (3,))),
    "moe_blocks/ffn/experts/w_gate": ((3, 4, 16, 24), contrib.MuonDimensionNumbers((2,), (3,))),
    "moe_blocks/ffn/experts/w_down": ((3, 4, 24, 16), contrib.MuonDimensionNumbers((2,), (3,))),
    "dense_blocks/ffn/w_up": ((1, 16, 40), contrib.MuonDimensionNumbers((1,), (2,))),
}


def _tree(seed):
    keys = jax.random.split(jax.random.key(seed), len(SHAPES))
    return {k: jax.random.normal(key, s) for key, (k, (s, _)) in zip(keys, SHAPES.items(), strict=True)}


def test_update_equals_optax_contrib_muon():
    params, dn = _tree(0), {k: d for k, (_, d) in SHAPES.items()}
    ours = scale_by_muon(beta=0.95, ns_steps=5, rms=0.2)
    ref = optax.chain(contrib.scale_by_muon(beta=0.95, ns_steps=5, weight_dimension_numbers=dn),
                      optax_muon.scale_by_shape(dn, consistent_rms=0.2))
    s1, s2 = ours.init(params), ref.init(params)
    ours_update, ref_update = jax.jit(ours.update), jax.jit(ref.update)
    for step in range(3):
        grads = _tree(10 + step)
        u1, s1 = ours_update(grads, s1, params)
        u2, s2 = ref_update(grads, s2, params)
        for k in params:
            err = float(jnp.max(jnp.abs(u1[k] - u2[k])) / jnp.max(jnp.abs(u2[k])))
            assert err < 1e-5, (step, k, err)
            rms = float(jnp.sqrt(jnp.mean(u1[k] ** 2)))
            assert 0.15 < rms < 0.25, (k, rms)  # the scale rule: RMS ~ optim.muon_rms


def test_each_expert_matrix_is_orthogonalized_on_its_own():
    w = jax.random.normal(jax.random.key(1), (2, 4, 16, 24))  # [L, E, D, F]
    dims = matrix_dims("moe_blocks/ffn/experts/w_up", 4)
    assert dims.batch == (0, 1)
    batched = newton_schulz(w.reshape(8, 16, 24))
    for i in range(8):
        alone = newton_schulz(w.reshape(8, 16, 24)[i:i + 1])[0]
        np.testing.assert_allclose(batched[i], alone, rtol=0, atol=1e-6)
        s = np.linalg.svd(np.asarray(alone), compute_uv=False)
        assert 0.5 < s.min() and s.max() < 1.5  # ~ orthogonal (quintic NS: S' in ~(0.5, 1.5))
    whole = newton_schulz(w.reshape(1, 8 * 16, 24))[0].reshape(8, 16, 24)
    assert not np.allclose(whole, batched, atol=1e-3)  # not one [E*D, F] matrix


def test_muon_takes_the_matrices_adamw_the_rest():
    c = default_config()
    c.model.vocab_size, c.model.n_layers, c.model.n_dense_layers = 64, 2, 1
    c.model.moe.n_shared_experts, c.model.moe.shared_hidden = 1, 32
    params = abstract_model(model_config(c))[1]

    labels = {path_name(p): v for p, v in jax.tree_util.tree_leaves_with_path(muon_labels(params))}
    muon = sorted(k for k, v in labels.items() if v == "muon")
    adamw = sorted(k for k, v in labels.items() if v == "adamw")
    projections = {f"{b}/attn/{m}" for b in ("dense_blocks", "moe_blocks")
                   for m in ("q_proj", "k_proj", "v_proj", "o_proj")}
    assert projections <= set(muon)
    assert {"embedding", "lm_head", "final_norm/weight", "moe_blocks/ffn/router/weight"} <= set(adamw)
    assert not [k for k in adamw if k.endswith(("_proj", "w_gate", "w_up", "w_down"))]
    assert {"moe_blocks/ffn/experts/w_gate", "moe_blocks/ffn/shared/w_down",
            "dense_blocks/ffn/w_up", "moe_blocks/attn/o_proj"} <= set(muon)
    assert not [k for k in muon if "norm" in k or "router" in k]
    c.optim.name = "muon"
    tx, _ = build_optimizer(c.optim, 10)
    state = jax.eval_shape(tx.init, params)
    assert jax.tree.leaves(state)  # builds, with momentum for the matrices


@pytest.mark.parametrize("field,value", [("muon_beta", 1.0), ("muon_ns_steps", 0),
                                          ("muon_rms", 0.0), ("muon_lr", -1.0)])
def test_bad_muon_fields_are_refused(field, value):
    c = default_config()
    c.optim.name = "muon"
    c.optim[field] = value
    with pytest.raises(ConfigError, match=f"optim.{field}"):
        validate(c)
