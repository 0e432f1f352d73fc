"""OLMo-core 3's Hugging Face export of its MoE (`olmo3moe`) <-> olmo_jax, both ways, exactly.

OLMo-core writes this folder with `convert_olmo3moe_state_to_hf` (nn/hf/convert.py) and
the config of `_get_olmo3moe_config` (nn/hf/config.py): its reordered-norm ("post") or
peri-norm (`use_peri_ln`) blocks, per-head QK-norm, optional scaled embedding norm,
dense first layers, one optional shared expert. Config map (config.json -> model.*):
  hidden_size, num_hidden_layers, num_attention_heads, num_key_value_heads, head_dim,
  vocab_size, rms_norm_eps -> d_model, n_layers, n_heads, n_kv_heads, head_dim, vocab_size,
  norm_eps; initializer_range -> init_std; rope_parameters (or OLMo-core's rope_theta and
  rope_scaling) -> rope_theta, rope_scaling* (hf_config.rope_fields_of: linear -> pi,
  llama3 -> stepwise, yarn -> yarn); keyed by layer type (full_attention /
  sliding_attention) -> rope_scaling_layers (`_rope_fields`)
  use_peri_ln -> block_norm peri (else post); use_head_qk_norm -> head_qk_norm
  embed_scale (1.0 = off) -> embed_scale (0 = off); embed_norm -> embedding_norm
  dense_layers_indices [0..n) + dense_mlp_intermediate_size -> n_dense_layers, dense_hidden
  n_routed_experts, num_experts_per_tok, moe_intermediate_size -> moe.num_experts, top_k,
  expert_hidden; shared_expert_intermediate_size -> moe.n_shared_experts 1, shared_hidden
  gating_function softmax | sigmoid; normalize_expert_weights 1 | null -> moe.norm_topk_prob
  (softmax) / moe.sigmoid_renorm (sigmoid, with sigmoid_eps 1e-7, OLMo-core's);
  restore_weight_scale -> moe.router_weight_scale = top_k (else 1)
  layer_types ("sliding_attention" | "full_attention" per layer) + sliding_window W ->
  window_pattern (`window_fields`: the shortest period of the layers' windows, -1 =
  full, with window_full_last where only the last layer breaks it; window_full_first
  off). OLMo-core writes sliding_window = its window_size W (flash-attention's W - 1,
  plus one), the W keys up to and including the query, as model.window_pattern means it.
  One window size for every sliding layer (OLMo-core's export refuses more).
Anything else OLMo-core can write there (attention gates, scalable
softmax, latent MoE, linear attention, per-head gains, original_num_experts_per_tok, an L2
weight norm) is refused naming the field, and so is an olmo_jax model the
format cannot hold (pre-norm blocks, no or whole-projection QK-norm, clipping, grouped or
biased routing, topk_softmax gating).

Tensor map (HF [out, in] Linear weights; ours stacked over layers, leading L):
  model.embed_tokens.weight, lm_head.weight, model.norm.weight, model.embed_norm.weight
      -> embedding [V, D], lm_head [D, V], final_norm, embedding_norm
  layers.l.self_attn.{q,k,v,o}_proj.weight -> attn/{q,k,v,o}_proj (as Hugging Face OLMoE)
  layers.l.self_attn.{q,k}_norm.weight [H] -> attn/{q,k}_norm/weight [L, H]
  post: layers.l.post_attention_layernorm / post_feedforward_layernorm -> attn_norm / ffn_norm
  peri: layers.l.pre_attention_layernorm / pre_feedforward_layernorm -> attn_norm / ffn_norm,
        post_attention_layernorm / post_feedforward_layernorm -> attn_post_norm / ffn_post_norm
  dense layers: layers.l.mlp.{gate,up,down}_proj.weight -> dense_blocks/ffn/w_{gate,up,down}
  MoE layers: layers.l.mlp.router.gate.weight [E, D] -> ffn/router/weight [D, E];
      layers.l.mlp.experts.e.{gate,up,down}_proj.weight -> ffn/experts/w_{gate,up,down}[e];
      layers.l.mlp.shared_expert.{gate,up,down}_proj.weight -> ffn/shared/w_{gate,up,down}
Every tensor is moved, never recomputed: OLMo-core -> olmo_jax -> OLMo-core is bitwise.
(`pre` blocks use the same tensor names, as OLMo-core's state converter writes them, so
the tensors of a pre-norm OLMo-core model convert too; only config.json refuses them.)

Python API: `load_model(dir)` -> HFModel; `save_model(model, dir)`; `to_orbax` /
`from_orbax` back `python -m olmo_jax.convert olmo3moe-to-orbax / orbax-to-olmo3moe`.
"""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np

