"""Expert surgery on an MoE model's weights (python -m olmo_jax.convert experts).

  duplicate n  every expert becomes n adjacent copies (experts [.., E, ..] -> [.., E*n, ..]),
               its router row (and aux-loss-free bias) copied, top_k -> top_k * n. Copies
               have equal logits, so the k*n chosen are the n copies of each of the k
               experts chosen before, each with 1/n of its gate (softmax: p/n each;
               topk_softmax / sigmoid / norm_topk_prob: renormalized over k*n): the model
               computes the same logits. `noise` perturbs the copies (not exact).
  prune E'     per MoE block, keeps the E' experts with the most routed assignments summed
               over a run's expert_counts.jsonl (trainer.expert_counts_every), in their
               order, with their router rows; tokens that never chose a pruned expert are
               routed as before (exactly, when the combine weights are renormalized over
               the chosen: topk_softmax, sigmoid or norm_topk_prob).
  top_k k      the number of experts per token (weights unchanged).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np

from olmo_jax.errors import CheckpointError
from olmo_jax.model.config import TransformerConfig

EXPERTS = "moe_blocks/ffn/experts/"
ROUTER = "moe_blocks/ffn/router/weight"  # [L, D, E]
BIAS = "moe_blocks/ffn/router/bias"  # [L, E] (model_state)


def _check_moe(cfg: TransformerConfig) -> None:
    if not cfg.n_moe_layers:
        raise CheckpointError("the model has no MoE blocks (upcycle a dense model first: "
                              "`python -m olmo_jax.convert upcycle`)")
    if cfg.moe.n_group > 1:
        raise CheckpointError(
            f"model.moe.n_group={cfg.moe.n_group}: expert surgery would reshape the routing "
            "groups; set n_group=1 first")


def _map_experts(params: dict, state: dict, fn_expert, fn_router, fn_bias):
    out = {}
    for name, x in params.items():
        x = np.asarray(x, np.float32)
        if name.startswith(EXPERTS):
            out[name] = fn_expert(x)  # [L, E, ...]
        elif name == ROUTER:
            out[name] = fn_router(x)
        else:
            out[name] = x
    new_state = {k: (fn_bias(np.asarray(v)) if k == BIAS else np.asarray(v)) for k, v in state.items()}
    return out, new_state


def duplicate(cfg: TransformerConfig, params: dict, state: dict, n: int, noise: float = 0.0,
              seed: int = 0) -> tuple[TransformerConfig, dict, dict]:
    _check_moe(cfg)
    if n < 2:
        raise CheckpointError(f"--duplicate {n}: give a factor >= 2")
    rng = np.random.default_rng(seed)

    def expert(x):
        y = np.repeat(x, n, axis=1)
        if noise > 0:
            std = x.std(axis=tuple(range(1, x.ndim)), keepdims=True)
            y = y + noise * std * rng.standard_normal(y.shape)
        return y.astype(np.float32)

    out, new_state = _map_experts(params, state, expert, lambda r: np.repeat(r, n, axis=2),
                                  lambda b: np.repeat(b, n, axis=1))
    moe = dataclasses.replace(cfg.moe, num_experts=cfg.moe.num_experts * n, top_k=cfg.moe.top_k * n)
    return cfg.replace(moe=moe).validate(), out, new_state


def read_counts(path: str | Path, cfg: TransformerConfig) -> np.ndarray:
    """[L_moe, E] routed assignments summed over every line of an expert_counts.jsonl."""
    path = Path(path)
    if path.is_dir():
        path = path / "expert_counts.jsonl"
    if not path.is_file():
        raise CheckpointError(f"--counts {path}: no expert_counts.jsonl (train with "
                              "--config.trainer.expert_counts_every=N to record one)")
    total = np.zeros((cfg.n_moe_layers, cfg.moe.num_experts), np.int64)
    lines = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    if not lines:
        raise CheckpointError(f"--counts {path} is empty")
    for rec in lines:
        counts = np.asarray(rec["counts"], np.int64)
        blocks = np.asarray(rec["blocks"]) - cfg.n_dense_layers
        if counts.shape != (len(blocks), cfg.moe.num_experts) or blocks.min() < 0 \
                or blocks.max() >= cfg.n_moe_layers:
            raise CheckpointError(
                f"--counts {path} (step {rec.get('step')}): counts of blocks {rec['blocks']} x "
                f"{counts.shape[-1]} experts do not fit this model ({cfg.n_moe_layers} MoE "
                f"blocks from block {cfg.n_dense_layers}, {cfg.moe.num_experts} experts)")
        total[blocks] += counts
    return total


def kept_experts(counts_LE: np.ndarray, keep: int) -> np.ndarray:
    """[L, keep] expert ids per block: the `keep` most used (ties: the lower id), sorted."""
    order = np.argsort(-counts_LE, axis=1, kind="stable")[:, :keep]
    return np.sort(order, axis=1)


def prune(cfg: TransformerConfig, params: dict, state: dict, keep: int,
          counts_LE: np.ndarray) -> tuple[TransformerConfig, dict, dict]:
    _check_moe(cfg)
    E, k = cfg.moe.num_experts, cfg.moe.top_k
    if not k <= keep < E:
        raise CheckpointError(f"--prune {keep}: keep between model.moe.top_k={k} and "
                              f"model.moe.num_experts - 1 = {E - 1} experts")
    ids_LE = kept_experts(counts_LE, keep)
    layers = np.arange(ids_LE.shape[0])[:, None]
    out, new_state = _map_experts(
        params, state, lambda x: x[layers, ids_LE],
        lambda r: np.take_along_axis(r, ids_LE[:, None, :], axis=2),
        lambda b: b[layers, ids_LE])
    moe = dataclasses.replace(cfg.moe, num_experts=keep)
    return cfg.replace(moe=moe).validate(), out, new_state


def set_top_k(cfg: TransformerConfig, params: dict, state: dict, top_k: int):
    _check_moe(cfg)
    if not 1 <= top_k <= cfg.moe.num_experts:
        raise CheckpointError(f"--top-k {top_k} must be in [1, model.moe.num_experts="
                              f"{cfg.moe.num_experts}]")
    moe = dataclasses.replace(cfg.moe, top_k=top_k)
    return cfg.replace(moe=moe).validate(), dict(params), dict(state)
