"""Upcycling and expert surgery (olmo_jax/checkpoint/upcycle.py, surgery.py), each by its
defining property, in float32 on tiny random models:
  dense -> E copies (weights summing to 1): the same logits as the dense model (1e-6);
  granular (E*g experts, top k*g, w_down x g): the same logits; without the g scale not;
  noise: copies differ from the MLP by the asked relative std;
  duplicate x n (router rows copied, top-k x n): the same logits;
  prune to the most-used experts of a recorded expert_counts.jsonl: those kept, and the
  same logits on the tokens the counts were recorded on;
  top-k: weights untouched, k experts routed per token;
and the CLI end to end (python -m olmo_jax.convert upcycle / experts): checkpoints in,
checkpoints out, the optimizer state dropped with a message."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from olmo_jax import convert
from olmo_jax.checkpoint import hf, rewrite, surgery, upcycle
from olmo_jax.checkpoint.tree import flatten_named
from olmo_jax.model import TransformerConfig
from olmo_jax.model.abstract import abstract_model
from olmo_jax.model.config import HF_OLMOE_LAYOUT, MoEConfig
from olmo_jax.trainer.logger import ExpertCountsLog

TOL = 1e-6  # max |a - b| / max |b|, float32
IDS = np.asarray(np.random.default_rng(0).integers(0, 64, (2, 12)), np.int32)


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def dense_model(layers=3, hidden=64, seed=0, layout=None) -> hf.HFModel:
    # init_std 0.2: the MLPs change the logits by far more than the tolerance (checked).
    cfg = TransformerConfig(vocab_size=64, d_model=32, n_layers=layers, n_heads=2,
                            n_dense_layers=layers, dense_hidden=hidden, init_std=0.2,
                            **(layout or {}))
    return _model(cfg, seed)


def moe_model(gating="topk_softmax", norm=False, E=8, k=2, seed=0, bias=0.0) -> hf.HFModel:
    moe = MoEConfig(num_experts=E, top_k=k, expert_hidden=16, gating=gating,
                    norm_topk_prob=norm, bias_rate=bias)
    cfg = TransformerConfig(vocab_size=64, d_model=32, n_layers=3, n_heads=2, n_dense_layers=1,
                            dense_hidden=48, init_std=0.2, moe=moe)
    return _model(cfg, seed)


def _model(cfg, seed):
    """Random weights N(0, init_std^2), norms 1, for every leaf of the architecture (numpy:
    an eager nnx init of the MoE takes seconds on this machine)."""
    rng = np.random.default_rng(seed)
    _, params, state = abstract_model(cfg)
    flat = {k: (np.ones(x.shape, np.float32) if "norm" in k else
                (cfg.init_std * rng.standard_normal(x.shape)).astype(np.float32))
            for k, x in flatten_named(params).items()}
    biases = {k: np.zeros(x.shape, np.float32) for k, x in flatten_named(state).items()}
    return rewrite.build_model(cfg, flat, biases)


def transformed(model, fn):
    cfg, p, s = fn(model.config, rewrite.flat_numpy(model.params), rewrite.flat_numpy(model.model_state))
    return rewrite.build_model(cfg, p, s)


def test_mlps_matter_at_this_scale():
    m = dense_model()
    flat = rewrite.flat_numpy(m.params)
    flat = {k: (0 * v if "ffn/w_down" in k else v) for k, v in flat.items()}
    assert rel_err(rewrite.build_model(m.config, flat, {})(IDS), m(IDS)) > 1e-2


@pytest.mark.parametrize("gating,norm,keep_dense,shared", [
    ("topk_softmax", False, 0, False), ("softmax", True, 1, False), ("sigmoid", False, 0, True)])
def test_upcycled_copies_give_the_dense_logits(gating, norm, keep_dense, shared):
    dense = dense_model()
    spec = upcycle.UpcycleSpec(4, 2, keep_dense=keep_dense, shared=shared, gating=gating,
                               norm_topk_prob=norm)
    moe = transformed(dense, lambda c, p, s: upcycle.upcycle(c, p, spec, s))
    c = moe.config
    assert (c.moe.num_experts, c.moe.top_k, c.n_dense_layers, c.moe.n_shared_experts) == \
        (4, 2, keep_dense, int(shared))
    err = rel_err(moe(IDS), dense(IDS))
    print(f"upcycle {gating} norm={norm} keep_dense={keep_dense} shared={shared}: {err:.2e}")
    assert err <= TOL


def test_granular_upcycling_is_exact_with_the_g_scale():
    # Pre-norm: the post-norm default would normalize away a wrong output scale.
    dense = dense_model(layout=HF_OLMOE_LAYOUT)
    spec = upcycle.UpcycleSpec(2, 1, granularity=4)
    moe = transformed(dense, lambda c, p, s: upcycle.upcycle(c, p, spec, s))
    m = moe.config.moe
    assert (m.num_experts, m.top_k, m.expert_hidden) == (8, 4, 16)
    err = rel_err(moe(IDS), dense(IDS))
    print(f"granular upcycle E=2 g=4: {err:.2e}")
    assert err <= TOL
    router = np.asarray(moe.params["moe_blocks"]["ffn"]["router"]["weight"][...])
    assert np.array_equal(router[..., 0], router[..., 3]) and not np.allclose(router[..., 0],
                                                                              router[..., 4])

    def unscaled(c, p, s):  # the same slices without w_down x g
        new, out, st = upcycle.upcycle(c, p, spec, s)
        out["moe_blocks/ffn/experts/w_down"] = out["moe_blocks/ffn/experts/w_down"] / 4
        return new, out, st
    assert rel_err(transformed(dense, unscaled)(IDS), dense(IDS)) > 1e-3


def test_noise_perturbs_each_copy_by_the_relative_std():
    dense = dense_model()
    spec = upcycle.UpcycleSpec(4, 2, noise=0.05)
    cfg, p, _ = upcycle.upcycle(dense.config, rewrite.flat_numpy(dense.params), spec)
    w = rewrite.flat_numpy(dense.params)["dense_blocks/ffn/w_gate"]  # [L, D, F]
    experts = p["moe_blocks/ffn/experts/w_gate"]  # [L, E, D, F]
    delta = experts - w[:, None]
    ratio = delta.std(axis=(2, 3)) / w.std(axis=(1, 2))[:, None]
    assert np.allclose(ratio, 0.05, rtol=0.1)
    assert not np.allclose(experts[:, 0], experts[:, 1])
    assert rel_err(rewrite.build_model(cfg, p, {})(IDS), dense(IDS)) > TOL


@pytest.mark.parametrize("gating,norm,bias", [("softmax", False, 0.0), ("topk_softmax", False, 0.01),
                                             ("sigmoid", False, 0.0)])
def test_duplicating_experts_keeps_the_logits(gating, norm, bias):
    moe = moe_model(gating, norm, bias=bias)
    dup = transformed(moe, lambda c, p, s: surgery.duplicate(c, p, s, 2))
    assert (dup.config.moe.num_experts, dup.config.moe.top_k) == (16, 4)
    r = np.asarray(dup.params["moe_blocks"]["ffn"]["router"]["weight"][...])
    assert np.array_equal(r[..., 0::2], r[..., 1::2])  # router rows copied
    err = rel_err(dup(IDS), moe(IDS))
    print(f"duplicate x2 {gating}: {err:.2e}")
    assert err <= TOL


def _counts(model, ids) -> np.ndarray:
    """[L_moe, E] routed assignments of the model's forward on `ids`."""
    def counts(params, state, ids):
        return nnx.merge(model.graphdef, params, state)(ids).router_stats.counts_E
    out = jax.jit(counts)(model.params, model.model_state, jnp.asarray(ids))
    return np.asarray(out).astype(np.int64)


