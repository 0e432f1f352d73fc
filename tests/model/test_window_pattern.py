"""Per-layer sliding windows (model.window_pattern, OLMo-core's SlidingWindowAttentionConfig):
the layers' windows as OLMo-core resolves them, bad patterns refused by name, and a 4-layer
model (a dense first block, then MoE blocks) with windows [W, W, W, full] gives the loss
and gradients of a naive float32 reference that runs each layer's attention under its full
[T, T] mask (causal, window, documents), in every CPU core, with and without document
masking; the windows matter, a model with one window compiles no switch, and generation's
prefill applies the windows too."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from olmo_jax.errors import ConfigError
from olmo_jax.model import Transformer
from olmo_jax.model.config import MoEConfig, TransformerConfig
from olmo_jax.model.rope import apply_rope
from olmo_jax.model.transformer import position_tables
from olmo_jax.objective import document_segments

W, T, EOS = 40, 256, 3
WINDOWS = (W, W, W, 0)  # the expected per-layer windows of CFG (0 = full)
CFG = TransformerConfig(
    vocab_size=64, d_model=32, n_layers=4, n_heads=4, n_kv_heads=2, n_dense_layers=1,
    dense_hidden=64, moe=MoEConfig(num_experts=4, top_k=2, expert_hidden=32),
    window_pattern=(W, W, W, -1), window_full_first=False, window_full_last=True)


@pytest.mark.parametrize("kw, expected", [
    ({}, (0,) * 6),  # off by default
    ({"window_pattern": (8, 8, 8, -1)}, (0, 8, 8, 8, 0, 0)),  # OLMo-core's defaults: both forced
    ({"window_pattern": (8, 8, 8, -1), "window_full_first": False}, (8, 8, 8, 0, 8, 0)),
    ({"window_pattern": (8, 16), "window_full_last": False}, (0, 8, 16, 8, 16, 8)),
    ({"window_pattern": (8,), "window_full_first": False, "window_full_last": False},
     (8,) * 6),
])
def test_layer_windows_resolve_as_olmo_core(kw, expected):
    cfg = TransformerConfig(n_layers=6, **kw).validate()
    assert cfg.layer_windows == expected
    assert cfg.window_choices == tuple(sorted(set(expected)))
    assert [cfg.window_choices[i] for i in cfg.layer_window_index] == list(expected)


@pytest.mark.parametrize("pattern", [(0,), (8, -2), (8.5,), (True,), "8"])
def test_bad_window_patterns_name_the_field_and_the_fix(pattern):
    with pytest.raises(ConfigError, match=r"model\.window_pattern.*-1.*full attention"):
        TransformerConfig(window_pattern=pattern).validate()


def test_a_saved_configs_list_reads_as_a_tuple():
    cfg = TransformerConfig(window_pattern=[8, -1])
    assert cfg.window_pattern == (8, -1) and hash(cfg) == hash(cfg.replace())


def _naive_attention(attn, x_BTD, cos, sin, seg_BT, window):
    """The layer's attention from its weights, softmax under a full [T, T] mask."""
    q = jnp.einsum("btd,dnh->btnh", x_BTD, attn.q_proj[...])
    k = jnp.einsum("btd,dkh->btkh", x_BTD, attn.k_proj[...])
    v = jnp.einsum("btd,dkh->btkh", x_BTD, attn.v_proj[...])
    q, k = apply_rope(attn.q_norm(q), cos, sin), apply_rope(attn.k_norm(k), cos, sin)
    G = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, G, axis=2), jnp.repeat(v, G, axis=2)
    s = jnp.einsum("btnh,bsnh->bnts", q, k) / np.sqrt(q.shape[-1])
    t, a = jnp.arange(x_BTD.shape[1])[:, None], jnp.arange(x_BTD.shape[1])[None, :]
    mask = (a <= t) & ((t - a < window) if window else True)
    mask = mask[None] & (seg_BT[:, :, None] == seg_BT[:, None, :])
    p = jax.nn.softmax(jnp.where(mask[:, None], s, -jnp.inf), axis=-1)
    o = jnp.einsum("bnts,bsnh->btnh", p, v)
    return jnp.einsum("btnh,nhd->btd", o, attn.o_proj[...])


def _naive_logits(model, tokens_BT, seg_BT, windows):
    """Layer by layer in Python (no scan, no cores): the blocks' norms and feed-forwards,
    the attention of `_naive_attention` with each layer's window."""
    cfg = model.cfg
    x = model.embed(tokens_BT)
    cos, sin = position_tables(cfg, tokens_BT.shape[1], segment_ids_BT=seg_BT)
    seg = jnp.zeros_like(tokens_BT) if seg_BT is None else seg_BT
    layer = 0
    for stack in (model.dense_blocks, model.moe_blocks):
        graphdef, state = nnx.split(stack)
        for i in range(jax.tree.leaves(state)[0].shape[0]):
            block = nnx.merge(graphdef, jax.tree.map(lambda a, i=i: a[i], state))
            a = _naive_attention(block.attn, x, cos, sin, seg, windows[layer])
            h = x + block.attn_norm(a)  # the post layout (CFG's default)
            f = block.ffn(h)[0] if block.is_moe else block.ffn(h)
            x = h + block.ffn_norm(f)
            layer += 1
    return model.head(x)


