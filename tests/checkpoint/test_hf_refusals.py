"""What the converter refuses (naming the field or tensor) instead of approximating, and
the folder formats it reads and writes: sharded safetensors with an index, bfloat16."""

import json

import numpy as np
import pytest

from olmo_jax.checkpoint import hf, safetensors_io
from olmo_jax.checkpoint.hf_config import from_hf_config, to_hf_config
from olmo_jax.checkpoint.tree import flatten_named, nest
from olmo_jax.errors import CheckpointError
from olmo_jax.model import MoEConfig, TransformerConfig
from olmo_jax.model.config import HF_OLMOE_LAYOUT
from tests.checkpoint.oracle import BASE, jax_born_model

HF = {**BASE, "model_type": "olmoe", "architectures": ["OlmoeForCausalLM"]}


@pytest.mark.parametrize(
    "change,field",
    [
        (
            {"model_type": "flex_olmo", "architectures": ["FlexOlmoForCausalLM"]},
            "model_type='flex_olmo'",
        ),
        ({"architectures": ["OlmoeForSequenceClassification"]}, "architectures="),
        ({"attention_bias": True}, "attention_bias=True"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
        ({"attention_dropout": 0.1}, "attention_dropout=0.1"),
        (
            {"rope_parameters": {"rope_type": "dynamic", "factor": 4.0, "rope_theta": 1e4}},
            "rope_parameters.rope_type='dynamic'",
        ),
        (
            {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "factor": 2.0}},
            "rope_parameters.factor",
        ),
        ({"rope_scaling": {"type": "linear", "factor": 2.0, "mscale": 1.0}}, "rope_scaling.mscale"),
        ({"head_dim": 16}, "head_dim=16"),
        ({"clip_qkv": -1.0}, "clip_qkv=-1.0"),
    ],
)
def test_unrepresentable_hf_configs_are_refused_by_field(change, field):
    with pytest.raises(CheckpointError) as e:
        from_hf_config({**HF, **change}, "my_model/config.json")
    assert "my_model/config.json" in str(e.value) and field in str(e.value), str(e.value)


def test_legacy_rope_theta_and_missing_kv_heads_are_read():
    cfg = from_hf_config({**HF, "rope_theta": 500000.0, "rope_scaling": None})
    assert cfg.rope_theta == 500000.0 and cfg.kv_heads == BASE["num_attention_heads"]
    cfg = from_hf_config({**HF, "rope_theta": 1e4, "rope_scaling": {"type": "linear", "factor": 2.0}})
    assert (cfg.rope_theta, cfg.rope_scaling, cfg.rope_scaling_factor) == (1e4, "pi", 2.0)


@pytest.mark.parametrize(
    "change,field",
    [
        ({"n_dense_layers": 1}, "model.n_dense_layers=1"),
        (
            {"moe": MoEConfig(num_experts=4, n_shared_experts=1, shared_hidden=8)},
            "model.moe.n_shared_experts=1",
        ),
        ({"moe": MoEConfig(num_experts=4, gating="sigmoid")}, "model.moe.gating='sigmoid'"),
        (
            {"moe": MoEConfig(num_experts=4, router_weight_scale=2.0)},
            "model.moe.router_weight_scale=2.0",
        ),
        ({"qk_norm": False}, "model.qk_norm=False"),
        ({"head_qk_norm": True}, "model.head_qk_norm=True"),
        ({"block_norm": "post"}, "model.block_norm='post'"),
        ({"embedding_norm": True}, "model.embedding_norm=True"),
        ({"embed_scale": 2.0}, "model.embed_scale=2.0"),
        ({"head_dim": 16}, "model.head_dim=16"),
    ],
)
def test_unrepresentable_models_are_refused_on_export(change, field):
    cfg = TransformerConfig(
        vocab_size=64, d_model=32, n_layers=2, n_heads=4, moe=MoEConfig(num_experts=4),
        **HF_OLMOE_LAYOUT,
    ).replace(**change)
    with pytest.raises(CheckpointError, match=field.replace("(", r"\(").replace(".", r"\.")):
        to_hf_config(cfg)


@pytest.fixture(scope="module")
def tensors():
    model = jax_born_model("gqa", seed=3)
    params = {k: np.asarray(v) for k, v in flatten_named(model.params).items()}
    return model.config, hf.params_to_hf(nest(params), model.config)


def test_missing_unexpected_and_misshapen_tensors_are_named(tensors):
    cfg, t = tensors
    missing = {k: v for k, v in t.items() if k != "model.layers.1.self_attn.k_norm.weight"}
    with pytest.raises(
        CheckpointError,
        match=r"'model.layers.1.self_attn.k_norm.weight' \(shape \(16,\)\) is missing",
    ):
        hf.hf_to_params(missing, cfg, "dir")
    extra = {**t, "model.layers.0.self_attn.q_proj.bias": np.zeros(32, np.float32)}
    with pytest.raises(
        CheckpointError, match="unexpected tensor 'model.layers.0.self_attn.q_proj.bias'"
    ):
        hf.hf_to_params(extra, cfg, "dir")
    wrong = {**t, "model.layers.0.mlp.gate.weight": np.zeros((5, 32), np.float32)}
    with pytest.raises(
        CheckpointError,
        match=r"'model.layers.0.mlp.gate.weight' has shape \(5, 32\) but config.json implies "
        r"\(6, 32\)",
    ):
        hf.hf_to_params(wrong, cfg, "dir")


def test_tied_head_that_differs_from_the_embedding_is_refused(tensors):
    cfg, t = tensors
    tied = cfg.replace(tie_embeddings=True)
    t = dict(t)  # an untied model's tensors: lm_head.weight differs from the embedding
    with pytest.raises(
        CheckpointError, match="tie_word_embeddings=true but lm_head.weight differs"
    ):
        hf.hf_to_params(t, tied, "dir")
    t["lm_head.weight"] = t["model.embed_tokens.weight"]  # a redundant copy is accepted
    hf.hf_to_params(t, tied, "dir")


def test_sharded_folder_with_index_and_bfloat16_round_trip(tensors, tmp_path):
    cfg, t = tensors
    config = to_hf_config(cfg, dtype="bfloat16")
    bf16 = {k: v.astype(hf.DTYPES["bfloat16"]) for k, v in t.items()}
    safetensors_io.write_folder(tmp_path / "src", config, bf16, max_shard_bytes=20_000)
    index = json.loads((tmp_path / "src" / safetensors_io.INDEX_FILE).read_text())
    assert len(set(index["weight_map"].values())) > 1
    model = hf.load_model(tmp_path / "src")  # float32 parameters, exact bf16 values
    hf.save_model(model, tmp_path / "back")  # the source's dtype (bfloat16) by default
    back = safetensors_io.read_tensors(tmp_path / "back")
    assert back.keys() == bf16.keys()
    for name, value in bf16.items():
        assert back[name].dtype == value.dtype, name
        np.testing.assert_array_equal(
            back[name].view(np.uint16), value.view(np.uint16), err_msg=name
        )


def test_the_default_olmo_core_layout_is_refused_on_export():
    """The defaults are OLMo-core's reference layout, which OlmoeForCausalLM cannot hold."""
    with pytest.raises(CheckpointError, match="orbax-to-olmo3moe|all heads"):
        to_hf_config(TransformerConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4))
