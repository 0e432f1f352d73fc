"""Hugging Face `OlmoeConfig` (config.json) <-> `TransformerConfig`, refusing what the
other side cannot represent (never approximating it); each refusal names the field.

Field map (HF -> olmo_jax):
  hidden_size -> d_model, num_hidden_layers -> n_layers, num_attention_heads -> n_heads,
  num_key_value_heads -> n_kv_heads, intermediate_size -> moe.expert_hidden,
  num_experts -> moe.num_experts, num_experts_per_tok -> moe.top_k,
  norm_topk_prob -> moe.norm_topk_prob, rope_parameters.rope_theta (or legacy rope_theta)
  -> rope_theta, rms_norm_eps -> norm_eps, clip_qkv (None = off) -> clip_qkv (0 = off),
  tie_word_embeddings -> tie_embeddings, initializer_range -> init_std,
  router_aux_loss_coef -> moe.lb_loss_coef with moe.lb_loss_type = "pooled" and
  moe.z_loss_coef = 0 (Hugging Face's training loss: pooled over layers, no z-loss).
OLMoE has no dense blocks, no shared experts, softmax gating and QK-norm over all heads.
"""

from __future__ import annotations

from typing import Any

from olmo_jax.errors import CheckpointError
from olmo_jax.model.config import HF_OLMOE_LAYOUT, MoEConfig, TransformerConfig

ARCHITECTURE = "OlmoeForCausalLM"
MODEL_TYPE = "olmoe"
DEFAULT_MAX_POSITIONS = 4096


def _refuse(where: str, field: str, value: Any, why: str) -> CheckpointError:
    return CheckpointError(f"{where}: {field}={value!r} is not supported: {why}")


def rope_theta_of(hf: dict, where: str) -> float:
    """The RoPE base from `rope_parameters` (transformers 5) or legacy `rope_theta` /
    `rope_scaling`; anything but plain (default) RoPE is refused."""
    params = hf.get("rope_parameters")
    if params is not None:
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type != "default":
            raise _refuse(
                where,
                "rope_parameters.rope_type",
                rope_type,
                "olmo_jax implements plain RoPE only (no scaling)",
            )
        extra = sorted(set(params) - {"rope_type", "type", "rope_theta"})
        if extra:
            raise _refuse(
                where,
                f"rope_parameters.{extra[0]}",
                params[extra[0]],
                "olmo_jax implements plain RoPE only (no scaling)",
            )
        return float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    scaling = hf.get("rope_scaling")
    if scaling is not None and scaling.get("rope_type", scaling.get("type")) != "default":
        raise _refuse(where, "rope_scaling", scaling, "olmo_jax implements plain RoPE only")
    return float(hf.get("rope_theta", 10000.0))


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
        ("sliding_window", None, "olmo_jax attention is full causal"),
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
        rope_theta=rope_theta_of(hf, where),
        norm_eps=float(hf.get("rms_norm_eps", 1e-5)),
        **HF_OLMOE_LAYOUT,
        clip_qkv=float(clip) if clip is not None else 0.0,
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        init_std=float(hf.get("initializer_range", 0.02)),
        moe=moe,
    )
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
            "rope_parameters": {"rope_theta": cfg.rope_theta, "rope_type": "default"},
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
