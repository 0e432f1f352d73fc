"""RoPE scaling (model.rope_scaling: abf | pi | stepwise | yarn) against OLMo-core's
nn/rope.py (`compute_scaled_inv_freq`, `RotaryEmbedding`'s tables) and Hugging Face's
(`OlmoeRotaryEmbedding` of the config.json olmo_jax exports), by one subprocess in
.venv-oracle; the Hugging Face `rope_parameters` round trip, OLMo-core's own `rope_scaling`
export read back, and the refusals that name the field."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from olmo_jax.checkpoint import olmo3moe
from olmo_jax.checkpoint.hf_config import from_hf_config, rope_fields_of, to_hf_config
from olmo_jax.errors import CheckpointError, ConfigError
from olmo_jax.model import MoEConfig, TransformerConfig
from olmo_jax.model.config import HF_OLMOE_LAYOUT
from olmo_jax.model.rope import inv_freq, rope_tables, scaling_of

ROOT = Path(__file__).resolve().parents[2]
ORACLE_PY = ROOT / ".venv-oracle" / "bin" / "python"
pytestmark = pytest.mark.skipif(not ORACLE_PY.exists(), reason="no .venv-oracle (make oracle)")

T = 2048  # positions: past every case's old_context_len (float32 angles stay within 1e-6)
TOL = 1e-6
# rope_theta, rope_scaling, then the numbers
# The fields of the tables (not rope_scaling_layers: which layers they apply to).
ROPE_FIELDS = [f for f in TransformerConfig.__dataclass_fields__
               if f.startswith("rope_") and f != "rope_scaling_layers"]
# name -> (head_dim, rope_theta, kind, OLMo-core's scaling fields, olmo_jax's model fields);
# the *_default cases leave olmo_jax's 0 = OLMo-core's default.
CASES = {
    "abf_default": (64, 500_000.0, "abf", {}, {}),
    "abf": (32, 10_000.0, "abf", {"new_theta": 1_000_000, "attention_rescale_factor": 1.25},
            {"rope_new_theta": 1e6, "rope_attention_factor": 1.25}),
    "pi_default": (32, 500_000.0, "pi", {}, {}),
    "pi": (64, 10_000.0, "pi", {"factor": 4.0}, {"rope_scaling_factor": 4.0}),
    "stepwise_default": (64, 500_000.0, "stepwise", {"old_context_len": 512},
                         {"rope_old_context_len": 512}),
    "stepwise": (128, 500_000.0, "stepwise",
                 {"factor": 16.0, "old_context_len": 1024, "low_freq_proportion": 0.1,
                  "high_freq_proportion": 0.3},
                 {"rope_scaling_factor": 16.0, "rope_old_context_len": 1024,
                  "rope_low_freq_proportion": 0.1, "rope_high_freq_proportion": 0.3}),
    "yarn_default": (128, 10_000.0, "yarn", {"old_context_len": 2048},
                     {"rope_old_context_len": 2048}),
    "yarn": (64, 500_000.0, "yarn",
             {"factor": 4.0, "old_context_len": 1024, "beta_fast": 16, "beta_slow": 2},
             {"rope_scaling_factor": 4.0, "rope_old_context_len": 1024, "rope_beta_fast": 16.0,
              "rope_beta_slow": 2.0}),
}


def model(name: str) -> TransformerConfig:
    """An OLMoE-layout model (exportable to Hugging Face) with the case's RoPE."""
    head_dim, theta, kind, _, fields = CASES[name]
    return TransformerConfig(
        vocab_size=64, d_model=2 * head_dim, n_layers=1, n_heads=2, rope_theta=theta,
        rope_scaling=kind, **fields, **HF_OLMOE_LAYOUT,
        moe=MoEConfig(num_experts=4, top_k=2, expert_hidden=16)).validate()


def exportable(name: str) -> bool:
    return name != "abf"  # Hugging Face's default RoPE has no attention factor