from olmo_jax.checkpoint import safetensors_io
from olmo_jax.checkpoint.hf import (
    DTYPES,
    HFModel,
    Tensors,
    load_checkpoint,
    load_folder,
    require_empty,
    save_init_checkpoint,
    split_module,
)
from olmo_jax.checkpoint.hf_config import check_yarn_exact, hf_rope_parameters, rope_fields_of
from olmo_jax.checkpoint.tree import flatten_named, nest
from olmo_jax.errors import CheckpointError
from olmo_jax.model import TransformerConfig
from olmo_jax.model import rope as rope_lib
from olmo_jax.model.config import MoEConfig

MODEL_TYPE = "olmo3moe"
SIGMOID_EPS = 1e-7  # OLMo-core's sigmoid_stability_epsilon, the only one it exports
_LAYER = "model.layers.{l}."

# config.json fields OLMo-core may write whose non-default values olmo_jax cannot express.
_REFUSED = {
    "attention_gate_type": None, "scalable_softmax": False, "latent_moe_dim": None,
    "qk_norm_per_head_gains": False, "original_num_experts_per_tok": None,
    "emo_eval_document_expert_pool": None, "attention_bias": False,
    "use_rope": True,
}


def _refuse(where: str, field: str, value, why: str) -> CheckpointError:
    return CheckpointError(f"{where}: {field}={value!r} cannot be converted: {why}")


