"""Two-way parity with Hugging Face transformers' OlmoeForCausalLM (the oracle runs in
.venv-oracle, once per session: tests/checkpoint/conftest.py): logits per case, the
training loss and its gradients, HF -> orbax -> HF bitwise, olmo_jax -> HF loaded by
transformers without warnings and with our logits, and the CLI."""

import json
import runpy
import shutil
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from olmo_jax import convert
from olmo_jax.checkpoint import hf
from olmo_jax.checkpoint.hf_config import from_hf_config
from olmo_jax.checkpoint.safetensors_io import read_config, read_file, read_tensors
from olmo_jax.checkpoint.tree import flatten_named
from olmo_jax.objective import forward_losses, total_loss
from tests.checkpoint.oracle import CASES, INPUT_IDS, JAX_BORN, LOSS_BATCH, LOSS_CASE, ROOT

LOGIT_TOL = 1e-4


@pytest.fixture(scope="module")
def round_trips(hf_cases, tmp_path_factory):
    """Every case converted HF -> orbax -> HF."""
    out = tmp_path_factory.mktemp("round_trips")
    times = {}
    for name in CASES:
        t0 = time.perf_counter()
        hf.hf_to_orbax(hf_cases / name / "hf", out / name / "orbax")
        times[name] = time.perf_counter() - t0
        hf.orbax_to_hf(out / name / "orbax", out / name / "back")
    print(f"hf-to-orbax seconds per case: { {k: round(v, 3) for k, v in times.items()} }")
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers(hf_cases, case):
    model = hf.load_model(hf_cases / case / "hf")
    ref_BTV = np.load(hf_cases / case / "logits.npy")
    got_BTV = np.asarray(model(np.asarray(INPUT_IDS, np.int32)))
    assert got_BTV.dtype == np.float32 and got_BTV.shape == ref_BTV.shape
    diff = np.abs(got_BTV - ref_BTV).max()
    print(f"{case}: max |logit diff| = {diff:.3g} (max |logit| {np.abs(ref_BTV).max():.3g})")
    assert diff <= LOGIT_TOL
    if case == "clip_qkv":  # clipping is active here: without it the logits are far off
        unclipped = hf.HFModel(model.config.replace(clip_qkv=0.0), model.params, model.model_state)
        assert np.abs(np.asarray(unclipped(np.asarray(INPUT_IDS, np.int32))) - ref_BTV).max() > 1e-2
    if case == "yarn":  # the scaling is active here: plain RoPE's logits are far off
        plain = hf.HFModel(model.config.replace(rope_scaling="none", rope_scaling_factor=0.0),
                           model.params, model.model_state)
        assert np.abs(np.asarray(plain(np.asarray(INPUT_IDS, np.int32))) - ref_BTV).max() > 1e-2


def test_packed_and_per_expert_layouts_read_identically(hf_cases):
    per_expert = read_tensors(hf_cases / "base" / "hf")
    packed = read_tensors(hf_cases / "packed" / "hf")
    assert "model.layers.0.mlp.experts.gate_up_proj" in packed
    assert "model.layers.0.mlp.experts.0.gate_proj.weight" in per_expert
    cfg = from_hf_config(read_config(hf_cases / "base" / "hf"))
    a = flatten_named(hf.hf_to_params(per_expert, cfg, "per-expert"))
    b = flatten_named(hf.hf_to_params(packed, cfg, "packed"))
    assert a.keys() == b.keys()
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)


