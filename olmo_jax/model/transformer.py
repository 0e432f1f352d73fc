"""The decoder LM: OLMo-core 3's MoE transformer by default (the reordered post-norm,
per-head QK-norm, the scaled embedding norm), Hugging Face `OlmoeForCausalLM`'s layout as an
option (model/config.HF_OLMOE_LAYOUT).

embed [-> x embed_scale -> RMSNorm] -> [dense blocks] -> [MoE blocks] -> final RMSNorm
-> LM head. Each group of blocks is created stacked (parameters get a leading `layers`
axis) and run with `lax.scan`, so compile time does not grow with depth. The pieces (`embed`, `run_blocks`, `head`) are
public so that pipeline stages can call them separately.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from olmo_jax import shapes
from olmo_jax.model.attention import Attention
from olmo_jax.model.config import TransformerConfig
from olmo_jax.model.lm_loss import chunked_lm_losses
from olmo_jax.model.mlp import MLP
from olmo_jax.model.moe.layer import Dispatcher, MoELayer
from olmo_jax.model.moe.losses import RouterStats
from olmo_jax.model.norm import RMSNorm
from olmo_jax.model.params import normal_param
from olmo_jax.model.rope import (
    by_window,
    document_positions,
    rope_tables,
    rope_tables_batch,
    window_scalings,
)


class Block(nnx.Module):
    """h = x + branch(attn), then h + branch(ffn); ffn is MoE or dense. `model.block_norm`
    places the norms as OLMo-core does (nn/ddp/block.py):
      pre   x + f(attn_norm(x))                   (OLMo-core use_pre_norm)
      post  x + attn_norm(f(x))                   (OLMo-core's default "reordered" norm)
      peri  x + attn_post_norm(f(attn_norm(x)))   (OLMo-core use_peri_norm)
    and likewise ffn_norm / ffn_post_norm around the feed-forward."""

    def __init__(self, cfg: TransformerConfig, moe: bool, *, rngs: nnx.Rngs, dispatcher=None):
        D = cfg.d_model
        self.layout = cfg.block_norm
        self.attn_norm = RMSNorm((D,), ("embed",), cfg.norm_eps, cfg.norm_impl)
        self.attn = Attention(cfg, rngs=rngs)
        self.ffn_norm = RMSNorm((D,), ("embed",), cfg.norm_eps, cfg.norm_impl)
        peri = cfg.block_norm == "peri"
        self.attn_post_norm = RMSNorm((D,), ("embed",), cfg.norm_eps, cfg.norm_impl) if peri else None
        self.ffn_post_norm = RMSNorm((D,), ("embed",), cfg.norm_eps, cfg.norm_impl) if peri else None
        if moe:
            self.ffn = MoELayer(cfg, rngs=rngs, dispatcher=dispatcher)
        else:
            self.ffn = MLP(D, cfg.dense_hidden_size, cfg.init_std, cfg.compute_dtype, rngs=rngs)
        self.is_moe = moe
        self.remat_attention = cfg.remat == "attention"
        self.remat_ffn = cfg.remat == "mlp"

    @shapes.check("cos_TH: ... T H", "sin_TH: ... T H", "-> B T D, _")
    def __call__(self, x_BTD, cos_TH, sin_TH, rng=None, segment_ids_BT=None, window_index=None):
        """`window_index`: the layer's entry of model.window_choices (model/attention.py)."""
        attn = self.attn
        if self.remat_attention:
            attn = nnx.remat(attn)
        with jax.named_scope("attention"):  # scopes name the HLO ops (olmo_jax/planner)
            a_BTD = attn(self._in(self.attn_norm, x_BTD), cos_TH, sin_TH, segment_ids_BT,
                         window_index)
            h_BTD = x_BTD + self._out(self.attn_norm, self.attn_post_norm, a_BTD).astype(x_BTD.dtype)
        f_in_BTD = self._in(self.ffn_norm, h_BTD)
        ffn = nnx.remat(self.ffn) if self.remat_ffn else self.ffn
        if self.is_moe:
            f_BTD, stats = ffn(f_in_BTD, rng)
        else:
            with jax.named_scope("dense_mlp"):
                f_BTD, stats = ffn(f_in_BTD), None
        f_BTD = self._out(self.ffn_norm, self.ffn_post_norm, f_BTD)
        return h_BTD + f_BTD.astype(h_BTD.dtype), stats

    def _in(self, norm, x_BTD):
        """The branch input: normed except in the post layout."""
        return x_BTD if self.layout == "post" else norm(x_BTD)

    def _out(self, norm, post_norm, y_BTD):
        """The branch output: normed in the post (by `norm`) and peri (`post_norm`) layouts."""
        if self.layout == "post":
            return norm(y_BTD)
        return y_BTD if post_norm is None else post_norm(y_BTD)


def _stacked_blocks(cfg: TransformerConfig, n: int, moe: bool, rngs: nnx.Rngs, dispatcher):
    @nnx.split_rngs(splits=n)
    @nnx.vmap(in_axes=0, out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
    def make(rngs: nnx.Rngs):
        return Block(cfg, moe, rngs=rngs, dispatcher=dispatcher)

    return make(rngs)


@shapes.check("cos_TH: ... T H", "sin_TH: ... T H", "-> B T D, _")
def run_blocks(blocks: Block, x_BTD, cos_TH, sin_TH, remat: str = "none", rng=None, unroll: int = 1,
               *, keys=None, keep_L=None, segment_ids_BT=None, window_index_L=None):
    """Scan x through stacked blocks; returns (x, per-layer stats stacked on axis 0).
    `rng` (training only): a key, split into one per block; or `keys`: the blocks' keys.
    `keep_L` (bool per block, pipeline padding): a False block passes x through unchanged
    (its stats are still computed; the caller drops them). `segment_ids_BT`: document
    masking (model/attention.py; the tables then per row, [B, T, H]); None = causal only.
    `window_index_L` (int32 per block): each block's entry of model.window_choices, scanned
    with the blocks (`Transformer.window_index`); None where the model has one window."""
    graphdef, state = nnx.split(blocks)
    n_layers = jax.tree.leaves(state)[0].shape[0]
    if keys is None and rng is not None:
        keys = jax.random.split(rng, n_layers)
    return jax.lax.scan(block_step(graphdef, cos_TH, sin_TH, remat, segment_ids_BT), x_BTD,
                        (state, keys, keep_L, window_index_L), unroll=unroll)


def block_step(graphdef, cos_TH, sin_TH, remat: str = "none", segment_ids_BT=None):
    """run_blocks' scan body: (x, (one block's state, key, keep, window index)) -> (x, stats),
    checkpointed
    with model.remat = block (all recomputed) or dots (the weight GEMMs' outputs kept);
    `graphdef` the stacked blocks' (a pipeline stage runs the body one block at a time,
    parallel/pipeline/run.py)."""

    def body(x, xs):
        layer_state, key, keep, window_index = xs
        y, stats = nnx.merge(graphdef, layer_state)(x, cos_TH, sin_TH, key, segment_ids_BT,
                                                    window_index)
        return (y if keep is None else jnp.where(keep, y, x)), stats

    if remat == "dots":
        return jax.checkpoint(body, policy=jax.checkpoint_policies.dots_with_no_batch_dims_saveable)
    return jax.checkpoint(body) if remat == "block" else body


def position_tables(cfg: TransformerConfig, T: int, positions_T: jax.Array | None = None,
                    segment_ids_BT: jax.Array | None = None,
                    positions_BT: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """The RoPE tables the blocks use (cos, sin): per row, [B, T, H], from `positions_BT`,
    else from the documents of `segment_ids_BT` (positions restarting at each start); else
    shared by the rows, [T, H], from `positions_T` (default 0 .. T-1). Where the layers'
    RoPE differs by window (rope.by_window: a scaling on the full-attention layers only),
    one table per window choice on axis -3 ([B, W, T, H] / [W, T, H])."""
    if positions_BT is None and segment_ids_BT is not None:
        positions_BT = document_positions(segment_ids_BT)
    if positions_BT is None:
        positions_T = jnp.arange(T) if positions_T is None else positions_T

    def tables(scaling):
        if positions_BT is not None:
            return rope_tables_batch(positions_BT, cfg.head_size, cfg.rope_theta, scaling)
        return rope_tables(positions_T, cfg.head_size, cfg.rope_theta, scaling)

    scalings = window_scalings(cfg)
    if not by_window(cfg):  # one RoPE for every layer
        return tables(scalings[0])
    per_window = [tables(s) for s in scalings]
    return tuple(jnp.stack(t, axis=-3) for t in zip(*per_window, strict=True))


def window_index(cfg: TransformerConfig, moe: bool) -> jax.Array | None:
    """The dense (moe=False) or MoE blocks' window indices, int32 [L] (run_blocks), or None
    when every layer has the same window (the cores then take it statically)."""
    if len(cfg.window_choices) == 1:
        return None
    index = cfg.layer_window_index
    return jnp.asarray(index[cfg.n_dense_layers:] if moe else index[:cfg.n_dense_layers],
                       jnp.int32)


class Output(NamedTuple):
    logits_BTV: jax.Array  # float32
    router_stats: RouterStats | None  # fields stacked over MoE layers [L_moe, B, ...]


class Transformer(nnx.Module):
    def __init__(self, cfg: TransformerConfig, *, rngs: nnx.Rngs, dispatcher: Dispatcher | None = None):
        cfg.validate()
        self.cfg = cfg
        V, D = cfg.vocab_size, cfg.d_model
        self.embedding = normal_param(rngs.params(), (V, D), ("vocab", "embed"), cfg.init_std)
        self.embedding_norm = (
            RMSNorm((D,), ("embed",), cfg.norm_eps, cfg.norm_impl) if cfg.embedding_norm else None
        )
        self.dense_blocks = (
            _stacked_blocks(cfg, cfg.n_dense_layers, False, rngs, None) if cfg.n_dense_layers else None
        )
        self.moe_blocks = (
            _stacked_blocks(cfg, cfg.n_moe_layers, True, rngs, dispatcher) if cfg.n_moe_layers else None
        )
        self.final_norm = RMSNorm((D,), ("embed",), cfg.norm_eps, cfg.norm_impl)
        self.lm_head = (
            None if cfg.tie_embeddings
            else normal_param(rngs.params(), (D, V), ("embed", "vocab"), cfg.init_std)
        )

    @shapes.check("-> B T D")
    def embed(self, tokens_BT: jax.Array) -> jax.Array:
        """The embeddings, times model.embed_scale and RMSNormed with model.embedding_norm
        (OLMo-core's order: scale, then norm), in float32, cast to the compute dtype."""
        x_BTD = jnp.take(self.embedding[...], tokens_BT, axis=0)
        if self.cfg.embedding_scale:
            x_BTD = x_BTD * jnp.float32(self.cfg.embedding_scale)
        if self.embedding_norm is not None:
            x_BTD = self.embedding_norm(x_BTD)
        return x_BTD.astype(self.cfg.compute_dtype)

    @shapes.check("-> B T D, _")
    def blocks(self, x_BTD: jax.Array, positions_T: jax.Array | None = None, rng=None,
               segment_ids_BT: jax.Array | None = None, positions_BT: jax.Array | None = None):
        """`rng`: a key in training (router jitter, random routing); None = deterministic.
        `segment_ids_BT` (int32, document masking): a query attends only to earlier keys
        with the same id, and the RoPE positions restart at each document's start
        (`rope.document_positions`, as OLMo-core's RotaryEmbedding with cu_doc_lens);
        None = plain causal attention over positions `positions_T` (default 0 .. T-1).
        `positions_BT`: per-row RoPE positions given explicitly (default: from the segment
        ids; a context-parallel shard passes its share of the whole rows' positions, as
        its segment ids are not contiguous)."""
        cfg = self.cfg
        cos_TH, sin_TH = position_tables(cfg, x_BTD.shape[1], positions_T, segment_ids_BT,
                                         positions_BT)
        stats = None
        if self.dense_blocks is not None:
            x_BTD, _ = run_blocks(self.dense_blocks, x_BTD, cos_TH, sin_TH, cfg.remat,
                                  unroll=cfg.scan_unroll, segment_ids_BT=segment_ids_BT,
                                  window_index_L=window_index(cfg, moe=False))
        if self.moe_blocks is not None:
            x_BTD, stats = run_blocks(self.moe_blocks, x_BTD, cos_TH, sin_TH, cfg.remat, rng,
                                      cfg.scan_unroll, segment_ids_BT=segment_ids_BT,
                                      window_index_L=window_index(cfg, moe=True))
        return x_BTD, stats

    @shapes.check("-> B T V")
    def head(self, x_BTD: jax.Array) -> jax.Array:
        dt = self.cfg.compute_dtype
        h_BTD = self.final_norm(x_BTD).astype(dt)
        w_DV = self.embedding[...].T if self.lm_head is None else self.lm_head[...]
        with jax.named_scope("lm_head"):
            return jnp.einsum("btd,dv->btv", h_BTD, w_DV.astype(dt),
                              preferred_element_type=jnp.float32)

    def head_losses(self, x_BTD: jax.Array, targets_BT: jax.Array, loss_BT: jax.Array,
                    chunk: int) -> tuple[jax.Array, jax.Array]:
        """(summed cross-entropy, summed logsumexp^2) over the targets `loss_BT` marks, what
        `head` + the loss compute, chunked over `chunk` tokens (model.lm_loss_chunk) without
        the [B, T, V] logits (model/lm_loss.py)."""
        dt = self.cfg.compute_dtype
        h_BTD = self.final_norm(x_BTD).astype(dt)
        w_DV = self.embedding[...].T if self.lm_head is None else self.lm_head[...]
        B, T, D = h_BTD.shape
        with jax.named_scope("lm_head"):
            return chunked_lm_losses(h_BTD.reshape(B * T, D), w_DV.astype(dt),
                                     targets_BT.reshape(-1), loss_BT.reshape(-1), chunk)

    @shapes.check("-> *")
    def __call__(self, tokens_BT: jax.Array, rng: jax.Array | None = None,
                 segment_ids_BT: jax.Array | None = None,
                 positions_T: jax.Array | None = None,
                 positions_BT: jax.Array | None = None) -> Output:
        """`rng` is given in training only (router jitter, random routing); evaluation and
        sampling call without it. `segment_ids_BT`: document masking (`blocks`).
        `positions_T`: the tokens' RoPE positions (default 0..T-1; a context-parallel shard
        passes its global indices); `positions_BT`: per-row positions (`blocks`)."""
        x_BTD, stats = self.blocks(self.embed(tokens_BT), positions_T, rng=rng,
                                   segment_ids_BT=segment_ids_BT, positions_BT=positions_BT)
        return Output(self.head(x_BTD), stats)
