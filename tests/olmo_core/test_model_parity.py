"""Whole models against OLMo-core's own (ai2-olmo-core 3.0.0 in .venv-oracle, by
subprocess: tests/olmo_core/model_oracle.py builds, initializes and trains its
`OLMoDDPModel`): with the same weights, the same logits, LM + router losses, gradients and
weights after one AdamW step, in float32, for each block layout (pre / post / peri), with
dense and MoE blocks, per-head and whole-projection QK-norm, the scaled embedding norm,
a shared expert, softmax and sigmoid gating, and OLMo 3's long-context layers (windows
with YaRN on the full-attention layers only). The weights travel as OLMo-core's own
`convert_olmo3moe_state_to_hf` writes them and come in through olmo_jax's olmo3moe reader
(olmo_jax/checkpoint/olmo3moe.py); the gradients and updated weights go back through its
writer, so every comparison is in OLMo-core's tensor names.

Then OLMo-core's Hugging Face export itself (`_get_olmo3moe_config` + the state
converter, post and peri layouts): read into olmo_jax, the same logits; written back by
olmo_jax, the same tensors bitwise and the same config fields."""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from olmo_jax.checkpoint import olmo3moe, safetensors_io
from olmo_jax.checkpoint.hf import HFModel
from olmo_jax.model import TransformerConfig
from olmo_jax.model.config import MoEConfig
from olmo_jax.objective import loss_parts, total_loss

ROOT = Path(__file__).resolve().parents[2]
ORACLE_PY = ROOT / ".venv-oracle" / "bin" / "python"
pytestmark = pytest.mark.skipif(not ORACLE_PY.exists(), reason="no .venv-oracle (make oracle)")

B, S = 2, 16
BASE = dict(d_model=32, n_heads=4, n_kv_heads=2, eps=1e-6, rope_theta=10_000.0,
            expert_hidden=16, num_experts=4, top_k=2, dense_hidden=48, n_dense_layers=1,
            n_layers=3, vocab_size=64, init_std=0.02, seq_len=S, shared_hidden=0,
            gating="softmax", normalize_expert_weights=1.0, restore_weight_scale=True,
            lb_weight=0.015, z_weight=1e-4, head_qk_norm=True, embedding_norm=False,
            embed_scale=0.0, lr=1e-3, b1=0.9, b2=0.95, adam_eps=1e-8, weight_decay=0.1)
CASES = {
    # OLMo-core use_pre_norm, QK-norm over the whole projections, a shared expert.
    "pre": dict(block_norm="pre", head_qk_norm=False, shared_hidden=24, seed=1),
    # OLMo-core's default reordered norm, per-head QK-norm, sqrt(d_model)-scaled embedding norm.
    "post": dict(block_norm="post", embedding_norm=True, embed_scale=math.sqrt(32), seed=2),
    # peri-norm (the 1.2T's), sigmoid gating without renormalization (OLMo-core's default).
    "peri": dict(block_norm="peri", gating="sigmoid", normalize_expert_weights=None,
                 restore_weight_scale=False, seed=3),
    # OLMo 3's long-context shape: windows [W, W, W, full] (last layer full) and YaRN on the
    # full-attention layers only (`with_rope_scaling(full_attn_layers_only=True)`; olmo_jax's
    # model.rope_scaling_layers=full), over 16 tokens from an 8-token base context.
    "window_yarn": dict(block_norm="post", n_dense_layers=0, n_layers=4, seed=7,
                        window=[[5, 5, 5, -1], False, True],
                        yarn=dict(factor=4.0, beta_fast=32, beta_slow=1, old_context_len=8,
                                  full_only=True)),
}
EXPORTS = {  # OLMo-core's own HF export (no dense layers: its builder's olmo3moe)
    "export_post": dict(block_norm="post", n_dense_layers=0, embedding_norm=True,
                        embed_scale=math.sqrt(32), shared_hidden=24, seed=4, export=True),
    "export_peri": dict(block_norm="peri", n_dense_layers=0, seed=5, export=True),
    # OLMo 3's window pattern shape (SlidingWindowAttentionConfig([W, W, W, -1], first
    # False, last True)), W = 5 of the 16 tokens: its export's layer_types and
    # sliding_window read back as the same windows.
    "export_window": dict(block_norm="post", n_dense_layers=0, n_layers=4, seed=6,
                          export=True, window=[[5, 5, 5, -1], False, True]),
}
WINDOWS = {"export_window": (5, 5, 5, 0)}  # the per-layer windows OLMo-core builds (0 = full)
TOL = 1e-5  # the bound for float32 logits, losses, gradients


