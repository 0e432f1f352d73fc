"""olmo3moe (OLMo-core's Hugging Face MoE export) conversion without OLMo-core: the
config fields both ways, and the refusals that name the field. (Parity with OLMo-core
itself: tests/olmo_core/test_model_parity.py.)"""

from __future__ import annotations

import math

import jax
import numpy as np
import pytest

from olmo_jax.checkpoint import olmo3moe
from olmo_jax.checkpoint.tree import flatten_named, nest
from olmo_jax.errors import CheckpointError
from olmo_jax.model import TransformerConfig
from olmo_jax.model.abstract import abstract_model
from olmo_jax.model.config import MoEConfig

CFG = TransformerConfig(
    vocab_size=64, d_model=32, n_layers=3, n_heads=4, n_kv_heads=2, n_dense_layers=1,
    dense_hidden=48, norm_eps=1e-6, head_qk_norm=True, block_norm="peri",
    embed_scale=math.sqrt(32), embedding_norm=True, init_std=0.01,
    moe=MoEConfig(num_experts=4, top_k=2, expert_hidden=16, gating="sigmoid",
                  sigmoid_renorm=False, sigmoid_eps=1e-7, router_weight_scale=2.0,
                  n_shared_experts=1, shared_hidden=24))


def test_config_and_tensors_round_trip():
    assert olmo3moe.from_config(olmo3moe.to_config(CFG)) == CFG
    _, abstract, _ = abstract_model(CFG)
    keys = iter(jax.random.split(jax.random.key(0), 100))
    params = nest({k: np.asarray(jax.random.normal(next(keys), v.shape))
                   for k, v in flatten_named(abstract).items()})
    tensors = olmo3moe.from_params(params, CFG)
    assert "model.layers.1.pre_attention_layernorm.weight" in tensors
    assert "model.layers.0.mlp.gate_proj.weight" in tensors
    back = olmo3moe.to_params(tensors, CFG, "x")
    for k, v in flatten_named(params).items():
        assert np.array_equal(flatten_named(back)[k], v), k


@pytest.mark.parametrize("change,field", [
    (dict(block_norm="pre"), "model.block_norm"),
    (dict(head_qk_norm=False), "model.head_qk_norm"),
    (dict(clip_qkv=1.0), "model.clip_qkv"),
    (dict(moe=MoEConfig(num_experts=4, gating="topk_softmax")), "model.moe.gating"),
    (dict(moe=MoEConfig(num_experts=4, n_group=2)), "model.moe.n_group"),
    (dict(moe=MoEConfig(num_experts=4, router_weight_scale=1.5)), "model.moe.router_weight_scale"),
])
def test_export_refuses_what_olmo3moe_cannot_hold(change, field):
    with pytest.raises(CheckpointError, match=field.replace(".", r"\.")):
        olmo3moe.to_config(CFG.replace(**change))


@pytest.mark.parametrize("field,value", [
    ("model_type", "olmoe"), ("attention_gate_type", "elementwise"), ("scalable_softmax", True),
    ("latent_moe_dim", 16), ("normalize_expert_weights", 2.0), ("use_head_qk_norm", False),
    ("layer_types", ["sliding_attention"] * 3), ("dense_layers_indices", [1]),
    ("gating_function", "topk_softmax"),
])
def test_import_refuses_what_olmo_jax_cannot_express(field, value):
    hf = olmo3moe.to_config(CFG)
    hf[field] = value
    with pytest.raises(CheckpointError, match=field):
        olmo3moe.from_config(hf)
