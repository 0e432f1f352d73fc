"""Writing a new model from an olmo_jax checkpoint's weights (upcycle.py, surgery.py):
load the source's params and model_state on the host, apply a transform of their flat
{name: array} dicts, check the result fits the new architecture and save it as a fresh
run's starting point ({out}/checkpoints/0 + {out}/config.py, as hf-to-orbax does).

The optimizer state is not carried over: the new layout (experts added, split, removed)
has no exact image of the old moments, so the new checkpoint holds weights only and a run
started from it (trainer.init_from) begins at step 0 with a fresh optimizer.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from olmo_jax.checkpoint import hf
from olmo_jax.checkpoint import manager as m
from olmo_jax.checkpoint.tree import check_fits, flatten_named, unflatten_named
from olmo_jax.model.abstract import abstract_model

OPTIMIZER_NOTE = ("optimizer state dropped: the new checkpoint holds weights only (the old "
                  "moments have no exact image in the new expert layout); a run from it "
                  "(trainer.init_from) starts at step 0 with a fresh optimizer")


def flat_numpy(tree) -> dict[str, np.ndarray]:
    return {k: np.asarray(v) for k, v in flatten_named(tree).items()}


def build_model(cfg, params: dict, model_state: dict) -> hf.HFModel:
    """An HFModel of `cfg` from flat dicts, every name and shape checked."""
    _, abstract_params, abstract_state = abstract_model(cfg)
    check_fits(flatten_named(abstract_params), params, "parameters")
    check_fits(flatten_named(abstract_state), model_state, "model state")
    return hf.HFModel(cfg, unflatten_named(abstract_params, {k: jnp.asarray(v) for k, v in params.items()}),
                      unflatten_named(abstract_state, {k: jnp.asarray(v) for k, v in model_state.items()}))


def _tokenizer(ckpt) -> str:
    tok = m.saved_run_config(ckpt).get("data", {}).get("tokenizer", "")
    return "" if tok == "bytes" else tok


def rewrite(ckpt, out_dir, transform: Callable, command: str, what: str):
    """(source model, new model, config path). `transform(cfg, params, state)` -> (new cfg,
    new params, new state), on flat numpy dicts."""
    out_dir = Path(out_dir)
    hf.require_empty(out_dir, "--out")
    source = hf.load_checkpoint(ckpt)
    cfg, params, state = transform(source.config, flat_numpy(source.params),
                                   flat_numpy(source.model_state))
    model = build_model(cfg, params, state)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = hf.save_init_checkpoint(out_dir, model, Path(ckpt).absolute(), command, what,
                                   _tokenizer(ckpt))
    return source, model, path