@pytest.fixture(scope="module")
def setup():
    rng = np.random.default_rng(0)
    tokens = rng.integers(4, CFG.vocab_size, (2, T)).astype(np.int32)
    tokens[0, [30, 100, 101, 200]] = EOS  # documents shorter and longer than the window
    tokens[1, [150]] = EOS
    probe = rng.standard_normal((2, T, CFG.vocab_size)).astype(np.float32)
    graphdef, state = nnx.split(Transformer(CFG, rngs=nnx.Rngs(0)))
    return jnp.asarray(tokens), jnp.asarray(probe), graphdef, state


def _loss_fn(cfg, tokens, probe, docs, naive=False):
    graphdef = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)))[0]

    def loss(st):
        model = nnx.merge(graphdef, st)
        seg = document_segments(tokens, cfg.replace(doc_mask_eos=EOS)) if docs else None
        if naive:
            logits = _naive_logits(model, tokens, seg, WINDOWS)
        else:
            logits = model(tokens, segment_ids_BT=seg).logits_BTV
        return jnp.sum(jnp.sin(logits) * probe)

    return loss


def _loss_and_grads(cfg, state, tokens, probe, docs, naive=False):
    return jax.jit(jax.value_and_grad(_loss_fn(cfg, tokens, probe, docs, naive)))(state)


@pytest.fixture(scope="module")
def naive(setup):
    tokens, probe, _, state = setup
    return {docs: _loss_and_grads(CFG, state, tokens, probe, docs, naive=True)
            for docs in (False, True)}


@pytest.mark.parametrize("impl, docs", [("xla", False), ("xla", True), ("blas", True)])
def test_windowed_layers_match_the_naive_masked_reference(setup, naive, impl, docs):
    tokens, probe, _, state = setup
    cfg = CFG.replace(attention_impl=impl)
    loss, grads = _loss_and_grads(cfg, state, tokens, probe, docs)
    ref_loss, ref_grads = naive[docs]
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads), strict=True):
        np.testing.assert_allclose(g, r, atol=1e-5 * max(1.0, float(jnp.max(jnp.abs(r)))))
    # forward only: a smaller program than the loss and gradients
    full_loss = jax.jit(_loss_fn(cfg.replace(window_pattern=()), tokens, probe, docs))(state)
    assert abs(float(full_loss) - float(ref_loss)) > 1e-2 * abs(float(ref_loss)), \
        "the windows must change the result"


def test_one_window_compiles_no_switch_and_two_do(setup):
    tokens, _, graphdef, state = setup

    def hlo(cfg):
        gd = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)))[0]
        return jax.jit(lambda st: nnx.merge(gd, st)(tokens[:, :64]).logits_BTV).lower(
            state).as_text()

    assert "case" in hlo(CFG.replace(attention_impl="xla"))  # stablehlo.case: lax.switch
    assert "case" not in hlo(CFG.replace(attention_impl="xla", window_pattern=()))
    assert "case" not in hlo(CFG.replace(attention_impl="xla", window_pattern=(W,),
                                         window_full_last=False))


def test_generation_applies_the_windows(setup):
    """The KV-cache decoder: a 64-token prefill, then 16 teacher-forced one-token steps,
    equal the full forward's logits (windows of 40 cut both)."""
    from olmo_jax.model import decode

    tokens, _, _, state = setup
    P, n = 64, 16
    cfg = CFG.replace(attention_impl="xla")
    model = nnx.merge(nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)))[0], state)
    want = np.asarray(jax.jit(lambda t: model(t).logits_BTV)(tokens[:, :P + n]))
    _, params, model_state = nnx.split(model, nnx.Param, ...)

    @jax.jit
    def run(cache, tokens_BT, index):
        return decode.forward(decode.decoder(cfg, params, model_state), tokens_BT, cache, index)

    cache = decode.init_cache(cfg, 2, P + n, jnp.zeros((2,), jnp.int32))
    logits, cache = run(cache, tokens[:, :P], 0)
    got = [np.asarray(logits)]
    for i in range(n):
        logits, cache = run(cache, tokens[:, P + i:P + i + 1], jnp.int32(P + i))
        got.append(np.asarray(logits))
    np.testing.assert_allclose(np.concatenate(got, axis=1), want, atol=2e-5)
