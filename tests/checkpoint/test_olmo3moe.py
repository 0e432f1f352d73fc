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
    ("layer_types", ["linear_attention"] * 3), ("layer_types", ["full_attention"] * 2),
    ("dense_layers_indices", [1]),
    ("gating_function", "topk_softmax"),
])
def test_import_refuses_what_olmo_jax_cannot_express(field, value):
    hf = olmo3moe.to_config(CFG)
    hf[field] = value
    with pytest.raises(CheckpointError, match=field):
        olmo3moe.from_config(hf)


@pytest.mark.parametrize("n_layers, pattern, first, last", [
    (4, (5, 5, 5, -1), False, True),  # OLMo 3's shape: one period, the last layer full
    (8, (5, 5, 5, -1), False, True),
    (6, (5, 5, 5, -1), False, True),  # the last layer forced full breaks the period
    (3, (7,), True, True),
    (5, (5, -1), False, False),
])
def test_windows_map_to_layer_types_and_back(n_layers, pattern, first, last):
    cfg = CFG.replace(n_layers=n_layers, window_pattern=pattern, window_full_first=first,
                      window_full_last=last)
    hf = olmo3moe.to_config(cfg)
    windows = cfg.layer_windows
    assert hf["layer_types"] == ["sliding_attention" if w else "full_attention" for w in windows]
    assert hf["sliding_window"] == max(windows)  # OLMo-core's window_size, keys incl. the query
    back = olmo3moe.from_config(hf)
    assert back.layer_windows == windows and not back.window_full_first
    assert olmo3moe.from_config(olmo3moe.to_config(back)) == back  # one canonical pattern
    assert olmo3moe.to_config(back) == hf
    # without windows: every layer full, and OLMo-core's placeholder sliding_window ignored
    plain = olmo3moe.to_config(CFG)
    assert plain["layer_types"] == ["full_attention"] * 3 and "sliding_window" not in plain
    assert olmo3moe.from_config({**plain, "sliding_window": 4096}) == CFG


def test_export_refuses_two_window_sizes():
    cfg = CFG.replace(window_pattern=(4, 8), window_full_first=False, window_full_last=False)
    with pytest.raises(CheckpointError, match=r"model\.window_pattern.*windows \[4, 8\]"):
        olmo3moe.to_config(cfg)


def test_import_refuses_a_window_it_cannot_read():
    hf = olmo3moe.to_config(CFG.replace(window_pattern=(5,), window_full_first=False,
                                        window_full_last=False))
    with pytest.raises(CheckpointError, match="sliding_window"):
        olmo3moe.from_config({**hf, "sliding_window": 0})


YARN = dict(rope_scaling="yarn", rope_scaling_factor=8.0, rope_old_context_len=8192,
            rope_theta=500_000.0)
WINDOWED = dict(window_pattern=(5,), window_full_first=False, window_full_last=True)  # [5, 5, full]


def test_rope_per_layer_type_maps_to_rope_scaling_layers_and_back():
    """YaRN on the full-attention layers only (model.rope_scaling_layers=full, OLMo 3's
    long-context layers) is rope_parameters keyed by layer type, the sliding layers' plain
    RoPE at the same base; on every layer it is one rope_parameters; both read back."""
    full = CFG.replace(**YARN, **WINDOWED, rope_scaling_layers="full")
    hf = olmo3moe.to_config(full)
    rope = hf["rope_parameters"]
    assert set(rope) == {"full_attention", "sliding_attention"}
    assert rope["sliding_attention"] == {"rope_type": "default", "rope_theta": 500_000.0}
    assert rope["full_attention"]["rope_type"] == "yarn" and rope["full_attention"]["factor"] == 8.0
    assert olmo3moe.from_config(hf) == full

    every = full.replace(rope_scaling_layers="all")
    hf_every = olmo3moe.to_config(every)
    assert hf_every["rope_parameters"]["rope_type"] == "yarn"  # one, for every layer
    assert olmo3moe.from_config(hf_every) == every
    keyed = {**hf, "rope_parameters": {"full_attention": rope["full_attention"],
                                       "sliding_attention": rope["full_attention"]}}
    assert olmo3moe.from_config(keyed) == every  # the same scaling keyed by both types

    abf = CFG.replace(**WINDOWED, rope_theta=10_000.0, rope_scaling="abf",
                      rope_new_theta=500_000.0)
    hf_abf = olmo3moe.to_config(abf)
    assert hf_abf["rope_parameters"] == {
        "full_attention": {"rope_type": "default", "rope_theta": 500_000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}}
    assert olmo3moe.from_config(hf_abf) == abf

    plain = {"rope_type": "default", "rope_theta": 500_000.0}
    other = {**rope["full_attention"], "rope_theta": 10_000.0}  # another base under YaRN
    with pytest.raises(CheckpointError, match="rope_parameters.*full-attention layers only"):
        olmo3moe.from_config({**hf, "rope_parameters": {"full_attention": other,
                                                         "sliding_attention": plain}})
    with pytest.raises(CheckpointError, match="rope_parameters.*full-attention layers only"):
        olmo3moe.from_config({**hf, "rope_parameters": {"full_attention": plain,
                                                         "sliding_attention": rope["full_attention"]}})


def test_olmoe_export_refuses_windows():
    from olmo_jax.checkpoint.hf_config import check_representable, from_hf_config
    from olmo_jax.model.config import HF_OLMOE_LAYOUT

    cfg = TransformerConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, **HF_OLMOE_LAYOUT,
                            window_pattern=(8,), window_full_first=False)
    with pytest.raises(CheckpointError, match=r"model\.window_pattern"):
        check_representable(cfg)
    check_representable(cfg.replace(window_pattern=(-1,)))  # every layer full: fine
    with pytest.raises(CheckpointError, match="sliding_window=8.*olmo3moe"):
        from_hf_config({"model_type": "olmoe", "sliding_window": 8})
