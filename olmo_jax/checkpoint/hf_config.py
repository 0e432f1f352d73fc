"""Hugging Face `OlmoeConfig` (config.json) <-> `TransformerConfig`, refusing what the
other side cannot represent (never approximating it); each refusal names the field.

Field map (HF -> olmo_jax):
  hidden_size -> d_model, num_hidden_layers -> n_layers, num_attention_heads -> n_heads,
  num_key_value_heads -> n_kv_heads, intermediate_size -> moe.expert_hidden,
  num_experts -> moe.num_experts, num_experts_per_tok -> moe.top_k,
  norm_topk_prob -> moe.norm_topk_prob, rope_parameters (or legacy rope_theta /
  rope_scaling) -> rope_theta and rope_scaling* (default -> none, linear -> pi, llama3 ->
  stepwise, yarn -> yarn; abf exports as default with the new base),
  rms_norm_eps -> norm_eps, clip_qkv (None = off) -> clip_qkv (0 = off),
  tie_word_embeddings -> tie_embeddings, initializer_range -> init_std,
  router_aux_loss_coef -> moe.lb_loss_coef with moe.lb_loss_type = "pooled" and
  moe.z_loss_coef = 0 (Hugging Face's training loss: pooled over layers, no z-loss).
OLMoE has no dense blocks, no shared experts, softmax gating and QK-norm over all heads.
"""

from __future__ import annotations

import math
from typing import Any

from olmo_jax.errors import CheckpointError
from olmo_jax.model.config import HF_OLMOE_LAYOUT, MoEConfig, TransformerConfig
from olmo_jax.model.rope import scaling_of

ARCHITECTURE = "OlmoeForCausalLM"
MODEL_TYPE = "olmoe"
DEFAULT_MAX_POSITIONS = 4096


def _refuse(where: str, field: str, value: Any, why: str) -> CheckpointError:
    return CheckpointError(f"{where}: {field}={value!r} is not supported: {why}")


# Hugging Face's rope_type -> model.rope_scaling (OLMo-core's to_hf_config: PI is HF's
# linear, stepwise is llama3); ABF is plain RoPE with the new base.
_HF_ROPE_KINDS = {"default": "none", "linear": "pi", "llama3": "stepwise", "yarn": "yarn"}
# The fields each rope_type may carry besides rope_type / type / rope_theta.
_HF_ROPE_FIELDS = {
    "default": (), "linear": ("factor",),
    "llama3": ("factor", "original_max_position_embeddings", "low_freq_factor", "high_freq_factor"),
    "yarn": ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow",
             "attention_factor"),  # truncate: True only (OLMo-core's)
}


def rope_fields_of(hf: dict, where: str) -> dict:
    """The model's rope_* fields from `rope_parameters` (transformers 5) or the legacy
    `rope_theta` / `rope_scaling` (OLMo-core's olmo3moe export); a RoPE olmo_jax cannot
    compute exactly (another rope_type, partial rotation, mscale, untruncated YaRN) is
    refused, naming the field."""
    key = "rope_parameters" if hf.get("rope_parameters") is not None else "rope_scaling"
    params = dict(hf.get(key) or {})
    rope_type = params.pop("rope_type", params.pop("type", "default"))
    legacy = hf.get("rope_scaling") if key == "rope_parameters" else None
    if legacy and legacy.get("rope_type", legacy.get("type", "default")) != rope_type:
        raise _refuse(where, "rope_scaling", legacy,
                      f"it disagrees with rope_parameters.rope_type={rope_type!r}; keep one")
    theta = float(params.pop("rope_theta", hf.get("rope_theta") or 10000.0))
    if rope_type not in _HF_ROPE_KINDS:
        raise _refuse(where, f"{key}.rope_type", rope_type,
                      f"olmo_jax scales RoPE as one of {sorted(_HF_ROPE_KINDS)}")
    if params.get("partial_rotary_factor", 1.0) == 1.0:
        params.pop("partial_rotary_factor", None)
    if params.get("truncate", True) is True:
        params.pop("truncate", None)
    extra = sorted(set(params) - set(_HF_ROPE_FIELDS[rope_type]))
    if extra:
        raise _refuse(where, f"{key}.{extra[0]}", params[extra[0]],
                      f"olmo_jax's {rope_type} RoPE has no such parameter")
    out = {"rope_theta": theta, "rope_scaling": _HF_ROPE_KINDS[rope_type]}
    if rope_type == "default":
        return out

    def need(name):
        if params.get(name) is None:
            raise _refuse(where, f"{key}.{name}", None, f"{rope_type} RoPE needs it")
        return float(params[name])

    factor = need("factor")
    out["rope_scaling_factor"] = factor
    if rope_type == "llama3":
        out.update(rope_old_context_len=int(need("original_max_position_embeddings")),
                   rope_low_freq_proportion=1.0 - 1.0 / need("low_freq_factor"),
                   rope_high_freq_proportion=1.0 / need("high_freq_factor"))
    elif rope_type == "yarn":
        out.update(rope_old_context_len=int(need("original_max_position_embeddings")),
                   rope_beta_fast=float(params.get("beta_fast") or 32.0),
                   rope_beta_slow=float(params.get("beta_slow") or 1.0))
        attention = params.get("attention_factor")
        if attention is None:  # Hugging Face's default: 0.1 ln(factor) + 1, 1 for factor <= 1
            attention = 1.0 if factor <= 1 else 0.0
        elif float(attention) == 0.1 * math.log(factor) + 1.0:
            attention = 0.0  # olmo_jax's default for yarn
        out["rope_attention_factor"] = float(attention)
    return out