def from_config(hf: dict, where: str = "config.json") -> TransformerConfig:
    """The TransformerConfig of an olmo3moe config.json."""
    if hf.get("model_type") != MODEL_TYPE:
        raise _refuse(where, "model_type", hf.get("model_type"),
                      f"this converter reads OLMo-core's {MODEL_TYPE} export")
    for field, ok in _REFUSED.items():
        if hf.get(field, ok) not in (ok, None) and not (ok is False and not hf.get(field)):
            raise _refuse(where, field, hf[field], "olmo_jax has no such option")
    L = int(hf["num_hidden_layers"])
    windows = window_fields(hf, L, where)
    rope = _rope_fields(hf, bool(windows), where)
    dense = sorted(hf.get("dense_layers_indices") or [])
    if dense != list(range(len(dense))):
        raise _refuse(where, "dense_layers_indices", dense,
                      "olmo_jax's dense blocks are the first n_dense_layers")
    if not hf.get("use_head_qk_norm", False):
        raise _refuse(where, "use_head_qk_norm", hf.get("use_head_qk_norm"),
                      "OLMo-core exports head-wise QK-norm only")
    gating = str(hf.get("gating_function", "softmax"))
    if gating not in ("softmax", "sigmoid"):
        raise _refuse(where, "gating_function", gating, "choose softmax or sigmoid")
    norm = hf.get("normalize_expert_weights")
    if norm not in (None, 1, 1.0):
        raise _refuse(where, "normalize_expert_weights", norm,
                      "olmo_jax renormalizes the top-k weights to sum to 1 (p=1) or not at all")
    top_k = int(hf["num_experts_per_tok"])
    n_heads = int(hf["num_attention_heads"])
    head_dim = int(hf.get("head_dim") or hf["hidden_size"] // n_heads)
    if int(hf.get("attention_hidden_size") or n_heads * head_dim) != n_heads * head_dim:
        raise _refuse(where, "attention_hidden_size", hf["attention_hidden_size"],
                      "must be num_attention_heads * head_dim")
    shared = hf.get("shared_expert_intermediate_size")
    embed_scale = float(hf.get("embed_scale", 1.0))
    moe = MoEConfig(
        num_experts=int(hf["n_routed_experts"]), top_k=top_k,
        expert_hidden=int(hf["moe_intermediate_size"]), gating=gating,
        norm_topk_prob=gating == "softmax" and norm is not None,
        sigmoid_renorm=gating != "sigmoid" or norm is not None,
        sigmoid_eps=SIGMOID_EPS if gating == "sigmoid" else 0.0,
        router_weight_scale=float(top_k) if hf.get("restore_weight_scale") else 1.0,
        n_shared_experts=1 if shared else 0, shared_hidden=int(shared or 0))
    cfg = TransformerConfig(
        vocab_size=int(hf["vocab_size"]), d_model=int(hf["hidden_size"]), n_layers=L,
        n_heads=n_heads, n_kv_heads=int(hf.get("num_key_value_heads") or n_heads),
        head_dim=0 if head_dim * n_heads == int(hf["hidden_size"]) else head_dim,
        n_dense_layers=len(dense),
        dense_hidden=int(hf.get("dense_mlp_intermediate_size") or 0) if dense else 0,
        **rope, norm_eps=float(hf.get("rms_norm_eps", 1e-5)),
        qk_norm=True, head_qk_norm=True,
        block_norm="peri" if hf.get("use_peri_ln") else "post",
        embed_scale=0.0 if embed_scale == 1.0 else embed_scale,
        embedding_norm=bool(hf.get("embed_norm", False)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        init_std=float(hf.get("initializer_range", 0.02)), moe=moe, **windows,
    )
    check_yarn_exact(cfg, where)
    return cfg.validate()


def _rope_fields(hf: dict, windowed: bool, where: str) -> dict:
    """The model's rope_* fields, model.rope_scaling_layers among them. rope_parameters
    keyed by layer type (Hugging Face Olmo3's form: e.g. YaRN on the full-attention layers,
    plain RoPE on the sliding ones, as OLMo-core's `with_rope_scaling` builds OLMo 3's
    long-context models): the full layers' scaling when the sliding layers' is plain RoPE
    at the same base (`full`; plain RoPE at another base on the full layers alone: `abf`),
    one RoPE when every type has the same; refused otherwise. One rope_parameters with
    sliding layers scales every layer (`all`), as Hugging Face applies it."""
    rope = hf.get("rope_parameters")
    if isinstance(rope, dict) and rope and set(rope) <= {"full_attention", "sliding_attention"}:
        kinds = list(rope.values())
        if any(k != kinds[0] for k in kinds):
            full, sliding = rope.get("full_attention"), rope.get("sliding_attention")
            base = float((sliding or {}).get("rope_theta", hf.get("rope_theta") or 10000.0))
            new = float((full or {}).get("rope_theta", base))
            if _plain(sliding) and _plain(full):  # another base on the full layers: ABF
                return {"rope_theta": base, "rope_scaling": "abf", "rope_new_theta": new,
                        "rope_scaling_layers": "full"}
            if _plain(sliding) and full is not None and new == base:
                return {**rope_fields_of({**hf, "rope_parameters": full}, where),
                        "rope_scaling_layers": "full"}
            raise _refuse(where, "rope_parameters", rope,
                          "olmo_jax scales the RoPE of the full-attention layers only "
                          "(model.rope_scaling_layers=full, the sliding layers keeping plain "
                          "RoPE at the same base) or of every layer (all)")
        hf = {**hf, "rope_parameters": kinds[0]}
    fields = rope_fields_of(hf, where)
    every = fields["rope_scaling"] != "none" and windowed
    return {**fields, "rope_scaling_layers": "all" if every else "full"}


def _plain(params) -> bool:
    """Plain RoPE: rope_type default and nothing but a base."""
    return (isinstance(params, dict) and params.get("rope_type", "default") == "default"
            and set(params) <= {"rope_type", "rope_theta"})


def window_fields(hf: dict, n_layers: int, where: str) -> dict:
    """model.window_pattern / window_full_first / window_full_last of config.json's
    layer_types and sliding_window ({} when every layer is full): the shortest pattern
    that gives each layer its window, trying the last layer forced full too."""
    types = hf.get("layer_types") or ["full_attention"] * n_layers
    if len(types) != n_layers or any(t not in ("full_attention", "sliding_attention")
                                      for t in types):
        raise _refuse(where, "layer_types", types, f"olmo_jax reads {n_layers} entries, each "
                      "'full_attention' or 'sliding_attention'")
    if "sliding_attention" not in types:
        return {}
    W = hf.get("sliding_window")
    if isinstance(W, bool) or not isinstance(W, int) or W < 1:
        raise _refuse(where, "sliding_window", W, "sliding layers need a window of >= 1 tokens")
    want = [W if t == "sliding_attention" else -1 for t in types]
    for period in range(1, n_layers + 1):
        for last in (False, True):
            cfg = TransformerConfig(n_layers=n_layers, window_pattern=tuple(want[:period]),
                                    window_full_first=False, window_full_last=last)
            if list(cfg.layer_windows) == [0 if w == -1 else w for w in want]:
                return {"window_pattern": tuple(want[:period]), "window_full_first": False,
                        "window_full_last": last}
    raise AssertionError("the whole list is always a pattern")  # pragma: no cover


def _layer_types(cfg: TransformerConfig) -> tuple[list[str], int | None]:
    """(layer_types, sliding_window) of the model's windows; one window size only."""
    windows = cfg.layer_windows
    sizes = sorted(set(windows) - {0})
    if len(sizes) > 1:
        raise CheckpointError(
            f"olmo3moe export: model.window_pattern={cfg.window_pattern!r} cannot be written: "
            f"its layers have windows {sizes}, olmo3moe one sliding_window for every sliding "
            "layer (as OLMo-core's export)")
    return (["sliding_attention" if w else "full_attention" for w in windows],
            sizes[0] if sizes else None)


def check_representable(cfg: TransformerConfig) -> None:
    """Refuses (naming the field) an olmo_jax model the olmo3moe format cannot hold."""
    m = cfg.moe
    bad = [
        ("model.block_norm", cfg.block_norm, cfg.block_norm in ("post", "peri"),
         "olmo3moe blocks are reordered-norm (post) or peri-norm"),
        ("model.qk_norm", cfg.qk_norm, cfg.qk_norm, "olmo3moe has QK-norm"),
        ("model.head_qk_norm", cfg.head_qk_norm, cfg.head_qk_norm,
         "olmo3moe's QK-norm is per head"),
        ("model.clip_qkv", cfg.clip_qkv, not cfg.clip_qkv, "olmo3moe does not clip"),
        ("model.n_moe_layers", cfg.n_moe_layers, cfg.n_moe_layers > 0,
         "olmo3moe has MoE layers"),
        ("model.moe.gating", m.gating, m.gating in ("softmax", "sigmoid"),
         "olmo3moe gates with softmax or sigmoid"),
        ("model.moe.sigmoid_eps", m.sigmoid_eps,
         m.gating != "sigmoid" or m.sigmoid_eps == SIGMOID_EPS,
         f"OLMo-core exports sigmoid gating with epsilon {SIGMOID_EPS}"),
        ("model.moe.n_group", m.n_group, m.n_group == 1, "no group-limited routing"),
        ("model.moe.bias_rate", m.bias_rate, m.bias_rate == 0,
         "no aux-loss-free router bias"),
        ("model.moe.routing_mode", m.routing_mode, m.routing_mode == "learned",
         "OLMo-core refuses to export benchmark routing modes"),
        ("model.moe.router_weight_scale", m.router_weight_scale,
         m.router_weight_scale in (1.0, float(m.top_k)),
         "olmo3moe scales the combine weights by 1 or top_k (restore_weight_scale)"),
    ]
    for field, value, ok, why in bad:
        if not ok:
            raise CheckpointError(f"olmo3moe export: {field}={value!r} cannot be written: {why}")


def _rope_parameters(cfg: TransformerConfig) -> dict:
    """rope_parameters of the model: one, or keyed by layer type where the layers' RoPE
    differs by window (rope.by_window: the scaling on the full-attention layers, plain
    RoPE on the sliding ones; `_rope_fields` reads it back)."""
    scalings = dict(zip(cfg.window_choices, rope_lib.window_scalings(cfg), strict=True))
    plain = {"rope_type": "default", "rope_theta": cfg.rope_theta}

    def params(scaling):
        return plain if scaling is None else hf_rope_parameters(cfg, "olmo3moe export")

    if not rope_lib.by_window(cfg):
        return params(next(iter(scalings.values())))
    return {"full_attention": params(scalings[0]), "sliding_attention": plain}


def to_config(cfg: TransformerConfig, base: dict | None = None, dtype: str = "float32") -> dict:
    """config.json (olmo3moe) of a model; `base` (the source config.json) keeps its other
    fields (tokens ids, architectures, ...)."""
    check_representable(cfg)
    m = cfg.moe
    renorm = m.norm_topk_prob if m.gating == "softmax" else m.sigmoid_renorm
    rope = _rope_parameters(cfg)
    layer_types, sliding_window = _layer_types(cfg)
    out = dict(base or {})
    out.pop("rope_scaling", None)  # OLMo-core's legacy key: rope_parameters holds it
    if sliding_window is not None:
        out["sliding_window"] = sliding_window
    out.update({
        "model_type": MODEL_TYPE, "architectures": ["Olmo3MoeForCausalLM"],
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model,
        "attention_hidden_size": cfg.n_heads * cfg.head_size, "head_dim": cfg.head_size,
        "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.kv_heads, "hidden_act": "silu",
        "dense_layers_indices": list(range(cfg.n_dense_layers)),
        "dense_layers_use_shared_expert": True,
        "dense_mlp_intermediate_size": cfg.dense_hidden_size if cfg.n_dense_layers else None,
        "moe_intermediate_size": m.expert_hidden, "n_routed_experts": m.num_experts,
        "num_experts_per_tok": m.top_k,
        "shared_expert_intermediate_size":
            m.n_shared_experts * m.shared_hidden if m.n_shared_experts else None,
        "gating_function": m.gating, "normalize_expert_weights": 1.0 if renorm else None,
        "restore_weight_scale": m.router_weight_scale != 1.0,
        "rope_theta": rope.get("rope_theta", cfg.rope_theta), "rope_parameters": rope,
        "rms_norm_eps": cfg.norm_eps, "use_head_qk_norm": True,
        "layer_types": layer_types,
        "embed_scale": cfg.embedding_scale or 1.0, "embed_norm": cfg.embedding_norm,
        "use_peri_ln": cfg.block_norm == "peri", "tie_word_embeddings": cfg.tie_embeddings,
        "initializer_range": cfg.init_std, "dtype": dtype,
    })
    out.pop("torch_dtype", None)
    return out


def _norm_names(cfg: TransformerConfig) -> dict[str, str]:
    """Our block norm -> the olmo3moe tensor name's layer suffix."""
    if cfg.block_norm == "peri":
        return {"attn_norm": "pre_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm",
                "attn_post_norm": "post_attention_layernorm",
                "ffn_post_norm": "post_feedforward_layernorm"}
    return {"attn_norm": "post_attention_layernorm", "ffn_norm": "post_feedforward_layernorm"}


def _swiglu_names(prefix: str) -> dict[str, str]:
    return {"w_gate": prefix + "gate_proj.weight", "w_up": prefix + "up_proj.weight",
            "w_down": prefix + "down_proj.weight"}


def to_params(tensors: dict[str, np.ndarray], cfg: TransformerConfig, where: str) -> dict:
    """The nested dict of our (float32) parameters from olmo3moe tensors."""
    t = Tensors(tensors, where)
    V, D = cfg.vocab_size, cfg.d_model
    N, K, H = cfg.n_heads, cfg.kv_heads, cfg.head_size
    m = cfg.moe
    E, F = m.num_experts, m.expert_hidden

    def stack(layers, fn):
        return np.stack([fn(_LAYER.format(l=l)) for l in layers])

    def swiglu(layers, prefix: str, hidden: int) -> dict:
        names = _swiglu_names(prefix)
        return {
            "w_gate": stack(layers, lambda p: t.take(p + names["w_gate"], (hidden, D)).T),
            "w_up": stack(layers, lambda p: t.take(p + names["w_up"], (hidden, D)).T),
            "w_down": stack(layers, lambda p: t.take(p + names["w_down"], (D, hidden)).T),
        }

    # Per-head QK-norm: one [H] weight; else (OLMo-core's tensors of a model with the norm
    # over the whole projection, which its config builder does not export) [N*H] / [K*H].
    q_shape, k_shape = ((H,), (H,)) if cfg.head_qk_norm else ((N, H), (K, H))
    qn, kn = int(np.prod(q_shape)), int(np.prod(k_shape))

    def block(layers) -> dict:
        out = {n: {"weight": stack(layers, lambda p, s=s: t.take(p + s + ".weight", (D,)))}
               for n, s in _norm_names(cfg).items()}
        a = "self_attn."
        out["attn"] = {
            "q_proj": stack(layers, lambda p: t.take(p + a + "q_proj.weight", (N * H, D))
                            .T.reshape(D, N, H)),
            "k_proj": stack(layers, lambda p: t.take(p + a + "k_proj.weight", (K * H, D))
                            .T.reshape(D, K, H)),
            "v_proj": stack(layers, lambda p: t.take(p + a + "v_proj.weight", (K * H, D))
                            .T.reshape(D, K, H)),
            "o_proj": stack(layers, lambda p: t.take(p + a + "o_proj.weight", (D, N * H))
                            .T.reshape(N, H, D)),
            "q_norm": {"weight": stack(layers, lambda p: t.take(p + a + "q_norm.weight",
                                                                (qn,)).reshape(q_shape))},
            "k_norm": {"weight": stack(layers, lambda p: t.take(p + a + "k_norm.weight",
                                                                (kn,)).reshape(k_shape))},
        }
        return out

    dense = range(cfg.n_dense_layers)
    moe = range(cfg.n_dense_layers, cfg.n_layers)
    params = {"embedding": t.take("model.embed_tokens.weight", (V, D)),
              "final_norm": {"weight": t.take("model.norm.weight", (D,))}}
    if cfg.embedding_norm:
        params["embedding_norm"] = {"weight": t.take("model.embed_norm.weight", (D,))}
    if cfg.n_dense_layers:
        params["dense_blocks"] = {**block(dense),
                                  "ffn": swiglu(dense, "mlp.", cfg.dense_hidden_size)}
    if cfg.n_moe_layers:
        experts = {n: np.stack([np.stack([
            t.take(_LAYER.format(l=l) + f"mlp.experts.{e}." + s, shape).T for e in range(E)])
            for l in moe]) for n, s, shape in (("w_gate", "gate_proj.weight", (F, D)),
                                               ("w_up", "up_proj.weight", (F, D)),
                                               ("w_down", "down_proj.weight", (D, F)))}
        ffn = {"router": {"weight": stack(moe, lambda p: t.take(p + "mlp.router.gate.weight",
                                                                 (E, D)).T)},
               "experts": experts}
        if m.n_shared_experts:
            ffn["shared"] = swiglu(moe, "mlp.shared_expert.", m.n_shared_experts * m.shared_hidden)
        params["moe_blocks"] = {**block(moe), "ffn": ffn}
    if cfg.tie_embeddings:
        if "lm_head.weight" in t.left and not np.array_equal(
                t.take("lm_head.weight", (V, D)), params["embedding"]):
            raise CheckpointError(f"{where}: tie_word_embeddings=true but lm_head.weight "
                                  "differs from model.embed_tokens.weight")
    else:
        params["lm_head"] = t.take("lm_head.weight", (V, D)).T
    t.finish()
    return jax.tree.map(np.ascontiguousarray, params)


def from_params(params: dict, cfg: TransformerConfig, dtype=np.float32) -> dict[str, np.ndarray]:
    """olmo3moe tensors (OLMo-core's names and layouts) from the nested dict of our
    parameters (the inverse of `to_params`)."""
    p = jax.tree.map(np.asarray, params)
    D, N, K, H = cfg.d_model, cfg.n_heads, cfg.kv_heads, cfg.head_size
    out = {"model.embed_tokens.weight": p["embedding"],
           "model.norm.weight": p["final_norm"]["weight"]}
    if cfg.embedding_norm:
        out["model.embed_norm.weight"] = p["embedding_norm"]["weight"]
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = p["lm_head"].T

    def block(b: dict, layers) -> None:
        a = b["attn"]
        for i, l in enumerate(layers):
            pre = _LAYER.format(l=l)
            for n, s in _norm_names(cfg).items():
                out[pre + s + ".weight"] = b[n]["weight"][i]
            out[pre + "self_attn.q_proj.weight"] = a["q_proj"][i].reshape(D, N * H).T
            out[pre + "self_attn.k_proj.weight"] = a["k_proj"][i].reshape(D, K * H).T
            out[pre + "self_attn.v_proj.weight"] = a["v_proj"][i].reshape(D, K * H).T
            out[pre + "self_attn.o_proj.weight"] = a["o_proj"][i].reshape(N * H, D).T
            out[pre + "self_attn.q_norm.weight"] = a["q_norm"]["weight"][i].reshape(-1)
            out[pre + "self_attn.k_norm.weight"] = a["k_norm"]["weight"][i].reshape(-1)

    def swiglu(w: dict, i: int, prefix: str) -> None:
        for n, name in _swiglu_names(prefix).items():
            out[name] = w[n][i].T

    dense = range(cfg.n_dense_layers)
    moe = range(cfg.n_dense_layers, cfg.n_layers)
    if cfg.n_dense_layers:
        block(p["dense_blocks"], dense)
        for i, l in enumerate(dense):
            swiglu(p["dense_blocks"]["ffn"], i, _LAYER.format(l=l) + "mlp.")
    if cfg.n_moe_layers:
        b = p["moe_blocks"]
        block(b, moe)
        f = b["ffn"]
        for i, l in enumerate(moe):
            pre = _LAYER.format(l=l) + "mlp."
            out[pre + "router.gate.weight"] = f["router"]["weight"][i].T
            for e in range(cfg.moe.num_experts):
                for n, name in _swiglu_names(pre + f"experts.{e}.").items():
                    out[name] = f["experts"][n][i, e].T
            if cfg.moe.n_shared_experts:
                swiglu(f["shared"], i, pre + "shared_expert.")
    return {k: np.ascontiguousarray(v.astype(dtype)) for k, v in out.items()}


def load_model(folder: str | Path) -> HFModel:
    """An OLMo-core olmo3moe folder (config.json + safetensors) as an HFModel."""
    return load_folder(folder, from_config, to_params)


def save_model(model, out_dir: str | Path, dtype: str | None = None) -> None:
    """Writes the olmo3moe folder OLMo-core's `convert_olmo3moe_state_from_hf` reads."""
    cfg, params, model_state, hf_config = split_module(model)
    leftover = flatten_named(model_state)
    if leftover:
        raise CheckpointError(f"olmo3moe export: the model has state olmo3moe cannot hold "
                              f"('{next(iter(leftover))}')")
    if hf_config is not None and hf_config.get("model_type") != MODEL_TYPE:
        hf_config = None  # another format's config.json: nothing of it carries over
    dtype = dtype or str((hf_config or {}).get("dtype") or "float32")
    if dtype not in DTYPES:
        raise CheckpointError(f"dtype={dtype!r}: choose one of {', '.join(DTYPES)}")
    pure = nest({k: np.asarray(jax.device_get(v)) for k, v in flatten_named(params).items()})
    safetensors_io.write_folder(Path(out_dir), to_config(cfg, hf_config, dtype),
                                from_params(pure, cfg, DTYPES[dtype]))


def to_orbax(folder: str | Path, out_dir: str | Path) -> Path:
    """{out}/checkpoints/0 and {out}/config.py of an olmo3moe folder; returns the config."""
    folder, out_dir = Path(folder), Path(out_dir).absolute()
    require_empty(out_dir, "--out")
    model = load_model(folder)
    out_dir.mkdir(parents=True, exist_ok=True)
    return save_init_checkpoint(out_dir, model, folder.absolute(), "olmo3moe-to-orbax",
                                "OLMo-core olmo3moe model converted")


def from_orbax(ckpt: str | Path, out_dir: str | Path, dtype: str | None = None) -> None:
    out_dir = Path(out_dir)
    require_empty(out_dir, "--out")
    save_model(load_checkpoint(ckpt), out_dir, dtype)
