"""Generation with a KV cache (olmo_jax/model/decode.py) against the plain forward pass:
per-position logits of prefill + one-token steps equal a full forward's (float32, 1e-5)
for rows of different lengths in one batch, in every block layout with dense and MoE
blocks, and with OLMo 3's long-context layers (windows, YaRN on the full layers only);
greedy generation equals the argmax of re-running the whole sequence; stop tokens,
nucleus sampling and the refusals."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from olmo_jax.errors import ConfigError
from olmo_jax.model import MoEConfig, Transformer, TransformerConfig, decode

V, T = 96, 12
LENS = (5, 9, 2)  # prompt lengths of the three rows
# layout, per-head QK-norm, clipping: OLMo-core's reordered post-norm, HF OLMoE's pre-norm
# (QK-norm over all heads, with clipping active), peri-norm.
# "long": OLMo 3's long-context layers, sliding windows [3, 3, full] with YaRN on the full
# layer only (model.rope_scaling_layers=full: each layer its own RoPE tables).
LAYOUTS = {"post": ("post", True, 0.0), "pre": ("pre", False, 0.4), "peri": ("peri", True, 0.0),
           "long": ("post", True, 0.0)}
LONG = dict(window_pattern=(3,), window_full_first=False, window_full_last=True,
            rope_scaling="yarn", rope_scaling_factor=4.0, rope_old_context_len=4,
            rope_theta=10_000.0, rope_scaling_layers="full")


def tiny(layout: str) -> TransformerConfig:
    block_norm, head_qk, clip = LAYOUTS[layout]
    return TransformerConfig(
        **(LONG if layout == "long" else {}),
        vocab_size=V, d_model=32, n_layers=3, n_dense_layers=1, n_heads=4, n_kv_heads=2,
        block_norm=block_norm, head_qk_norm=head_qk, clip_qkv=clip, init_std=0.2,
        moe=MoEConfig(num_experts=4, top_k=2, expert_hidden=16, n_shared_experts=1,
                      shared_hidden=8))


def weights(cfg: TransformerConfig, seed: int = 0):
    model = Transformer(cfg, rngs=nnx.Rngs(seed))
    _, params, model_state = nnx.split(model, nnx.Param, ...)
    return model, params, model_state


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_cached_logits_equal_the_full_forward_at_every_position(layout):
    cfg = tiny(layout)
    model, params, state = weights(cfg)
    rng = np.random.default_rng(1)
    seqs = rng.integers(0, V, (len(LENS), T)).astype(np.int32)
    full_BTV = np.asarray(jax.jit(lambda ids: model(ids).logits_BTV)(jnp.asarray(seqs)))
    prompt_BP, start_B = decode.pad_prompts([s[:n] for s, n in zip(seqs, LENS, strict=True)], 0, 16)
    P = prompt_BP.shape[1]

    @jax.jit
    def run(cache, tokens_BT, index):
        return decode.forward(decode.decoder(cfg, params, state), tokens_BT, cache, index)

    cache = decode.init_cache(cfg, len(LENS), P + T, start_B)
    logits_BTV, cache = run(cache, jnp.asarray(prompt_BP), 0)
    got = [list(np.asarray(logits_BTV[b, P - n:])) for b, n in enumerate(LENS)]
    for i in range(T - min(LENS)):  # teacher-forced one-token steps, every row's next token
        tok_B = np.array([seqs[b, min(n + i, T - 1)] for b, n in enumerate(LENS)], np.int32)
        logits_B1V, cache = run(cache, jnp.asarray(tok_B[:, None]), jnp.int32(P + i))
        for b, n in enumerate(LENS):
            if n + i < T:
                got[b].append(np.asarray(logits_B1V[b, 0]))
    worst = max(np.abs(np.stack(g) - full_BTV[b]).max() for b, g in enumerate(got))
    print(f"{layout}: max |cached - full logit| = {worst:.3g} (max |logit| {np.abs(full_BTV).max():.3g})")
    assert all(len(g) == T for g in got)
    assert worst <= 1e-5


@pytest.fixture(scope="module")
def post_model():
    cfg = tiny("post")
    return (cfg, *weights(cfg, seed=3))


def test_greedy_generation_is_the_argmax_of_the_full_forward(post_model):
    cfg, model, params, state = post_model
    prompts = [[5, 17, 3], [40, 41, 42, 43, 44, 45, 46], [9]]
    gen = decode.generate(cfg, params, state, prompts, 6)
    assert gen.tokens_BT.shape == (3, 6) and list(gen.lengths_B) == [6, 6, 6]
    # The reference re-runs the sequence so far, right-padded to one causal window of 16.
    forward = jax.jit(lambda ids: model(ids).logits_BTV)
    for b, p in enumerate(prompts):
        seq = list(p)
        for _ in range(6):
            window = np.zeros((1, 16), np.int32)
            window[0, : len(seq)] = seq
            seq.append(int(np.argmax(np.asarray(forward(jnp.asarray(window)))[0, len(seq) - 1])))
        assert list(gen.tokens_BT[b]) == seq[len(p):], b

    # A stop token ends its row (the stop token included, pad_id after it); the same
    # program (one stop id either way), the other rows unchanged until their own stop.
    stop = int(gen.tokens_BT[0, 2])
    stopped = decode.generate(cfg, params, state, prompts, 6, stop_ids=[stop], pad_id=-7)
    for b in range(3):
        row = list(gen.tokens_BT[b])
        n = row.index(stop) + 1 if stop in row else 6
        assert stopped.lengths_B[b] == n
        assert list(stopped.tokens_BT[b]) == row[:n] + [-7] * (6 - n)
    assert stopped.lengths_B[0] <= 3

    # One program for all of it: other prompts in the same window bucket, sampling
    # settings and seeds are arguments, not shapes.
    programs = decode._generate._cache_size()
    sampled = decode.generate(cfg, params, state, [[1] * 16, [2], [3, 4]], 6, temperature=0.8,
                              top_p=0.9, seed=5, stop_ids=[stop])
    again = decode.generate(cfg, params, state, [[1] * 16, [2], [3, 4]], 6, temperature=0.8,
                            top_p=0.9, seed=5, stop_ids=[stop])
    assert decode._generate._cache_size() == programs
    np.testing.assert_array_equal(sampled.tokens_BT, again.tokens_BT)


def test_sampling_keeps_to_the_nucleus():
    logits_V = jnp.log(jnp.array([0.04, 0.5, 0.06, 0.3, 0.1]))
    keys = jax.random.split(jax.random.key(0), 400)
    draw = jax.jit(jax.vmap(lambda k, p: decode.sample_token(logits_V[None], k, 1.0, p)[0],
                            in_axes=(0, None)))
    assert set(np.asarray(draw(keys, 0.75)).tolist()) == {1, 3}
    assert set(np.asarray(draw(keys, 0.85)).tolist()) == {1, 3, 4}
    assert set(np.asarray(draw(keys, 1.0)).tolist()) == {0, 1, 2, 3, 4}
    assert set(np.asarray(draw(keys, 1e-3)).tolist()) == {1}
    greedy = decode.sample_token(logits_V[None], keys[0], 0.0, 1.0)
    assert int(greedy[0]) == 1


def test_moe_decodes_dropless_and_refuses_random_routing():
    cfg = tiny("post")
    capped = cfg.replace(moe=cfg.moe.__class__(**{**cfg.moe.__dict__, "capacity_factor": 1.0}))
    assert decode.decode_config(capped).moe.capacity_factor == 0.0
    random = cfg.replace(moe=cfg.moe.__class__(**{**cfg.moe.__dict__, "routing_mode": "random"}))
    with pytest.raises(ConfigError, match="model.moe.routing_mode='random'"):
        decode.decode_config(random)


def test_bad_input_is_refused_before_compute(post_model):
    cfg, _, params, state = post_model
    with pytest.raises(ValueError, match=r"outside the model's vocabulary \[0, 96\)"):
        decode.generate(cfg, params, state, [[1, 2, V + 3]], 4)
    with pytest.raises(ValueError, match="every prompt at least one token"):
        decode.generate(cfg, params, state, [[1], []], 4)
    with pytest.raises(ValueError, match="top_p"):
        decode.generate(cfg, params, state, [[1]], 4, temperature=1.0, top_p=0.0)