def hf_rope_parameters(cfg: TransformerConfig, where: str) -> dict:
    """Hugging Face `rope_parameters` of the model's RoPE, refusing (by field) a scaling HF
    would compute differently."""
    s = scaling_of(cfg)
    if s is None:
        return {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if s.kind != "yarn" and s.resolved_attention_factor != 1.0:
        raise _refuse(where, "model.rope_attention_factor", cfg.rope_attention_factor,
                      f"Hugging Face's {s.kind} RoPE does not scale the attention")
    if s.kind == "abf":
        return {"rope_type": "default", "rope_theta": s.resolved_new_theta}
    out = {"rope_theta": cfg.rope_theta, "factor": s.resolved_factor}
    if s.kind == "pi":
        return {"rope_type": "linear", **out}
    if s.kind == "stepwise":
        return {"rope_type": "llama3", **out, "original_max_position_embeddings": s.old_context_len,
                "low_freq_factor": 1.0 / (1 - s.low_freq_proportion),
                "high_freq_factor": 1.0 / s.high_freq_proportion}
    check_yarn_exact(cfg, where)
    return {"rope_type": "yarn", **out, "original_max_position_embeddings": s.old_context_len,
            "beta_fast": s.beta_fast, "beta_slow": s.beta_slow,
            "attention_factor": s.resolved_attention_factor}


def check_yarn_exact(cfg: TransformerConfig, where: str) -> None:
    """OLMo-core ends YaRN's ramp at head_dim / 2 - 1, Hugging Face at head_dim - 1: they
    differ when the ramp's low-frequency end lies beyond the last frequency."""
    if cfg.rope_scaling != "yarn":
        return
    s, dim = scaling_of(cfg), cfg.head_size
    high = math.ceil(dim * math.log(s.old_context_len / (s.beta_slow * 2 * math.pi))
                     / (2 * math.log(cfg.rope_theta)))
    if high > dim // 2 - 1:
        raise _refuse(where, "model.rope_beta_slow", s.beta_slow,
                      f"the YaRN ramp ends at dimension {high}, past head_dim / 2 - 1 = "
                      f"{dim // 2 - 1}, where Hugging Face and OLMo-core disagree; raise "
                      "rope_beta_slow or lower rope_old_context_len")


def from_hf_config(hf: dict, where: str = "config.json") -> TransformerConfig:
    """The olmo_jax model config of a Hugging Face OLMoE config.json."""
    archs = hf.get("architectures") or [ARCHITECTURE]
    if hf.get("model_type") != MODEL_TYPE or archs != [ARCHITECTURE]:
        raise CheckpointError(
            f"{where}: model_type={hf.get('model_type')!r}, architectures={archs!r}: only "
            f"model_type '{MODEL_TYPE}' ({ARCHITECTURE}) can be converted; other "
            "architectures (e.g. FlexOlmo, OLMo 2, Mixtral) differ in ways olmo_jax would "
            "have to approximate"
        )
    for field, supported, why in (
        ("attention_bias", False, "olmo_jax attention projections have no bias"),
        ("hidden_act", "silu", "olmo_jax experts are SwiGLU (silu)"),
        ("attention_dropout", 0.0, "olmo_jax has no attention dropout"),
        ("sliding_window", None, "OlmoeForCausalLM's causal mask has no window (its "
         "sliding_window reaches some attention kernels only), so the model it means is not "
         "one model; OLMo-core's olmo3moe export carries windows (olmo3moe-to-orbax)"),
    ):
        value = hf.get(field, supported)
        if value != supported:
            raise _refuse(where, field, value, why)
    d_model, n_heads = int(hf["hidden_size"]), int(hf["num_attention_heads"])
    if d_model % n_heads:
        raise _refuse(
            where, "num_attention_heads", n_heads, f"it must divide hidden_size={d_model}"
        )
    head_dim = hf.get("head_dim")
    if head_dim is not None and int(head_dim) != d_model // n_heads:
        raise _refuse(
            where,
            "head_dim",
            head_dim,
            f"OLMoE's QK-norm spans hidden_size, so head_dim must be hidden_size / "
            f"num_attention_heads = {d_model // n_heads}",
        )
    clip = hf.get("clip_qkv")
    if clip is not None and float(clip) <= 0:
        raise _refuse(where, "clip_qkv", clip, "it must be None or > 0")
    moe = MoEConfig(
        num_experts=int(hf["num_experts"]),
        top_k=int(hf["num_experts_per_tok"]),
        expert_hidden=int(hf["intermediate_size"]),
        gating="softmax",
        norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
        capacity_factor=0.0,
        lb_loss_coef=float(hf.get("router_aux_loss_coef", 0.01)),
        z_loss_coef=0.0,
        lb_loss_type="pooled",
    )
    cfg = TransformerConfig(
        vocab_size=int(hf["vocab_size"]),
        d_model=d_model,
        n_layers=int(hf["num_hidden_layers"]),
        n_heads=n_heads,
        n_kv_heads=int(hf.get("num_key_value_heads") or n_heads),
        head_dim=0,
        n_dense_layers=0,
        **rope_fields_of(hf, where),
        norm_eps=float(hf.get("rms_norm_eps", 1e-5)),
        **HF_OLMOE_LAYOUT,
        clip_qkv=float(clip) if clip is not None else 0.0,
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        init_std=float(hf.get("initializer_range", 0.02)),
        moe=moe,
    )
    check_yarn_exact(cfg, where)
    return cfg.validate(prefix=f"{where} (as model)")


def check_representable(cfg: TransformerConfig) -> None:
    """Refuses a model that OlmoeForCausalLM cannot represent exactly."""
    where = "Hugging Face OLMoE export"
    for field, value, ok, why in (
        ("model.n_dense_layers", cfg.n_dense_layers, 0, "OLMoE has no dense blocks"),
        ("model.moe.n_shared_experts", cfg.moe.n_shared_experts, 0, "OLMoE has no shared experts"),
        ("model.moe.gating", cfg.moe.gating, "softmax", "OLMoE routes with a softmax"),
        (
            "model.moe.router_weight_scale",
            cfg.moe.router_weight_scale,
            1.0,
            "OLMoE does not scale router weights",
        ),
        ("model.qk_norm", cfg.qk_norm, True, "OLMoE always applies QK-norm"),
        ("model.head_qk_norm", cfg.head_qk_norm, False, "OLMoE's QK-norm spans all heads"),
        ("model.block_norm", cfg.block_norm, "pre",
         "OLMoE blocks are pre-norm (OLMo-core's post / peri models: orbax-to-olmo3moe)"),
        ("model.embed_scale", cfg.embedding_scale, 0.0, "OLMoE does not scale its embeddings"),
        ("model.embedding_norm", cfg.embedding_norm, False, "OLMoE has no embedding norm"),
    ):
        if value != ok:
            raise _refuse(where, field, value, why)
    if any(cfg.layer_windows):
        raise _refuse(where, "model.window_pattern", cfg.window_pattern,
                      "OLMoE attends fully in every layer (a windowed model: orbax-to-olmo3moe)")
    if cfg.head_size * cfg.n_heads != cfg.d_model:
        raise _refuse(
            where,
            "model.head_dim",
            cfg.head_dim,
            "OLMoE's QK-norm spans hidden_size, so n_heads * head_dim must equal d_model",
        )


def to_hf_config(cfg: TransformerConfig, base: dict | None = None, dtype: str = "float32") -> dict:
    """config.json for `cfg`. `base` (the config.json the model came from, if any) keeps
    the fields olmo_jax does not model (token ids, max_position_embeddings, ...)."""
    check_representable(cfg)
    hf = {
        k: v
        for k, v in (base or {}).items()
        if k not in ("rope_theta", "rope_scaling", "torch_dtype", "transformers_version")
    }
    hf.update(
        {
            "architectures": [ARCHITECTURE],
            "model_type": MODEL_TYPE,
            "vocab_size": cfg.vocab_size,
            "hidden_size": cfg.d_model,
            "intermediate_size": cfg.moe.expert_hidden,
            "num_hidden_layers": cfg.n_layers,
            "num_attention_heads": cfg.n_heads,
            "num_key_value_heads": cfg.kv_heads,
            "hidden_act": "silu",
            "initializer_range": cfg.init_std,
            "rms_norm_eps": cfg.norm_eps,
            "tie_word_embeddings": cfg.tie_embeddings,
            "rope_parameters": hf_rope_parameters(cfg, "Hugging Face OLMoE export"),
            "attention_bias": False,
            "attention_dropout": 0.0,
            "clip_qkv": cfg.clip_qkv or None,
            "num_experts": cfg.moe.num_experts,
            "num_experts_per_tok": cfg.moe.top_k,
            "norm_topk_prob": cfg.moe.norm_topk_prob,
            "router_aux_loss_coef": cfg.moe.lb_loss_coef,
            "dtype": dtype,
        }
    )
    hf.pop("head_dim", None)
    for key, default in (
        ("max_position_embeddings", DEFAULT_MAX_POSITIONS),
        ("pad_token_id", None),
        ("bos_token_id", None),
        ("eos_token_id", None),
        ("use_cache", True),
        ("output_router_logits", False),
    ):
        hf.setdefault(key, default)
    return dict(sorted(hf.items()))
