"""The chunked LM-head loss (model.lm_loss_chunk, model/lm_loss.py) against the whole-logits
loss: the cross-entropy and z-loss sums and their gradients (h, w; and a whole model's,
tied and untied, through the train step's gradient function) within 1e-6 relative in
float32, and the compiled step holds no float32 [tokens, vocab] buffer."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from olmo_jax.labels import FILTERED, NO_LABEL
from olmo_jax.model import Transformer, TransformerConfig
from olmo_jax.model.lm_loss import chunked_lm_losses
from olmo_jax.objective import cross_entropy_sums, labelled
from olmo_jax.trainer.step import make_grads_fn

TOL = 1e-6


def _targets(rng, B, T, V):
    """Token targets with unlabelled positions and one filtered instance."""
    t = rng.integers(0, V, (B, T)).astype(np.int32)
    t[0, :3] = NO_LABEL
    t[1, -1] = FILTERED  # row 1: counted, not in the loss
    return jnp.asarray(t)


@pytest.mark.parametrize("chunk", [7, 64])  # 7: the last chunk padded; 64 > the tokens
def test_sums_and_gradients_equal_the_whole_logits_loss(chunk):
    rng = np.random.default_rng(0)
    B, T, D, V = 3, 16, 8, 50
    h = jnp.asarray(rng.normal(size=(B * T, D)), jnp.float32)
    w = jnp.asarray(2 * rng.normal(size=(D, V)), jnp.float32)
    targets = _targets(rng, B, T, V)
    loss_BT = labelled(targets)[0]

    def whole(h, w):
        return cross_entropy_sums((h @ w).reshape(B, T, V), targets)

    def chunked(h, w):
        return chunked_lm_losses(h, w, targets.reshape(-1), loss_BT.reshape(-1), chunk)

    for a, b in zip(whole(h, w), jax.jit(chunked)(h, w), strict=True):
        np.testing.assert_allclose(float(b), float(a), rtol=TOL)
    for g_ce, g_z in ((1.0, 0.0), (0.3, 1e-2)):  # the CE alone, then with the z-loss
        def combined(f, g_ce=g_ce, g_z=g_z):
            return lambda h, w: g_ce * f(h, w)[0] + g_z * f(h, w)[1]
        want = jax.jit(jax.grad(combined(whole), argnums=(0, 1)))(h, w)
        got = jax.jit(jax.grad(combined(chunked), argnums=(0, 1)))(h, w)
        for a, b in zip(want, got, strict=True):
            np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=TOL,
                                       atol=TOL * float(jnp.abs(a).max()))


def test_bfloat16_gradients_follow_the_whole_logits_head():
    """In bfloat16 the head's GEMMs take bfloat16 operands with float32 accumulation, and
    the backward's run in float32 as the whole-logits head's autodiff has them."""
    rng = np.random.default_rng(2)
    S, D, V = 48, 16, 64
    h = jnp.asarray(rng.normal(size=(S, D)), jnp.bfloat16)
    w = jnp.asarray(rng.normal(size=(D, V)), jnp.bfloat16)
    targets = jnp.asarray(rng.integers(0, V, (1, S)), jnp.int32)
    loss_S = jnp.ones((S,), bool)

    def whole(h, w):
        logits = jnp.einsum("sd,dv->sv", h, w, preferred_element_type=jnp.float32)
        return cross_entropy_sums(logits[None], targets)[0]

    def chunked(h, w):
        return chunked_lm_losses(h, w, targets.reshape(-1), loss_S, 16)[0]

    want = jax.jit(jax.grad(whole, argnums=(0, 1)))(h, w)
    got = jax.jit(jax.grad(chunked, argnums=(0, 1)))(h, w)
    for a, b in zip(want, got, strict=True):
        assert b.dtype == jnp.bfloat16
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        assert np.abs(a - b).max() <= 1.5e-3 * np.abs(a).max()  # bfloat16 cotangents: 3e-3


B, T, V, CHUNK = 3, 128, 2048, 32
CFG = TransformerConfig(vocab_size=V, d_model=32, n_layers=1, n_heads=2, n_dense_layers=1,
                        dense_hidden=32, lm_z_loss_coef=1e-3)


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def compiled(request):
    """For model.lm_loss_chunk 0 and CHUNK: the step's gradient function compiled, and its
    (loss, grads) on one batch."""
    cfg = CFG.replace(tie_embeddings=request.param)
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    rng = np.random.default_rng(1)
    batch = rng.integers(0, V, (B, T + 1)).astype(np.int32)  # rows as labels.py has them:
    batch[0, -1], batch[1, -1] = NO_LABEL, FILTERED  # an instance, a filtered one, a window
    batch = jnp.asarray(batch)
    out = {}
    for chunk in (0, CHUNK):
        fn = jax.jit(make_grads_fn(graphdef, cfg.replace(lm_loss_chunk=chunk)))
        c = fn.lower(params, rest, batch, jax.random.key(0)).compile()
        grads, parts = c(params, rest, batch, jax.random.key(0))
        out[chunk] = (c, parts, grads)
    return out


def test_model_loss_and_gradients_equal_the_whole_logits_step(compiled):
    (_, want_parts, want_grads), (_, got_parts, got_grads) = compiled[0], compiled[CHUNK]
    for field in ("ce_sum", "lm_z_sum", "n_tokens"):
        np.testing.assert_allclose(float(getattr(got_parts, field)),
                                   float(getattr(want_parts, field)), rtol=TOL)
    flat_want, flat_got = jax.tree.leaves(want_grads), jax.tree.leaves(got_grads)
    assert len(flat_want) == len(flat_got)
    for a, b in zip(flat_want, flat_got, strict=True):
        scale = float(jnp.abs(a).max())
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=TOL, atol=TOL * scale)


def _logit_buffers(hlo: str) -> list[str]:
    """float32 arrays of the whole batch's logits ([B, T, V] or [B * T, V]) in an HLO text."""
    return re.findall(rf"f32\[(?:{B},{T},{V}|{B * T},{V})\]", hlo)


def test_the_chunked_step_holds_no_float32_logits(compiled):
    whole, chunked = compiled[0][0], compiled[CHUNK][0]
    assert _logit_buffers(whole.as_text())  # the check sees them where they are
    assert not _logit_buffers(chunked.as_text())
    before = whole.memory_analysis().temp_size_in_bytes
    after = chunked.memory_analysis().temp_size_in_bytes
    print(f"temporaries: {before / 2**20:.2f} MiB whole logits, {after / 2**20:.2f} MiB chunked")
    assert after < before - B * T * V * 4  # at least one [B, T, V] float32 buffer less
