"""Generation with a KV cache: prefill the prompts, then decode one token at a time
against a preallocated cache, on one device (a sharded batch works too; no mesh needed).

Layout. The cache holds, per group of stacked blocks (dense, MoE), keys and values
`k_LBAKH` / `v_LBAKH` of A = P + n_new slots (layers, rows, slots, kv heads, head dim), in
the compute dtype. Prompts of different lengths are LEFT-padded to one window of P
slots, so every row writes its next token at the same slot and decoding is one
`dynamic_update_slice` per layer; row b's prompt starts at slot `start_B[b]` = P - its
length, and the token in slot a has the position a - start_B[b] (RoPE per row).
A query at slot q attends the slots [start_B[b], q] (a padding query attends only itself,
so it stays finite; no real query ever attends a padding slot), in a layer with a sliding
window W (model.window_pattern) only the last W of them.

The blocks are the model's own (`Block`'s norms in every layout: pre / post / peri, QK-norm
over all heads or per head, clipping, the MoE layer with its routing per token, dense
MLPs); only the attention is re-done here, reading the layer's projection weights, norms
and the RoPE helpers: one query block against the cache with the mask above. The MoE
layer runs dropless whatever `model.moe.capacity_factor` says (a capacity buffer sized
for one decoded token per row would drop tokens the full forward keeps):
`decode_config` is the model config the decoder builds the blocks from.

Compiled programs: `generate` is one jitted program (prefill, the first token, then a
`lax.while_loop` of one-token steps that ends when every row has hit a stop token or
n_new tokens) per model config and (rows, P, n_new, number of stop tokens) shape; P is
the longest prompt rounded up to a multiple of `prompt_multiple`, so prompts of similar
lengths share it.
Temperature, top-p and the seed are traced arguments (no recompilation).
Sampling: temperature 0 is greedy (argmax, ties to the lower id); otherwise
softmax(logits / temperature), restricted with top_p < 1 to the smallest set of most
probable tokens whose probability reaches top_p (nucleus sampling; the most probable
token is always kept).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from olmo_jax import shapes
from olmo_jax.errors import ConfigError
from olmo_jax.model import rope
from olmo_jax.model.abstract import abstract_model
from olmo_jax.model.config import TransformerConfig
from olmo_jax.model.rope import apply_rope
from olmo_jax.model.transformer import Block, Transformer, position_tables


class Cache(NamedTuple):
    """Keys and values per block group ([L, B, A, K, H], compute dtype; None when the model
    has no such group) and the slot where each row's prompt starts."""

    dense_k: jax.Array | None
    dense_v: jax.Array | None
    moe_k: jax.Array | None
    moe_v: jax.Array | None
    start_B: jax.Array  # int32


class Generation(NamedTuple):
    tokens_BT: np.ndarray  # int32 [B, n_new]: the generated ids, pad_id after a stop token
    lengths_B: np.ndarray  # int32: generated tokens per row, its stop token included


def decode_config(cfg: TransformerConfig) -> TransformerConfig:
    """The config the decoder builds its blocks from: `cfg` with a dropless MoE (module
    docstring). Refuses routing modes that do not route by the router (they draw random
    experts, or assign by the token's place in the batch)."""
    if cfg.moe.routing_mode != "learned" and cfg.n_moe_layers:
        raise ConfigError(
            f"generation routes each token by the learned router; model.moe.routing_mode="
            f"{cfg.moe.routing_mode!r} (a system benchmark mode) has no decoding: use a model "
            "trained with routing_mode='learned'")
    return cfg.replace(moe=dataclasses.replace(cfg.moe, capacity_factor=0.0), remat="none")


def decoder(cfg: TransformerConfig, params, model_state) -> Transformer:
    """The model of `params` / `model_state` (an nnx State of `cfg`'s Transformer) with the
    blocks of decode_config(cfg); call inside jit."""
    return nnx.merge(_graphdef(decode_config(cfg)), params, model_state)


@functools.lru_cache(maxsize=16)
def _graphdef(cfg: TransformerConfig):
    return abstract_model(cfg)[0]


def init_cache(cfg: TransformerConfig, rows: int, slots: int, start_B) -> Cache:
    """An empty cache of `slots` slots for `rows` rows whose prompts start at `start_B`."""
    shape = (rows, slots, cfg.kv_heads, cfg.head_size)

    def zeros(n):
        return jnp.zeros((n, *shape), cfg.compute_dtype) if n else None

    return Cache(zeros(cfg.n_dense_layers), zeros(cfg.n_dense_layers), zeros(cfg.n_moe_layers),
                 zeros(cfg.n_moe_layers), jnp.asarray(start_B, jnp.int32))