def test_loss_aux_loss_and_gradients_match_transformers(hf_cases):
    """HF's training loss (labels + output_router_logits: CE + coef * aux pooled over all
    layers) equals ours with model.moe.lb_loss_type='pooled' and z_loss_coef=0."""
    model = hf.load_model(hf_cases / LOSS_CASE / "hf")
    cfg = model.config
    assert cfg.moe.lb_loss_type == "pooled" and cfg.moe.z_loss_coef == 0.0
    assert cfg.moe.lb_loss_coef == 0.02
    ref = json.loads((hf_cases / LOSS_CASE / "loss.json").read_text())
    batch = jnp.asarray(LOSS_BATCH, jnp.int32)

    def loss_fn(params):
        parts = forward_losses(model.graphdef, params, model.model_state, batch, cfg)
        return total_loss(parts, cfg), parts

    (loss, parts), grads = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))(model.params)
    lm_loss = parts.ce_sum / parts.n_tokens
    for ours, theirs in (
        (loss, ref["loss"]),
        (lm_loss, ref["lm_loss"]),
        (parts.lb_loss, ref["aux_loss"]),
    ):
        assert abs(float(ours) - theirs) <= 1e-4 * abs(theirs), (float(ours), theirs)

    hf_grads = hf.hf_to_params(read_file(hf_cases / LOSS_CASE / "grads.safetensors"), cfg, "grads")
    ours_g, theirs_g = flatten_named(grads), flatten_named(hf_grads)
    assert ours_g.keys() == theirs_g.keys()
    worst = 0.0
    for name in ours_g:
        rel = np.abs(np.asarray(ours_g[name]) - theirs_g[name]).max() / np.abs(theirs_g[name]).max()
        worst = max(worst, rel)
        assert rel <= 1e-4, (name, rel)
    print(f"loss {float(loss):.7f} vs {ref['loss']:.7f}; worst gradient rel diff {worst:.3g}")


@pytest.mark.parametrize("case", list(CASES))
def test_hf_orbax_hf_round_trip_is_bitwise(hf_cases, round_trips, case):
    source = "base" if case == "packed" else case  # packed comes back per-expert
    original = read_tensors(hf_cases / source / "hf")
    back = read_tensors(round_trips / case / "back")
    assert original.keys() == back.keys()
    for name, tensor in original.items():
        assert back[name].dtype == tensor.dtype, name
        np.testing.assert_array_equal(back[name], tensor, err_msg=name)
    config_in = read_config(hf_cases / case / "hf")
    config_back = read_config(round_trips / case / "back")
    assert from_hf_config(config_back) == from_hf_config(config_in)
    for key in ("max_position_embeddings", "pad_token_id", "eos_token_id", "bos_token_id"):
        assert config_back[key] == config_in[key], key


@pytest.mark.parametrize("name", list(JAX_BORN))
def test_transformers_loads_orbax_to_hf_exports(hf_cases, name):
    """olmo_jax-initialized checkpoints exported with orbax-to-hf: from_pretrained reports
    no missing / unexpected / mismatched keys and no warning, and computes our logits."""
    info = json.loads((hf_cases / "loaded" / name / "info.json").read_text())
    for key in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs"):
        assert info[key] == [], (key, info[key])
    assert info["warnings"] == [], info["warnings"]
    theirs = np.load(hf_cases / "loaded" / name / "logits.npy")
    diff = np.abs(theirs - np.load(hf_cases / name / "jax_logits.npy")).max()
    print(f"{name}: max |logit diff| = {diff:.3g}")
    assert diff <= LOGIT_TOL


def test_cli_round_trip(hf_cases, tmp_path):
    res = subprocess.run(
        [sys.executable, "-m", "olmo_jax.convert", "--help"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert res.returncode == 0 and "hf-to-orbax" in res.stdout and "orbax-to-hf" in res.stdout
    out = tmp_path / "orbax"
    assert (
        convert.main(["hf-to-orbax", "--hf", str(hf_cases / "base" / "hf"), "--out", str(out)]) == 0
    )
    assert (out / "checkpoints" / "0" / "model").is_dir() and (out / "config.py").is_file()
    assert convert.main(["orbax-to-hf", "--ckpt", str(out), "--out", str(tmp_path / "hf")]) == 0
    original, back = read_tensors(hf_cases / "base" / "hf"), read_tensors(tmp_path / "hf")
    assert original.keys() == back.keys()
    assert all(np.array_equal(original[k], back[k]) for k in original)
    # Converting into a non-empty folder is refused (exit status 2, nothing overwritten).
    assert convert.main(["orbax-to-hf", "--ckpt", str(out), "--out", str(tmp_path / "hf")]) == 2


def test_tokenizer_next_to_the_weights_is_copied_and_configured(hf_cases, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(hf_cases / "base" / "hf", src)
    (src / "tokenizer.json").write_text('{"model": "stand-in"}')
    config_py = hf.hf_to_orbax(src, tmp_path / "out")
    cfg = runpy.run_path(str(config_py))["get_config"]()
    assert cfg.data.tokenizer == str(tmp_path / "out" / "tokenizer.json")
    assert (tmp_path / "out" / "tokenizer.json").read_text() == '{"model": "stand-in"}'