@pytest.fixture(scope="module")
def oracle(tmp_path_factory):
    out = tmp_path_factory.mktemp("rope")
    cases = [{"name": n, "head_dim": h, "theta": theta, "kind": kind, "olmo_core": oc,
              "hf": to_hf_config(model(n)) if exportable(n) else
              to_hf_config(model(n).replace(rope_attention_factor=0.0))}
             for n, (h, theta, kind, oc, _) in CASES.items()]
    (out / "in.json").write_text(json.dumps({"T": T, "cases": cases}))
    subprocess.run([str(ORACLE_PY), str(Path(__file__).with_name("rope_oracle.py")),
                    str(out / "in.json"), str(out / "out.npz"), str(out / "out.json")],
                   check=True, timeout=300, capture_output=True)
    return np.load(out / "out.npz"), json.loads((out / "out.json").read_text())


@pytest.mark.parametrize("name", list(CASES))
def test_tables_equal_olmo_core(oracle, name):
    want, _ = oracle
    cfg = model(name)
    inv, factor = jax.jit(lambda: inv_freq(cfg.head_size, cfg.rope_theta, scaling_of(cfg))[0])(), \
        inv_freq(cfg.head_size, cfg.rope_theta, scaling_of(cfg))[1]
    np.testing.assert_allclose(np.asarray(inv), want[f"{name}/inv"], rtol=TOL)
    np.testing.assert_allclose(factor, float(want[f"{name}/factor"]), rtol=1e-12)
    # The tables, op by op: a fused (jitted) cos / sin on XLA:CPU drifts from torch's by
    # ~1e-4 at position 2048 for plain RoPE as much as for a scaled one.
    cos, sin = rope_tables(jnp.arange(T), cfg.head_size, cfg.rope_theta, scaling_of(cfg))
    scale = TOL * max(1.0, factor)  # 1e-6 of the tables' magnitude (YaRN's factor > 1)
    np.testing.assert_allclose(np.asarray(cos), want[f"{name}/cos"], atol=scale, rtol=0)
    np.testing.assert_allclose(np.asarray(sin), want[f"{name}/sin"], atol=scale, rtol=0)
    # and the scaling is not a no-op: plain RoPE's tables differ
    plain_cos, _ = rope_tables(jnp.arange(T), cfg.head_size, cfg.rope_theta)
    assert np.abs(np.asarray(plain_cos) - want[f"{name}/cos"]).max() > 1e-2


@pytest.mark.parametrize("name", [n for n in CASES if exportable(n)])
def test_hugging_face_export_computes_the_same_rope_and_reads_back(oracle, name):
    want, _ = oracle
    cfg = model(name)
    np.testing.assert_allclose(want[f"{name}/hf_inv"], want[f"{name}/inv"], rtol=TOL)
    np.testing.assert_allclose(float(want[f"{name}/hf_factor"]), float(want[f"{name}/factor"]),
                               rtol=1e-12)
    back = from_hf_config(to_hf_config(cfg))
    if cfg.rope_scaling == "abf":  # Hugging Face's default RoPE at the new base
        assert (back.rope_scaling, back.rope_theta) == ("none", scaling_of(cfg).resolved_new_theta)
    else:
        np.testing.assert_allclose(  # the stepwise proportions go through 1 / x and back
            np.asarray(inv_freq(back.head_size, back.rope_theta, scaling_of(back))[0]),
            np.asarray(inv_freq(cfg.head_size, cfg.rope_theta, scaling_of(cfg))[0]), rtol=1e-7)
        assert (back.rope_theta, back.rope_scaling) == (cfg.rope_theta, cfg.rope_scaling)
        for f in ROPE_FIELDS[2:]:  # the stepwise proportions went through 1 / x and back
            assert getattr(back, f) == pytest.approx(getattr(cfg, f), rel=1e-12, abs=1e-15) \
                or f == "rope_scaling_factor", f
        assert back.rope_scaling_factor == scaling_of(cfg).resolved_factor  # 0 written out
    out = olmo3moe.to_config(_olmo3moe_layout(cfg))
    assert olmo3moe.from_config(out).rope_scaling == back.rope_scaling