def _window_and_rope(c: dict) -> dict:
    """The olmo_jax fields of a case's windows and RoPE scaling."""
    out = {}
    if c.get("window"):
        pattern, first, last = c["window"]
        out.update(window_pattern=tuple(pattern), window_full_first=first, window_full_last=last)
    if c.get("yarn"):
        y = c["yarn"]
        out.update(rope_scaling="yarn", rope_scaling_factor=y["factor"],
                   rope_beta_fast=float(y["beta_fast"]), rope_beta_slow=float(y["beta_slow"]),
                   rope_old_context_len=y["old_context_len"],
                   rope_scaling_layers="full" if y["full_only"] else "all")
    return out


def olmo_jax_config(c: dict) -> TransformerConfig:
    sigmoid = c["gating"] == "sigmoid"
    renorm = c["normalize_expert_weights"] is not None
    return TransformerConfig(**_window_and_rope(c),
        vocab_size=c["vocab_size"], d_model=c["d_model"], n_layers=c["n_layers"],
        n_heads=c["n_heads"], n_kv_heads=c["n_kv_heads"], n_dense_layers=c["n_dense_layers"],
        dense_hidden=c["dense_hidden"], rope_theta=c["rope_theta"], norm_eps=c["eps"],
        init_std=c["init_std"],
        head_qk_norm=c["head_qk_norm"], block_norm=c["block_norm"],
        embed_scale=c["embed_scale"], embedding_norm=c["embedding_norm"],
        moe=MoEConfig(num_experts=c["num_experts"], top_k=c["top_k"],
                      expert_hidden=c["expert_hidden"], gating=c["gating"],
                      norm_topk_prob=renorm and not sigmoid, sigmoid_renorm=renorm,
                      sigmoid_eps=1e-7 if sigmoid else 0.0,
                      router_weight_scale=float(c["top_k"]) if c["restore_weight_scale"] else 1.0,
                      n_shared_experts=1 if c["shared_hidden"] else 0,
                      shared_hidden=c["shared_hidden"], lb_loss_coef=c["lb_weight"],
                      z_loss_coef=c["z_weight"], gmm_impl="einsum"))


@pytest.fixture(scope="module")
def oracle(tmp_path_factory):
    """One oracle subprocess for every case: {name: (case, its npz, its folder)}."""
    out = tmp_path_factory.mktemp("olmo_core")
    rng = np.random.default_rng(0)
    cases = {}
    for name, extra in {**CASES, **EXPORTS}.items():
        c = {**BASE, **extra, "name": name}
        c["tokens"] = rng.integers(0, c["vocab_size"], (B, S)).tolist()
        cases[name] = c
    (out / "spec.json").write_text(json.dumps({"cases": list(cases.values())}))
    subprocess.run([str(ORACLE_PY), str(Path(__file__).with_name("model_oracle.py")),
                    str(out / "spec.json"), str(out)], check=True, cwd=out, timeout=600,
                   capture_output=True)
    return {n: (c, np.load(out / f"{n}.npz"), out) for n, c in cases.items()}


def _part(npz, prefix: str) -> dict[str, np.ndarray]:
    return {k[len(prefix) + 1:]: npz[k] for k in npz.files if k.startswith(prefix + "/")}


