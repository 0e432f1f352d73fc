"""Decode speed of the KV-cache generator (olmo_jax/model/decode.py) against the sampler it
replaced (re-running the whole seq_len window for every new token, kept here as the
baseline), side by side in ONE run on the default device: the same random model, the same
prompts, greedy, rounds interleaved so machine noise hits both alike; compilation is
excluded (one warm-up call each). Also checks that both produce the same tokens (greedy
on float32 weights: they must, while prompt + new tokens fit the window).

    .venv/bin/python tools/bench/bench_decode.py [--d-model 256] [--layers 4] [--seq-len 256]
        [--prompt-len 32] [--new 64] [--rows 1] [--rounds 3] [--out bench_decode.json]

Prints tokens/s of each and the speed-up; the KV cache's tokens/s count every row's
tokens (the baseline decodes one row at a time, so it is timed on row 0 and scaled by
the number of rows).
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from olmo_jax.model import MoEConfig, Transformer, TransformerConfig, decode


def window_sampler(graphdef, params, model_state, seq_len: int):
    """The old trainer sampler (greedy): one jitted full forward of a seq_len window per
    new token, the window right-padded, the logits read at the last prompt position."""

    @jax.jit
    def next_token(params, model_state, window_1T, pos):
        model = nnx.merge(graphdef, params, model_state)
        logits_1TV = model(window_1T).logits_BTV
        return jnp.argmax(jax.lax.dynamic_index_in_dim(logits_1TV[0], pos, keepdims=False))

    def run(prompt_ids, n_new: int) -> list[int]:
        tokens = [int(t) for t in prompt_ids]
        for _ in range(n_new):
            context = tokens[-seq_len:]
            window = np.zeros((1, seq_len), np.int32)
            window[0, : len(context)] = context
            tokens.append(int(next_token(params, model_state, jnp.asarray(window), len(context) - 1)))
        return tokens[len(prompt_ids):]

    return run


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--rows", type=int, default=1)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default="")
    a = p.parse_args()
    cfg = TransformerConfig(vocab_size=1024, d_model=a.d_model, n_layers=a.layers,
                            n_heads=max(1, a.d_model // 64), init_std=0.05,
                            moe=MoEConfig(num_experts=a.experts, top_k=2, expert_hidden=a.d_model))
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    graphdef, params, state = nnx.split(model, nnx.Param, ...)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, cfg.vocab_size, a.prompt_len).tolist() for _ in range(a.rows)]
    old = window_sampler(graphdef, params, state, a.seq_len)

    def cached():
        return decode.generate(cfg, params, state, prompts, a.new).tokens_BT

    same = old(prompts[0], a.new) == cached()[0].tolist()  # also the warm-up of both
    t_old, t_new = [], []
    for _ in range(a.rounds):
        t0 = time.perf_counter()
        old(prompts[0], a.new)
        t_old.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        cached()
        t_new.append(time.perf_counter() - t0)
    old_tps = a.new / min(t_old)
    new_tps = a.rows * a.new / min(t_new)
    res = {"device": str(jax.devices()[0].device_kind), "d_model": a.d_model, "layers": a.layers,
           "experts": a.experts, "seq_len": a.seq_len, "prompt_len": a.prompt_len,
           "new_tokens": a.new, "rows": a.rows, "window_tokens_per_s": old_tps,
           "kv_cache_tokens_per_s": new_tps, "speedup": new_tps / old_tps,
           "same_greedy_tokens": same}
    print(f"| sampler | tokens/s |\n|---|---:|\n| re-run the {a.seq_len}-token window | "
          f"{old_tps:.1f} |\n| KV cache ({a.rows} row(s), prefill included) | {new_tps:.1f} |")
    print(f"speed-up {new_tps / old_tps:.1f}x; same greedy tokens: {same}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
