"""Text generation from a trained model, so a person can see what it learned: the KV-cache
decoder (olmo_jax/model/decode.py), one compiled program per prompt-length bucket and
sample length, one token per step after the prompt's prefill.
"""

from __future__ import annotations

import numpy as np

from olmo_jax.model import decode
from olmo_jax.model.config import TransformerConfig


def generate(model_cfg: TransformerConfig, params, model_state, prompt_ids: np.ndarray,
             n_new: int, temperature: float = 0.7, seed: int = 0,
             stop_id: int | None = None) -> np.ndarray:
    """Returns the prompt followed by up to `n_new` sampled token ids (temperature 0 =
    greedy), ending before `stop_id` (the tokenizer's end of text) if it is drawn; n_new 0
    (trainer.sample_tokens=0) returns the prompt alone, compiling nothing."""
    if n_new == 0:
        return np.asarray(prompt_ids, np.int32)
    gen = decode.generate(model_cfg, params, model_state, [list(prompt_ids)], n_new,
                          temperature=temperature,
                          stop_ids=() if stop_id is None else (stop_id,), seed=seed)
    new = gen.tokens_BT[0, : gen.lengths_B[0]]
    if stop_id is not None and len(new) and new[-1] == stop_id:
        new = new[:-1]
    return np.concatenate([np.asarray(prompt_ids, np.int32), new.astype(np.int32)])