def test_prune_keeps_the_most_used_experts_and_their_tokens_logits(tmp_path):
    moe = moe_model("topk_softmax", E=8, k=1)
    ids = IDS[:1, :6]  # 6 tokens, top-1: at most 6 of the 8 experts used per block
    counts = _counts(moe, ids)
    first = moe.config.n_dense_layers
    log = ExpertCountsLog(tmp_path, every=1, first_block=first)  # the trainer's writer
    half = counts // 2
    for step, c in ((1, half), (2, counts - half)):
        log.maybe_write(step, {"expert_counts": c})
    log.close()
    read = surgery.read_counts(tmp_path, moe.config)
    assert np.array_equal(read, counts)
    keep = surgery.kept_experts(read, 6)
    assert all(set(np.flatnonzero(counts[layer])) <= set(keep[layer]) for layer in range(2))
    pruned = transformed(moe, lambda c, p, s: surgery.prune(c, p, s, 6, read))
    assert pruned.config.moe.num_experts == 6
    w = rewrite.flat_numpy(moe.params)["moe_blocks/ffn/experts/w_up"]
    got = rewrite.flat_numpy(pruned.params)["moe_blocks/ffn/experts/w_up"]
    assert np.array_equal(got[1], w[1, keep[1]])
    err = rel_err(pruned(ids), moe(ids))
    print(f"prune 8 -> 6 on the recorded tokens: {err:.2e}")
    assert err <= TOL
    assert rel_err(pruned(IDS), moe(IDS)) > TOL  # other tokens did use pruned experts


