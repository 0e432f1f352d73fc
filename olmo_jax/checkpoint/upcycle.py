"""Dense -> MoE upcycling of a model's weights (python -m olmo_jax.convert upcycle).

A dense model (every block a SwiGLU MLP of hidden F) becomes an MoE whose blocks from
`keep_dense` on have E experts, each a copy of that block's MLP; attention, norms,
embeddings and the LM head are copied unchanged. Granular (g > 1): the hidden dimension
is split into g slices of F/g, so there are E*g fine-grained experts (expert e*g + j is
slice j of copy e) and top_k*g are routed. The router is a fresh N(0, init_std) draw per
copy, its row repeated over the copy's g slices.

Exactness (float32, tests/checkpoint/test_upcycle.py): SwiGLU is a sum over its hidden
units, so MLP(x) = sum_j slice_j(x). The g slices of a copy have equal logits, so the
top-k*g chosen are the g slices of each of the top-k copies, each with 1/g of its copy's
combine weight; with combine weights summing to 1 (gating topk_softmax or sigmoid, or
softmax with norm_topk_prob) and w_down scaled by g / router_weight_scale the MoE layer
computes MLP(x) exactly. A shared expert (`shared`) gets the dense MLP too, and both it
and the routed experts get half of w_down, so shared + routed = MLP(x). `noise` > 0
perturbs each routed copy (w + noise * std(w) * N(0, 1), one draw per copy) to break the
symmetry, and gives up exactness.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from olmo_jax.errors import CheckpointError
from olmo_jax.model.config import MoEConfig, TransformerConfig

FFN = ("w_gate", "w_up", "w_down")


@dataclasses.dataclass(frozen=True)
class UpcycleSpec:
    num_experts: int  # E copies of the dense MLP
    top_k: int
    granularity: int = 1  # g slices of the hidden dimension per copy
    keep_dense: int = 0  # the first blocks stay dense
    shared: bool = False  # the dense MLP also becomes a shared expert (half each)
    noise: float = 0.0  # relative noise on each routed copy (0 = exact)
    gating: str = "topk_softmax"
    norm_topk_prob: bool = False
    router_weight_scale: float = 1.0
    seed: int = 0  # the router's (and noise's) draws


def weights_sum_to_one(moe: MoEConfig) -> bool:
    """Whether the combine weights of the chosen experts sum to router_weight_scale."""
    return moe.gating in ("topk_softmax", "sigmoid") or moe.norm_topk_prob


def upcycled_config(cfg: TransformerConfig, spec: UpcycleSpec) -> TransformerConfig:
    F, g = cfg.dense_hidden_size, spec.granularity
    if cfg.n_moe_layers:
        raise CheckpointError(
            f"upcycle takes a dense model; this one has {cfg.n_moe_layers} MoE blocks "
            "(change its experts with `python -m olmo_jax.convert experts`)")
    if g < 1 or F % g:
        raise CheckpointError(f"--granularity {g} must divide the dense hidden size {F}")
    if not 0 <= spec.keep_dense < cfg.n_layers:
        raise CheckpointError(
            f"--keep-dense {spec.keep_dense} must be in [0, model.n_layers={cfg.n_layers})")
    if not 1 <= spec.top_k <= spec.num_experts:
        raise CheckpointError(f"--top-k {spec.top_k} must be in [1, --experts {spec.num_experts}]")
    moe = dataclasses.replace(
        cfg.moe, num_experts=spec.num_experts * g, top_k=spec.top_k * g, expert_hidden=F // g,
        n_shared_experts=int(spec.shared), shared_hidden=F if spec.shared else 0,
        gating=spec.gating, norm_topk_prob=spec.norm_topk_prob,
        router_weight_scale=spec.router_weight_scale, n_group=1, topk_group=1)
    return cfg.replace(n_dense_layers=spec.keep_dense, dense_hidden=F, moe=moe).validate()


def upcycle(cfg: TransformerConfig, params: dict, spec: UpcycleSpec,
            model_state: dict | None = None) -> tuple[TransformerConfig, dict, dict]:
    """(new config, new flat params, new flat model_state) from a dense model's flat params
    ({'dense_blocks/ffn/w_gate': [L, D, F], ...}, numpy)."""
    new = upcycled_config(cfg, spec)
    E, g, K = spec.num_experts, spec.granularity, spec.keep_dense
    F = cfg.dense_hidden_size
    rng = np.random.default_rng(spec.seed)
    out = {}
    for name, x in params.items():
        x = np.asarray(x, np.float32)
        if not name.startswith("dense_blocks/"):
            out[name] = x
            continue
        rest = name.removeprefix("dense_blocks/")
        if K:
            out[name] = x[:K]
        moe_x = x[K:]
        if not rest.startswith("ffn/"):
            out[f"moe_blocks/{rest}"] = moe_x
            continue
        w = rest.removeprefix("ffn/")
        share = 0.5 if spec.shared else 1.0
        if spec.shared:
            out[f"moe_blocks/ffn/shared/{w}"] = moe_x * (share if w == "w_down" else 1.0)
        out[f"moe_blocks/ffn/experts/{w}"] = _experts(moe_x, w, E, g, F, share, spec, rng)
    Lm = new.n_moe_layers
    D = cfg.d_model
    router_LDE = (new.init_std * rng.standard_normal((Lm, D, E))).astype(np.float32)
    out["moe_blocks/ffn/router/weight"] = np.repeat(router_LDE, g, axis=2)
    state = dict(model_state or {})
    if new.moe.bias_rate > 0:
        state["moe_blocks/ffn/router/bias"] = np.zeros((Lm, E * g), np.float32)
    return new, out, state


def _experts(x, w: str, E: int, g: int, F: int, share: float, spec: UpcycleSpec, rng):
    """[L, D, F] (w_gate, w_up) or [L, F, D] (w_down) -> [L, E*g, ...] expert weights."""
    h = F // g
    if w == "w_down":  # [L, F, D] -> slices [L, g, h, D], scaled for exactness
        slices = x.reshape(x.shape[0], g, h, x.shape[2]) * (g * share / spec.router_weight_scale)
    else:  # [L, D, F] -> [L, g, D, h]
        slices = x.reshape(x.shape[0], x.shape[1], g, h).transpose(0, 2, 1, 3)
    copies = np.repeat(slices[:, None], E, axis=1)  # [L, E, g, ...]
    if spec.noise > 0:
        std = x.std(axis=tuple(range(1, x.ndim)), keepdims=True)[:, None, None]  # per layer
        copies = copies + spec.noise * std * rng.standard_normal(copies.shape)
    return copies.reshape((x.shape[0], E * g) + slices.shape[2:]).astype(np.float32)