def _report(what: str, got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    abs_err = float(np.max(np.abs(got - want)))
    rel = abs_err / max(float(np.max(np.abs(want))), 1e-30)
    print(f"{what}: max abs {abs_err:.2e}, rel {rel:.2e}")
    return abs_err


def _train_step(cfg: TransformerConfig, params, tokens_BS, c: dict):
    """olmo_jax's loss (the model's logits and router stats through the trainer's
    loss_parts / total_loss, over OLMo-core's labels: tokens 1.. of each instance, the last
    position unlabelled), its gradients, and one optax AdamW step."""
    model = HFModel.from_params(cfg, params)
    graphdef, state, rest = nnx.split(model.module, nnx.Param, ...)

    def loss_fn(p):
        out = nnx.merge(graphdef, p, rest)(tokens_BS)
        parts = loss_parts(out.logits_BTV[:, :-1], tokens_BS[:, 1:], out.router_stats, cfg)
        return total_loss(parts, cfg), parts.ce_sum / parts.n_tokens

    tx = optax.adamw(c["lr"], c["b1"], c["b2"], c["adam_eps"], weight_decay=c["weight_decay"])

    @jax.jit
    def step(p):
        (loss, ce), grads = jax.value_and_grad(loss_fn, has_aux=True)(p)
        updates, _ = tx.update(grads, tx.init(p), p)
        return loss, ce, grads, optax.apply_updates(p, updates)

    return step(state)


def _named(state) -> dict:
    from olmo_jax.checkpoint.tree import flatten_named, nest

    return nest({k: np.asarray(v) for k, v in flatten_named(state).items()})


@pytest.mark.parametrize("name", list(CASES))
def test_logits_losses_gradients_and_adamw_step_match_olmo_core(oracle, name):
    c, npz, _ = oracle[name]
    cfg = olmo_jax_config(c)
    params = olmo3moe.to_params(_part(npz, "before"), cfg, name)
    tokens = jnp.asarray(c["tokens"], jnp.int32)
    logits = HFModel.from_params(cfg, params)(tokens)
    assert _report(f"{name} logits", logits, npz["logits"]) <= TOL
    if c.get("yarn"):  # scaling every layer's RoPE instead does not match
        every = cfg.replace(rope_scaling_layers="all")
        assert _report(f"{name} logits, YaRN on every layer",
                       HFModel.from_params(every, params)(tokens), npz["logits"]) > 100 * TOL

    loss, ce, grads, after = _train_step(cfg, params, tokens, c)
    assert _report(f"{name} cross-entropy", ce, npz["ce"]) <= TOL
    assert _report(f"{name} loss (+ LB, router z)", loss, npz["loss"]) <= TOL
    # OLMo-core's reported loss is the cross-entropy; its router losses act through the
    # gradients only (attach_auxiliary_loss), which the gradients below compare.
    want_grads = _part(npz, "grad")
    got_grads = olmo3moe.from_params(_named(grads), cfg)
    assert set(got_grads) == set(want_grads)
    worst = max(_report(f"{name} grad {k}", got_grads[k], want_grads[k]) for k in want_grads)
    assert worst <= TOL
    # One AdamW step. Its first update is lr * g / (|g| + eps) elementwise, a sign for
    # |g| >> eps: where a gradient is itself ~eps, float32 rounding of g (compared above,
    # <= TOL) moves that ratio by O(1). So: (a) olmo_jax's AdamW given OLMo-core's
    # gradients gives OLMo-core's weights (the optimizer semantics: decoupled decay, bias
    # correction, eps); (b) from olmo_jax's own gradients, the same weights wherever
    # |g| > 1000 eps (the rest is reported).
    want_after, before = _part(npz, "after"), _part(npz, "before")
    tx = optax.adamw(c["lr"], c["b1"], c["b2"], c["adam_eps"], weight_decay=c["weight_decay"])
    from_theirs = jax.jit(lambda g, p: optax.apply_updates(p, tx.update(g, tx.init(p), p)[0]))(
        want_grads, before)
    assert max(_report(f"{name} AdamW step (OLMo-core's grads) {k}", from_theirs[k],
                       want_after[k]) for k in want_after) <= 1e-6
    got_after = olmo3moe.from_params(_named(after), cfg)
    for k in want_after:
        clear = np.abs(want_grads[k]) > 1000 * c["adam_eps"]
        _report(f"{name} AdamW step (own grads, all) {k}", got_after[k], want_after[k])
        assert _report(f"{name} AdamW step (own grads, |g| > 1000 eps) {k}",
                       np.where(clear, got_after[k], 0), np.where(clear, want_after[k], 0)) <= TOL


@pytest.mark.parametrize("name", list(EXPORTS))
def test_olmo_core_hf_export_converts_both_ways_exactly(oracle, name, tmp_path):
    c, npz, out = oracle[name]
    folder = out / f"{name}-hf"
    model = olmo3moe.load_model(folder)
    assert model.config.block_norm == c["block_norm"] and model.config.head_qk_norm
    assert model.config.layer_windows == WINDOWS.get(name, (0,) * c["n_layers"])
    logits = model(jnp.asarray(c["tokens"], jnp.int32))
    assert _report(f"{name} logits (OLMo-core's export)", logits, npz["logits"]) <= TOL
    if name in WINDOWS:  # the windows change the logits: full attention does not match
        full_cfg = model.config.replace(window_pattern=())
        full = HFModel.from_params(full_cfg, olmo3moe.to_params(_part(npz, "before"), full_cfg,
                                                                name))
        assert _report(f"{name} logits without windows", full(jnp.asarray(c["tokens"])),
                       npz["logits"]) > 100 * TOL

    olmo3moe.save_model(model, tmp_path / "back")
    want = safetensors_io.read_tensors(folder)
    got = safetensors_io.read_tensors(tmp_path / "back")
    assert set(got) == set(want)
    for k in want:  # bitwise: every tensor moved, none recomputed
        assert got[k].dtype == want[k].dtype and np.array_equal(got[k], want[k]), k
    hf, back = (safetensors_io.read_config(f) for f in (folder, tmp_path / "back"))
    for field in ("hidden_size", "num_hidden_layers", "n_routed_experts", "num_experts_per_tok",
                  "moe_intermediate_size", "shared_expert_intermediate_size", "rms_norm_eps",
                  "use_peri_ln", "use_head_qk_norm", "embed_norm", "embed_scale",
                  "normalize_expert_weights", "restore_weight_scale", "gating_function",
                  "num_key_value_heads", "head_dim", "vocab_size", "dense_layers_indices",
                  "layer_types", "sliding_window"):
        assert back[field] == hf[field], field
    assert olmo3moe.from_config(back) == model.config


def test_convert_cli_round_trips_olmo_core_export(oracle, tmp_path):
    """`python -m olmo_jax.convert olmo3moe-to-orbax` then `orbax-to-olmo3moe` (in
    process): OLMo-core's export comes back bitwise."""
    from olmo_jax import convert

    c, npz, out = oracle["export_peri"]
    folder = out / "export_peri-hf"
    assert convert.main(["olmo3moe-to-orbax", "--hf", str(folder), "--out",
                         str(tmp_path / "ckpt")]) == 0
    assert convert.main(["orbax-to-olmo3moe", "--ckpt", str(tmp_path / "ckpt"), "--out",
                         str(tmp_path / "back")]) == 0
    want, got = (safetensors_io.read_tensors(f) for f in (folder, tmp_path / "back"))
    assert set(got) == set(want) and all(np.array_equal(got[k], want[k]) for k in want)


def test_init_matches_olmo_core_normal_init(oracle):
    """OLMo-core's `normal` init (its `init_std`): every weight matrix N(0, init_std)
    truncated at 3 std, every norm weight 1; olmo_jax's init gives each tensor the same
    distribution (the draws differ; sample std within 10%, same truncation)."""
    c, npz, _ = oracle["post"]
    cfg = olmo_jax_config(c)
    from olmo_jax.model.transformer import Transformer

    ours = olmo3moe.from_params(_named(nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)),
                                                 nnx.Param, ...)[1]), cfg)
    theirs = _part(npz, "before")
    assert set(ours) == set(theirs)
    for k, want in theirs.items():
        got = ours[k]
        if k.endswith(("norm.weight", "layernorm.weight")):
            assert np.all(want == 1) and np.all(got == 1), k
            continue
        assert abs(got.std() / want.std() - 1) < 0.1, (k, got.std(), want.std())
        assert np.abs(got).max() <= 3 * c["init_std"] * (1 + 1e-6), k
        assert np.abs(want).max() <= 3 * c["init_std"] * (1 + 1e-2), k  # bfloat16-rounded