def test_least_used_experts_are_pruned_ties_keep_the_lower_id():
    counts = np.array([[5, 0, 9, 0, 3], [1, 1, 1, 1, 7]])
    assert surgery.kept_experts(counts, 3).tolist() == [[0, 2, 4], [0, 1, 4]]


def test_top_k_change_routes_k_experts_and_keeps_the_weights():
    moe = moe_model("topk_softmax", k=2)
    k3 = transformed(moe, lambda c, p, s: surgery.set_top_k(c, p, s, 3))
    assert k3.config.moe.top_k == 3
    a, b = rewrite.flat_numpy(moe.params), rewrite.flat_numpy(k3.params)
    assert all(np.array_equal(a[k], b[k]) for k in a)
    assert np.all(_counts(k3, IDS).sum(axis=1) == IDS.size * 3)
    assert rel_err(k3(IDS), moe(IDS)) > TOL


def test_cli_upcycles_and_operates_on_checkpoints(tmp_path, capsys):
    dense = dense_model()
    hf.save_init_checkpoint(tmp_path / "dense", dense, "test", "test", "dense test model")
    assert convert.main(["upcycle", "--ckpt", str(tmp_path / "dense"), "--out", str(tmp_path / "moe"),
                         "--experts", "4", "--top-k", "2", "--granularity", "2"]) == 0
    out = capsys.readouterr().out
    assert "same logits as the dense model" in out and "optimizer state dropped" in out
    moe = hf.load_checkpoint(tmp_path / "moe")
    assert (moe.config.moe.num_experts, moe.config.moe.top_k) == (8, 4)
    assert rel_err(moe(IDS), dense(IDS)) <= TOL
    assert convert.main(["experts", "--ckpt", str(tmp_path / "moe"), "--out", str(tmp_path / "dup"),
                         "--duplicate", "2"]) == 0
    assert rel_err(hf.load_checkpoint(tmp_path / "dup")(IDS), dense(IDS)) <= TOL
    assert convert.main(["upcycle", "--ckpt", str(tmp_path / "moe"), "--out", str(tmp_path / "x"),
                         "--experts", "2", "--top-k", "1"]) == 2  # already an MoE: refused
    assert "upcycle takes a dense model" in capsys.readouterr().err
