"""Document masking (model.doc_mask_eos, data.doc_mask): a packed row of documents gives
each document the logits and gradients it gets alone, in every CPU attention core, and
the cores match a naive masked softmax; the plain causal programs are untouched."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from olmo_jax.kernels import cpu_attention
from olmo_jax.model import Transformer
from olmo_jax.model.attention import causal_attention
from olmo_jax.model.config import MoEConfig, TransformerConfig
from olmo_jax.model.rope import document_positions
from olmo_jax.objective import document_segments

EOS = 3


def naive_doc_attention(q_BTNH, k_BTKH, v_BTKH, seg_BT):
    """Causal attention inside each segment, all heads at once, a [T, T] mask."""
    B, T, N, H = q_BTNH.shape
    G = N // k_BTKH.shape[2]
    k, v = jnp.repeat(k_BTKH, G, axis=2), jnp.repeat(v_BTKH, G, axis=2)
    s = jnp.einsum("btnh,bsnh->bnts", q_BTNH, k) / np.sqrt(H)
    mask = jnp.tril(jnp.ones((T, T), bool))[None] & (seg_BT[:, :, None] == seg_BT[:, None, :])
    p = jax.nn.softmax(jnp.where(mask[:, None], s, -jnp.inf), axis=-1)
    return jnp.einsum("bnts,bsnh->btnh", p, v)


CORES = {"xla": causal_attention, "blas": cpu_attention.causal_attention}


@pytest.mark.parametrize("impl", sorted(CORES))
def test_each_core_masks_documents_like_the_naive_softmax(impl):
    """T = 256: two query chunks in the xla core, four 64-row blocks in the blas kernel;
    documents start inside blocks and span block and chunk boundaries."""
    B, T, N, K, H = 2, 256, 4, 2, 16
    rng = np.random.default_rng(0)
    q, k, v, probe = (jnp.asarray(rng.standard_normal(s), jnp.float32)
                      for s in [(B, T, N, H), (B, T, K, H), (B, T, K, H), (B, T, N, H)])
    starts = [[0, 5, 70, 71, 130, 200], [0, 64, 100, 255]]
    seg = jnp.asarray(np.stack([np.searchsorted(s, np.arange(T), side="right") - 1
                                for s in starts]), jnp.int32)

    def loss(f):
        return lambda q, k, v: jnp.sum(jnp.sin(f(q, k, v, seg)) * probe)

    # Jitted (as the model runs them): one compile each, not one per eager op.
    np.testing.assert_allclose(jax.jit(CORES[impl])(q, k, v, seg),
                               jax.jit(naive_doc_attention)(q, k, v, seg), atol=1e-5, rtol=0)
    grads = jax.jit(jax.grad(loss(CORES[impl]), argnums=(0, 1, 2)))(q, k, v)
    ref = jax.jit(jax.grad(loss(naive_doc_attention), argnums=(0, 1, 2)))(q, k, v)
    for g, r in zip(grads, ref, strict=True):
        np.testing.assert_allclose(g, r, atol=1e-5, rtol=0)
    # the mask matters: plain causal attention differs
    assert float(jnp.max(jnp.abs(CORES[impl](q, k, v) - CORES[impl](q, k, v, seg)))) > 0.1


def test_segments_and_positions_of_a_packed_row():
    cfg = TransformerConfig(doc_mask_eos=EOS)
    tokens = jnp.asarray([[5, 6, EOS, EOS, 7, 8, 9, EOS, 4], [EOS, 1, 2, 3 + 1, 5, 6, 7, 8, 9]])
    seg = document_segments(tokens, cfg)
    np.testing.assert_array_equal(seg, [[0, 0, 0, 1, 2, 2, 2, 2, 3], [0, 1, 1, 1, 1, 1, 1, 1, 1]])
    np.testing.assert_array_equal(document_positions(seg),
                                  [[0, 1, 2, 0, 0, 1, 2, 3, 0], [0, 0, 1, 2, 3, 4, 5, 6, 7]])
    assert document_segments(tokens, TransformerConfig()) is None  # off by default


def _packed(rng, lengths):
    """A row of documents of `lengths`, each but the last ending in EOS."""
    docs = [rng.integers(EOS + 1, 64, n) for n in lengths]
    for d in docs[:-1]:
        d[-1] = EOS
    return docs


@pytest.mark.parametrize("impl", ["xla", "blas"])
def test_a_packed_row_gives_each_document_its_own_logits_and_gradients(impl):
    """Two rows of 40 tokens, three documents each (different cuts, so the RoPE tables are
    per row); a dense and a MoE block (dropless: a token's output depends on its own
    document only). Logits and parameter gradients of the packed rows equal the sum over
    the documents run alone, float32, 1e-5."""
    cfg = TransformerConfig(vocab_size=64, d_model=32, n_layers=2, n_dense_layers=1, n_heads=4,
                            n_kv_heads=2, dtype="float32", attention_impl=impl,
                            doc_mask_eos=EOS, moe=MoEConfig(num_experts=4, top_k=2,
                                                            expert_hidden=32))
    graphdef, params = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)))
    rng = np.random.default_rng(1)
    rows = [_packed(rng, [13, 17, 10]), _packed(rng, [6, 30, 4])]
    tokens = jnp.asarray(np.stack([np.concatenate(r) for r in rows]), jnp.int32)
    probe = jnp.asarray(rng.standard_normal((2, 40, 64)), jnp.float32)

    def logits(params, tokens_BT, seg_BT=None):
        return nnx.merge(graphdef, params)(tokens_BT, segment_ids_BT=seg_BT).logits_BTV

    def packed_loss(params):
        out = logits(params, tokens, document_segments(tokens, cfg))
        return jnp.sum(out * probe), out

    # Each document alone: one batch row per document, padded at its end (causal, and a
    # dropless MoE, so the padding reaches no real position); only real positions count.
    docs = [d for r in rows for d in r]
    width = max(len(d) for d in docs)
    alone_tokens = jnp.asarray(np.stack([np.pad(d, (0, width - len(d))) for d in docs]), jnp.int32)
    which = [b for b, r in enumerate(rows) for _ in r]

    def alone_loss(params):
        out = logits(params, alone_tokens)
        row_outs = [[] for _ in rows]
        for i, d in enumerate(docs):
            row_outs[which[i]].append(out[i, :len(d)])
        stacked = jnp.stack([jnp.concatenate(r) for r in row_outs])
        return jnp.sum(stacked * probe), stacked

    both = jax.jit(lambda p: (jax.value_and_grad(packed_loss, has_aux=True)(p),
                              jax.value_and_grad(alone_loss, has_aux=True)(p)))
    ((_, packed), g_packed), ((_, alone), g_alone) = both(params)
    np.testing.assert_allclose(packed, alone, atol=1e-5, rtol=0)
    for a, b in zip(jax.tree.leaves(g_packed), jax.tree.leaves(g_alone), strict=True):
        # 1e-5 of the leaf's scale: float32 sums of up to 40 tokens' terms in another order
        np.testing.assert_allclose(a, b, atol=1e-5 * max(1.0, float(np.abs(b).max())), rtol=0)
    unmasked = jax.jit(logits)(params, tokens)  # unmasked, later documents see the earlier
    assert float(jnp.max(jnp.abs(unmasked - alone))) > 1e-3


def test_cudnn_packed_segments_hold_max_docs_a_row():
    from olmo_jax.model.attention import packed_segments

    seg = jnp.asarray([[0, 0, 0, 1, 2, 2, 2, 2, 3], [0, 0, 0, 0, 0, 0, 0, 0, 0]])
    offsets, lengths = packed_segments(seg, 8)
    np.testing.assert_array_equal(offsets, [[0, 3, 4, 8, -1, -1, -1, -1, -1],
                                            [0, -1, -1, -1, -1, -1, -1, -1, -1]])
    np.testing.assert_array_equal(lengths, [[3, 1, 4, 1, -1, -1, -1, -1],
                                            [9, -1, -1, -1, -1, -1, -1, -1]])
    offsets, lengths = packed_segments(seg, 2)  # documents past the 2nd share its slot
    np.testing.assert_array_equal(offsets, [[0, 3, -1], [0, -1, -1]])
    np.testing.assert_array_equal(lengths, [[3, 6], [9, -1]])


def test_data_doc_mask_sets_the_models_eos_and_bad_values_are_refused():
    from olmo_jax import config as config_lib
    from olmo_jax.errors import ConfigError

    cfg = config_lib.default_config()
    assert config_lib.validate(cfg).model_config(384).doc_mask_eos == -1  # off by default
    cfg.data.doc_mask = True
    run = config_lib.validate(cfg)
    assert run.model_config(384).doc_mask_eos == 256  # the byte tokenizer's EOS
    assert run.model_config(384, eos_id=7).doc_mask_eos == 7
    assert config_lib.model_config(cfg, 384).doc_mask_eos == 256
    with pytest.raises(ConfigError, match="model.doc_mask_eos"):
        TransformerConfig(vocab_size=64, doc_mask_eos=64).validate()
    with pytest.raises(ConfigError, match="model.cudnn_max_docs"):
        TransformerConfig(cudnn_max_docs=0).validate()
