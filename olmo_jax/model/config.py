"""The model's hyperparameters: plain frozen dataclasses, usable without the trainer.

`TransformerConfig` owns the architecture (an OLMoE-style decoder); `MoEConfig` owns the
routed feed-forward. Validation lives here so research code that builds a model by hand
gets the same clear errors as the command line.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import jax.numpy as jnp

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


class ConfigError(ValueError):
    """A configuration value is wrong; the message names the field and the fix."""


@dataclass(frozen=True)
class MoEConfig:
    num_experts: int = 8
    top_k: int = 2
    expert_hidden: int = 512
    # Router (model/moe/router.py; every option is documented in the README's routing table).
    gating: str = "softmax"  # softmax | sigmoid | topk_softmax
    norm_topk_prob: bool = False  # softmax gating: renormalize the k weights to sum to 1
    # sigmoid gating: renormalize the k weights to sum to 1 (OLMo-core renormalizes only
    # with normalize_expert_weights=1; without it the weights are the raw sigmoid scores).
    sigmoid_renorm: bool = True
    sigmoid_eps: float = 0.0  # added to the sigmoid scores (OLMo-core's sigmoid_stability_epsilon 1e-7)
    router_weight_scale: float = 1.0  # multiplies the combine weights
    n_group: int = 1  # group-limited routing: experts split into n_group groups ...
    topk_group: int = 1  # ... of which the best topk_group may be chosen from
    bias_rate: float = 0.0  # > 0: auxiliary-loss-free balancing with this bias step size
    # learned | random (OLMo-core: U(0,1) scores replace the gate) | random_choice (random
    # experts, learned weights) | uniform (round-robin); all but learned: system benchmarks.
    routing_mode: str = "learned"
    router_jitter: float = 0.0  # training only: router input *= U(1 - j, 1 + j)
    # Shared experts (always applied, added to the routed output).
    n_shared_experts: int = 0
    shared_hidden: int = 0
    # Dispatch: capacity_factor 0 = dropless; > 0 = per-expert capacity, overflow dropped.
    capacity_factor: float = 0.0
    gmm_impl: str = "auto"  # auto | tiled | pallas | ragged_dot | einsum (olmo_jax/kernels)
    # Expert GEMM precision: bf16 (= model.dtype) | mxfp8 (model/moe/mxfp8_experts.py).
    precision: str = "bf16"
    mxfp8_wgrad: bool = False  # mxfp8: also round the weight-gradient GEMM operands
    # Auxiliary losses.
    lb_loss_coef: float = 0.01
    z_loss_coef: float = 0.001
    lb_loss_type: str = "per_layer"  # per_layer (OLMo-core) | pooled (Hugging Face)
    # Counts the load-balancing loss sees: global (summed over every device's tokens) |
    # local (each data-parallel rank's own tokens, the per-rank losses averaged; OLMo-core's
    # local_batch) | instance (each sequence's own tokens, averaged; OLMo-core's instance).
    lb_granularity: str = "global"

    @property
    def experts_per_group(self) -> int:
        return self.num_experts // self.n_group

    def validate(self, prefix: str = "model.moe") -> None:
        if self.num_experts < 1:
            raise ConfigError(f"{prefix}.num_experts must be >= 1, got {self.num_experts}")
        if not 1 <= self.top_k <= self.num_experts:
            raise ConfigError(
                f"{prefix}.top_k={self.top_k} must be between 1 and "
                f"{prefix}.num_experts={self.num_experts}"
            )
        if self.expert_hidden < 1:
            raise ConfigError(f"{prefix}.expert_hidden must be >= 1, got {self.expert_hidden}")
        if self.gating not in ("softmax", "sigmoid", "topk_softmax"):
            raise ConfigError(
                f"{prefix}.gating={self.gating!r}: choose softmax, sigmoid or topk_softmax"
            )
        if self.n_shared_experts < 0 or (self.n_shared_experts > 0 and self.shared_hidden < 1):
            raise ConfigError(
                f"{prefix}.n_shared_experts={self.n_shared_experts} needs "
                f"{prefix}.shared_hidden >= 1 (got {self.shared_hidden})"
            )
        if self.capacity_factor < 0:
            raise ConfigError(
                f"{prefix}.capacity_factor must be >= 0 (0 = dropless), got {self.capacity_factor}"
            )
        if self.gmm_impl not in ("auto", "tiled", "pallas", "ragged_dot", "einsum"):
            raise ConfigError(
                f"{prefix}.gmm_impl={self.gmm_impl!r}: choose auto, tiled, pallas, ragged_dot or einsum"
            )
        if self.precision not in ("bf16", "mxfp8"):
            raise ConfigError(f"{prefix}.precision={self.precision!r}: choose bf16 or mxfp8")
        if self.precision == "mxfp8" and self.expert_hidden % 32:
            raise ConfigError(
                f"{prefix}.precision=mxfp8 quantizes blocks of 32 along the hidden size: "
                f"{prefix}.expert_hidden={self.expert_hidden} must be a multiple of 32"
            )
        if self.lb_loss_type not in ("per_layer", "pooled"):
            raise ConfigError(
                f"{prefix}.lb_loss_type={self.lb_loss_type!r}: choose per_layer or pooled"
            )
        self._validate_routing(prefix)

    def _validate_routing(self, prefix: str) -> None:
        if self.n_group < 1 or self.num_experts % self.n_group:
            raise ConfigError(
                f"{prefix}.n_group={self.n_group} must be >= 1 and divide "
                f"{prefix}.num_experts={self.num_experts}"
            )
        if not 1 <= self.topk_group <= self.n_group:
            raise ConfigError(
                f"{prefix}.topk_group={self.topk_group} must be between 1 and "
                f"{prefix}.n_group={self.n_group}"
            )
        if self.n_group > 1 and self.top_k > self.topk_group * self.experts_per_group:
            raise ConfigError(
                f"{prefix}.top_k={self.top_k} exceeds the experts in the selectable groups: "
                f"{prefix}.topk_group x experts per group = {self.topk_group} x "
                f"{self.experts_per_group}; raise {prefix}.topk_group or lower {prefix}.top_k"
            )
        if self.bias_rate < 0:
            raise ConfigError(f"{prefix}.bias_rate must be >= 0 (0 = off), got {self.bias_rate}")
        if self.routing_mode not in ROUTING_MODES:
            raise ConfigError(
                f"{prefix}.routing_mode={self.routing_mode!r}: choose one of "
                f"{', '.join(ROUTING_MODES)}"
            )
        # OLMo-core's refusals (nn/moe/v2/router.py): topk_softmax selects by the raw logits,
        # so group masking and random scores would be silently ignored there.
        if self.gating == "topk_softmax" and self.n_group > 1:
            raise ConfigError(
                f"{prefix}.n_group={self.n_group}: group-limited routing is not supported with "
                f"{prefix}.gating=topk_softmax (as in OLMo-core); use softmax or sigmoid gating "
                f"or set {prefix}.n_group=1"
            )
        if self.gating == "topk_softmax" and self.routing_mode == "random":
            raise ConfigError(
                f"{prefix}.routing_mode=random replaces the gate scores, which "
                f"{prefix}.gating=topk_softmax does not select by (OLMo-core refuses it too); "
                f"use softmax or sigmoid gating, or routing_mode=random_choice"
            )
        if self.sigmoid_eps < 0:
            raise ConfigError(f"{prefix}.sigmoid_eps must be >= 0, got {self.sigmoid_eps}")
        if not 0 <= self.router_jitter < 1:
            raise ConfigError(
                f"{prefix}.router_jitter must be in [0, 1) (0 = off), got {self.router_jitter}"
            )
        if self.lb_granularity not in ("global", "local", "instance"):
            raise ConfigError(
                f"{prefix}.lb_granularity={self.lb_granularity!r}: choose global, local or instance"
            )
        if self.lb_loss_coef < 0 or self.z_loss_coef < 0:
            raise ConfigError(
                f"{prefix}.lb_loss_coef={self.lb_loss_coef} and {prefix}.z_loss_coef="
                f"{self.z_loss_coef} must be >= 0"
            )
        if self.router_weight_scale <= 0:
            raise ConfigError(
                f"{prefix}.router_weight_scale must be > 0, got {self.router_weight_scale}"
            )


ROUTING_MODES = ("learned", "random", "random_choice", "uniform")
ATTENTION_IMPLS = ("auto", "cudnn", "xla")
# OLMo-core's block layouts (nn/transformer/block.py, nn/ddp/block.py): pre = x + f(norm(x));
# post = its "reordered" norm, x + norm(f(x)); peri = x + norm(f(norm(x))).
BLOCK_NORMS = ("pre", "post", "peri")


@dataclass(frozen=True)
class TransformerConfig:
    vocab_size: int = 384
    d_model: int = 256
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 0  # 0 = n_heads (no grouping)
    head_dim: int = 0  # 0 = d_model // n_heads
    n_dense_layers: int = 0  # the first blocks use a dense SwiGLU MLP instead of MoE
    dense_hidden: int = 0  # hidden size of those dense MLPs (0 = 4 * d_model)
    rope_theta: float = 500_000.0
    norm_eps: float = 1e-5
    qk_norm: bool = True
    head_qk_norm: bool = False  # QK-norm per head over head_dim, one [head_dim] weight (OLMo-core's use_head_qk_norm)
    block_norm: str = "pre"  # BLOCK_NORMS: pre | post (OLMo-core's reordered norm) | peri
    embed_scale: float = 0.0  # embeddings *= embed_scale (0 = off; OLMo-core: sqrt(d_model))
    embedding_norm: bool = False  # RMSNorm of the (scaled) embeddings (OLMo-core's embedding_norm)
    clip_qkv: float = 0.0  # 0 = off; else clamp q, k, v to [-clip_qkv, clip_qkv]
    tie_embeddings: bool = False
    init_std: float = 0.02
    dtype: str = "float32"  # compute dtype; parameters are always float32
    remat: str = "none"  # none | block | attention
    scan_unroll: int = 1  # layers per iteration of the layer scan (compile time grows with it)
    attention_precision: str = "bf16"  # bf16 (= dtype) | mxfp8: q/k/v/o projection GEMMs
    attention_impl: str = "auto"  # auto | cudnn | xla: the softmax(q k^T) v core (model/attention.py)
    moe: MoEConfig = field(default_factory=MoEConfig)

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def head_size(self) -> int:
        return self.head_dim or self.d_model // self.n_heads

    @property
    def dense_hidden_size(self) -> int:
        return self.dense_hidden or 4 * self.d_model

    @property
    def n_moe_layers(self) -> int:
        return self.n_layers - self.n_dense_layers

    @property
    def compute_dtype(self):
        return DTYPES[self.dtype]

    def replace(self, **kw) -> TransformerConfig:
        return dataclasses.replace(self, **kw)

    def validate(self, prefix: str = "model") -> TransformerConfig:
        for name in ("vocab_size", "d_model", "n_layers", "n_heads"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{prefix}.{name} must be >= 1, got {getattr(self, name)}")
        if self.head_dim == 0 and self.d_model % self.n_heads:
            raise ConfigError(
                f"{prefix}.n_heads={self.n_heads} does not divide {prefix}.d_model={self.d_model}; "
                f"change one of them or set {prefix}.head_dim explicitly"
            )
        if self.head_size % 2:
            raise ConfigError(f"head size {self.head_size} must be even for RoPE")
        if self.n_heads % self.kv_heads:
            raise ConfigError(
                f"{prefix}.n_kv_heads={self.kv_heads} must divide {prefix}.n_heads={self.n_heads}"
            )
        if not 0 <= self.n_dense_layers <= self.n_layers:
            raise ConfigError(
                f"{prefix}.n_dense_layers={self.n_dense_layers} must be in [0, "
                f"{prefix}.n_layers={self.n_layers}]"
            )
        if self.dtype not in DTYPES:
            raise ConfigError(f"{prefix}.dtype={self.dtype!r}: choose one of {sorted(DTYPES)}")
        if self.block_norm not in BLOCK_NORMS:
            raise ConfigError(
                f"{prefix}.block_norm={self.block_norm!r}: choose one of {', '.join(BLOCK_NORMS)}"
            )
        if self.embed_scale < 0:
            raise ConfigError(f"{prefix}.embed_scale must be >= 0 (0 = off), got {self.embed_scale}")
        if self.scan_unroll < 1:
            raise ConfigError(f"{prefix}.scan_unroll must be >= 1, got {self.scan_unroll}")
        if self.remat not in ("none", "block", "attention"):
            raise ConfigError(f"{prefix}.remat={self.remat!r}: choose none, block or attention")
        if self.attention_precision not in ("bf16", "mxfp8"):
            raise ConfigError(
                f"{prefix}.attention_precision={self.attention_precision!r}: choose bf16 or mxfp8"
            )
        if self.attention_impl not in ATTENTION_IMPLS:
            raise ConfigError(
                f"{prefix}.attention_impl={self.attention_impl!r}: choose one of "
                f"{', '.join(ATTENTION_IMPLS)}"
            )
        widths = (self.d_model, self.n_heads * self.head_size, self.kv_heads * self.head_size)
        if self.attention_precision == "mxfp8" and any(w % 32 for w in widths):
            raise ConfigError(
                f"{prefix}.attention_precision=mxfp8 quantizes blocks of 32: d_model, "
                f"n_heads*head_dim and n_kv_heads*head_dim ({widths}) must be multiples of 32"
            )
        if self.moe.precision == "mxfp8" and self.d_model % 32:
            raise ConfigError(
                f"{prefix}.moe.precision=mxfp8 quantizes blocks of 32 along d_model: "
                f"{prefix}.d_model={self.d_model} must be a multiple of 32"
            )
        self.moe.validate(prefix + ".moe")
        return self