def _attend(attn, x_BTD, cos_BTH, sin_BTH, k_LBAKH, v_LBAKH, layer, index, mask_BTA):
    """The layer's attention for the queries of slots [index, index + T): their keys and
    values written into the cache at those slots, then softmax(q k^T / sqrt(H)) v over the
    cache under `mask_BTA` (float32 scores). Returns (y_BTD, k_LBAKH, v_LBAKH)."""
    dt = attn.dtype
    B, T, D = x_BTD.shape
    N, K, H = attn.q_proj.shape[1], attn.k_proj.shape[1], attn.q_proj.shape[2]
    w_qkv_DJ = jnp.concatenate(
        [attn.q_proj[...].reshape(D, N * H), attn.k_proj[...].reshape(D, K * H),
         attn.v_proj[...].reshape(D, K * H)], axis=1).astype(dt)
    qkv_SJ = attn._proj("rd,dj->rj", x_BTD.astype(dt).reshape(B * T, D), w_qkv_DJ)
    q_BTNH = qkv_SJ[:, : N * H].reshape(B, T, N, H)
    k_BTKH = qkv_SJ[:, N * H : (N + K) * H].reshape(B, T, K, H)
    v_BTKH = qkv_SJ[:, (N + K) * H :].reshape(B, T, K, H)
    if attn.q_norm is not None:
        q_BTNH, k_BTKH = attn.q_norm(q_BTNH), attn.k_norm(k_BTKH)
    if attn.clip_qkv:
        c = attn.clip_qkv
        q_BTNH, k_BTKH, v_BTKH = (jnp.clip(a, -c, c) for a in (q_BTNH, k_BTKH, v_BTKH))
    q_BTNH, k_BTKH = apply_rope(q_BTNH, cos_BTH, sin_BTH), apply_rope(k_BTKH, cos_BTH, sin_BTH)
    at = (layer, 0, index, 0, 0)
    k_LBAKH = jax.lax.dynamic_update_slice(k_LBAKH, k_BTKH[None].astype(k_LBAKH.dtype), at)
    v_LBAKH = jax.lax.dynamic_update_slice(v_LBAKH, v_BTKH[None].astype(v_LBAKH.dtype), at)
    k_BAKH, v_BAKH = k_LBAKH[layer], v_LBAKH[layer]
    q_BTKGH = q_BTNH.reshape(B, T, K, N // K, H)
    s_BKGTA = jnp.einsum("btkgh,bakh->bkgta", q_BTKGH, k_BAKH,
                         preferred_element_type=jnp.float32) / jnp.float32(math.sqrt(H))
    s_BKGTA = jnp.where(mask_BTA[:, None, None], s_BKGTA, -jnp.inf)
    p_BKGTA = jax.nn.softmax(s_BKGTA, axis=-1)
    o_BTKGH = jnp.einsum("bkgta,bakh->btkgh", p_BKGTA.astype(dt), v_BAKH.astype(dt))
    o_SJ = o_BTKGH.reshape(B * T, N * H)
    y_SD = attn._proj("rj,jd->rd", o_SJ, attn.o_proj[...].reshape(N * H, D).astype(dt))
    return y_SD.reshape(B, T, D), k_LBAKH, v_LBAKH


def _block(block: Block, x_BTD, cos_BTH, sin_BTH, k_LBAKH, v_LBAKH, layer, index, mask_BTA):
    """Block.__call__ with the cached attention (the same norms and feed-forward)."""
    a_BTD, k_LBAKH, v_LBAKH = _attend(block.attn, block._in(block.attn_norm, x_BTD), cos_BTH,
                                      sin_BTH, k_LBAKH, v_LBAKH, layer, index, mask_BTA)
    h_BTD = x_BTD + block._out(block.attn_norm, block.attn_post_norm, a_BTD).astype(x_BTD.dtype)
    f_in_BTD = block._in(block.ffn_norm, h_BTD)
    f_BTD = block.ffn(f_in_BTD)[0] if block.is_moe else block.ffn(f_in_BTD)
    f_BTD = block._out(block.ffn_norm, block.ffn_post_norm, f_BTD)
    return h_BTD + f_BTD.astype(h_BTD.dtype), k_LBAKH, v_LBAKH


def _run_group(blocks, x_BTD, cos_BTH, sin_BTH, k_LBAKH, v_LBAKH, index, mask_BTA, back_BTA,
               windows, window_index):
    """The group's blocks over the cache; `windows`: the layers' sliding windows (0 =
    full; model.window_pattern), `window_index` their indices into model.window_choices
    (which pick each layer's RoPE tables where they differ by window: rope.by_window),
    `back_BTA` how far back each slot is from the query."""
    graphdef, state = nnx.split(blocks)
    n_layers = k_LBAKH.shape[0]
    per_window = cos_BTH.ndim == 4  # [B, W, T, H]

    def body(carry, xs):
        x, k, v = carry
        layer_state, layer, window, choice = xs
        block = nnx.merge(graphdef, layer_state)
        mask = mask_BTA & ((window == 0) | (back_BTA < window))  # a query sees itself
        cos, sin = ((rope.for_window(cos_BTH, choice), rope.for_window(sin_BTH, choice))
                    if per_window else (cos_BTH, sin_BTH))
        return _block(block, x, cos, sin, k, v, layer, index, mask), None

    (x_BTD, k_LBAKH, v_LBAKH), _ = jax.lax.scan(
        body, (x_BTD, k_LBAKH, v_LBAKH),
        (state, jnp.arange(n_layers), jnp.asarray(windows, jnp.int32),
         jnp.asarray(window_index, jnp.int32)))
    return x_BTD, k_LBAKH, v_LBAKH


@shapes.check("-> B T V, _")
def forward(model: Transformer, tokens_BT: jax.Array, cache: Cache, index) -> tuple[jax.Array, Cache]:
    """Runs the tokens of slots [index, index + T) of every row against the cache: the
    prefill (index 0, T = P) or one decode step (T = 1). Returns (float32 logits [B, T, V],
    the cache with their keys and values written). `model`: decoder(...)."""
    cfg = model.cfg
    B, T = tokens_BT.shape
    A = (cache.moe_k if cache.moe_k is not None else cache.dense_k).shape[2]
    start_B = cache.start_B
    slot_T = index + jnp.arange(T)
    positions_BT = jnp.maximum(slot_T[None, :] - start_B[:, None], 0)
    cos_BTH, sin_BTH = position_tables(cfg, T, positions_BT=positions_BT)  # [B, (W,) T, H]
    a_A = jnp.arange(A)
    q_BT1 = slot_T[None, :, None]
    mask_BTA = (a_A <= q_BT1) & ((a_A >= start_B[:, None, None]) | (a_A == q_BT1))
    back_BTA = jnp.broadcast_to(q_BT1 - a_A, mask_BTA.shape)
    windows, choices, n_dense = cfg.layer_windows, cfg.layer_window_index, cfg.n_dense_layers
    x_BTD = model.embed(tokens_BT)
    dk, dv, mk, mv = cache.dense_k, cache.dense_v, cache.moe_k, cache.moe_v
    if model.dense_blocks is not None:
        x_BTD, dk, dv = _run_group(model.dense_blocks, x_BTD, cos_BTH, sin_BTH, dk, dv, index,
                                   mask_BTA, back_BTA, windows[:n_dense], choices[:n_dense])
    if model.moe_blocks is not None:
        x_BTD, mk, mv = _run_group(model.moe_blocks, x_BTD, cos_BTH, sin_BTH, mk, mv, index,
                                   mask_BTA, back_BTA, windows[n_dense:], choices[n_dense:])
    return model.head(x_BTD), Cache(dk, dv, mk, mv, start_B)


def sample_token(logits_BV: jax.Array, key, temperature, top_p) -> jax.Array:
    """One token per row (module docstring: greedy at temperature 0, else temperature and
    nucleus sampling). `temperature`, `top_p`: traced scalars."""
    greedy_B = jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
    scaled_BV = logits_BV / jnp.maximum(temperature, 1e-6)

    def nucleus(s_BV):
        sorted_BV = jnp.sort(s_BV, axis=-1)[:, ::-1]
        p_BV = jax.nn.softmax(sorted_BV, axis=-1)
        before_BV = jnp.cumsum(p_BV, axis=-1) - p_BV  # probability of the better tokens
        n_B = jnp.sum(before_BV < top_p, axis=-1)  # >= 1: the best token always counts
        cut_B = jnp.take_along_axis(sorted_BV, n_B[:, None] - 1, axis=-1)
        return jnp.where(s_BV >= cut_B, s_BV, -jnp.inf)

    scaled_BV = jax.lax.cond(top_p < 1.0, nucleus, lambda s: s, scaled_BV)
    drawn_B = jax.random.categorical(key, scaled_BV, axis=-1).astype(jnp.int32)
    return jnp.where(temperature > 0, drawn_B, greedy_B)


@partial(jax.jit, static_argnames=("cfg", "n_new"))
def _generate(cfg, params, model_state, prompt_BP, start_B, stop_S, key, temperature, top_p,
              pad_id, *, n_new: int):
    model = decoder(cfg, params, model_state)
    B, P = prompt_BP.shape
    cache = init_cache(cfg, B, P + n_new, start_B)
    logits_BTV, cache = forward(model, prompt_BP, cache, 0)
    key, sub = jax.random.split(key)
    tok_B = sample_token(logits_BTV[:, -1], sub, temperature, top_p)
    out_BT = jnp.full((B, n_new), pad_id, jnp.int32).at[:, 0].set(tok_B)
    done_B = jnp.isin(tok_B, stop_S)
    lengths_B = jnp.ones((B,), jnp.int32)

    def cond(c):
        i, _, _, _, done_B, _, _ = c
        return (i < n_new) & ~jnp.all(done_B)

    def body(c):
        i, tok_B, cache, out_BT, done_B, lengths_B, key = c
        logits_BTV, cache = forward(model, tok_B[:, None], cache, P + i - 1)
        key, sub = jax.random.split(key)
        new_B = sample_token(logits_BTV[:, 0], sub, temperature, top_p)
        out_BT = jax.lax.dynamic_update_slice(
            out_BT, jnp.where(done_B, pad_id, new_B)[:, None], (0, i))
        lengths_B = lengths_B + (~done_B).astype(jnp.int32)
        done_B = done_B | jnp.isin(new_B, stop_S)
        return i + 1, new_B, cache, out_BT, done_B, lengths_B, key

    init = (jnp.int32(1), tok_B, cache, out_BT, done_B, lengths_B, key)
    _, _, _, out_BT, _, lengths_B, _ = jax.lax.while_loop(cond, body, init)
    return out_BT, lengths_B


def pad_prompts(prompts, pad_id: int, multiple: int = 16) -> tuple[np.ndarray, np.ndarray]:
    """(prompt_BP int32, start_B int32): the prompts left-padded with `pad_id` (a token id
    of the vocabulary) to P = the longest rounded up to a multiple of `multiple`."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("generate needs at least one prompt, and every prompt at least one token")
    P = -(-max(len(p) for p in prompts) // multiple) * multiple
    out = np.full((len(prompts), P), pad_id, np.int32)
    start = np.zeros(len(prompts), np.int32)
    for b, p in enumerate(prompts):
        out[b, P - len(p):] = np.asarray(p, np.int32)
        start[b] = P - len(p)
    return out, start


def generate(cfg: TransformerConfig, params, model_state, prompts, n_new: int, *,
             temperature: float = 0.0, top_p: float = 1.0, stop_ids=(), pad_id: int = 0,
             seed: int = 0, prompt_multiple: int = 16) -> Generation:
    """Generates up to `n_new` tokens after each prompt (a list of token id lists, of any
    lengths), with the model of `cfg`, `params` and `model_state` (nnx States). A row stops
    after a token of `stop_ids`. See the module docstring for the programs compiled."""
    if n_new < 1:
        raise ValueError(f"n_new must be >= 1, got {n_new}")
    if temperature < 0 or not 0 < top_p <= 1:
        raise ValueError(f"temperature must be >= 0 and top_p in (0, 1], got {temperature}, {top_p}")
    for p in prompts:
        bad = [t for t in p if not 0 <= int(t) < cfg.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the model's vocabulary "
                             f"[0, {cfg.vocab_size}): the tokenizer does not match the model")
    prompt_BP, start_B = pad_prompts(prompts, 0, prompt_multiple)  # padding slots: masked
    stop_S = np.asarray(list(stop_ids) or [-1], np.int32)
    out_BT, lengths_B = _generate(cfg, params, model_state, jnp.asarray(prompt_BP),
                                  jnp.asarray(start_B), jnp.asarray(stop_S), jax.random.key(seed),
                                  jnp.float32(temperature), jnp.float32(top_p), jnp.int32(pad_id),
                                  n_new=n_new)
    return Generation(np.asarray(out_BT), np.asarray(lengths_B))
