"""Text generation from a trained model, so a person can see what it learned.

A fixed-size window of `seq_len` tokens is re-run for every new token (no KV cache):
one compiled function whatever the prompt length, fine for a short sample.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx


def generate(graphdef, params, model_state, prompt_ids: np.ndarray, n_new: int, seq_len: int,
             pad_id: int, temperature: float = 0.7, seed: int = 0) -> np.ndarray:
    """Returns the prompt followed by `n_new` sampled token ids."""

    @jax.jit
    def next_logits(params, model_state, window_1T, pos):
        model = nnx.merge(graphdef, params, model_state)
        logits_1TV = model(window_1T).logits_BTV
        return jax.lax.dynamic_index_in_dim(logits_1TV[0], pos, keepdims=False)

    tokens = [int(t) for t in prompt_ids]
    key = jax.random.key(seed)
    for _ in range(n_new):
        context = tokens[-seq_len:]
        window = np.full((1, seq_len), pad_id, np.int32)
        window[0, : len(context)] = context
        logits_V = next_logits(params, model_state, jnp.asarray(window), len(context) - 1)
        key, sub = jax.random.split(key)
        if temperature > 0:
            nxt = jax.random.categorical(sub, logits_V / temperature)
        else:
            nxt = jnp.argmax(logits_V)
        tokens.append(int(nxt))
    return np.asarray(tokens, np.int32)