def _olmo3moe_layout(cfg: TransformerConfig) -> TransformerConfig:
    return cfg.replace(block_norm="post", head_qk_norm=True)


@pytest.mark.parametrize("name", [n for n in CASES if CASES[n][2] != "abf"])
def test_olmo_core_rope_scaling_export_reads_as_the_same_tables(oracle, name):
    """OLMo-core's olmo3moe config.json carries `rope_theta` and its `to_hf_config()` as the
    legacy `rope_scaling`."""
    want, exported = oracle
    head_dim, theta, *_ = CASES[name]
    fields = rope_fields_of({"rope_theta": theta, "rope_scaling": exported[name]}, "config.json")
    cfg = TransformerConfig(d_model=2 * head_dim, n_heads=2, **fields).validate()
    np.testing.assert_allclose(np.asarray(inv_freq(head_dim, theta, scaling_of(cfg))[0]),
                               want[f"{name}/inv"], rtol=TOL)
    assert inv_freq(head_dim, theta, scaling_of(cfg))[1] == pytest.approx(
        float(want[f"{name}/factor"]), rel=1e-12)


@pytest.mark.parametrize("params,field", [
    ({"rope_type": "dynamic", "factor": 2.0}, "rope_parameters.rope_type='dynamic'"),
    ({"rope_type": "longrope", "factor": 2.0}, "rope_parameters.rope_type='longrope'"),
    ({"rope_type": "yarn", "factor": 2.0}, "rope_parameters.original_max_position_embeddings"),
    ({"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 64, "mscale": 1.0},
     "rope_parameters.mscale"),
    ({"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 64,
      "truncate": False}, "rope_parameters.truncate"),
    ({"rope_type": "linear", "factor": 2.0, "partial_rotary_factor": 0.5},
     "rope_parameters.partial_rotary_factor"),
    ({"rope_type": "linear"}, "rope_parameters.factor"),
    # the YaRN ramp past head_dim / 2 - 1, where HF and OLMo-core differ
    ({"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 10 ** 9},
     "model.rope_beta_slow"),
])
def test_unrepresentable_hf_rope_is_refused_by_field(params, field):
    hf = {**to_hf_config(model("pi")), "rope_parameters": {"rope_theta": 1e4, **params}}
    with pytest.raises(CheckpointError, match=field.replace(".", r"\.").replace("(", r"\(")):
        from_hf_config(hf, "config.json")


@pytest.mark.parametrize("change,field", [
    ({"rope_scaling": "ntk"}, "model.rope_scaling='ntk'"),
    ({"rope_scaling_factor": 2.0}, "model.rope_scaling_factor=2.0 has no effect"),
    ({"rope_scaling": "yarn", "rope_beta_slow": 40.0}, "model.rope_beta_slow=40.0"),
    ({"rope_scaling": "stepwise", "rope_low_freq_proportion": 0.8}, "model.rope_low_freq_proportion"),
    ({"rope_scaling": "pi", "rope_scaling_factor": -1.0}, "model.rope_scaling_factor must be >= 0"),
])
def test_bad_rope_fields_are_refused_by_name(change, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        TransformerConfig(**change).validate()


def test_a_legacy_rope_scaling_that_disagrees_is_refused():
    hf = {**to_hf_config(model("pi")), "rope_scaling": {"type": "yarn", "factor": 4.0}}
    with pytest.raises(CheckpointError, match=r"rope_scaling=.*disagrees with rope_parameters"):
        from_hf_config(hf, "config.json")
    same = {**to_hf_config(model("pi")), "rope_scaling": {"type": "linear", "factor": 2.0}}
    assert from_hf_config(same).rope_scaling == "pi"

