"""The model's hyperparameters: plain frozen dataclasses, usable without the trainer.

`TransformerConfig` owns the architecture (an OLMoE-style decoder); `MoEConfig` owns the
routed feed-forward. These fields ARE the run config's `model` section: olmo_jax/config.py
generates that ConfigDict from them, so each field's default and doc live here, once.
Validation lives here so research code that builds a model by hand gets the same clear
errors as the command line. The choice lists of what the model's own modules
implement (attention core, block layout, remat, router) are declared here, with the schema
that checks them, so this module imports none of those modules.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass, field
from typing import Literal, get_args

import jax.numpy as jnp

from olmo_jax.errors import ConfigError, check_choice
from olmo_jax.kernels.ring_attention import CONTEXT_ATTENTIONS, RING_HOPS, ContextAttention, RingHops
from olmo_jax.kernels.select import (
    ATTENTION_IMPLS,
    GMM_IMPLS,
    MXFP8_GEMM_IMPLS,
    NORM_IMPLS,
    AttentionImpl,
    GmmImpl,
    Mxfp8GemmImpl,
    NormImpl,
)
from olmo_jax.model.moe.losses import LB_GRANULARITIES, LB_LOSS_TYPES
from olmo_jax.model.mxfp8_gemm import PRECISIONS

# Dtype names -> dtypes, the one table: model.dtype (the compute dtype) and the tensor dtype
# of a Hugging Face export (olmo_jax/checkpoint/hf.py, `convert orbax-to-hf --dtype`).
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
# The compute dtypes: float16 is a storage dtype only. The trainer has no loss scaling, so
# float16 activations and gradients would underflow; model.dtype refuses it.
COMPUTE_DTYPES = ("float32", "bfloat16")
# Choices implemented by transformer.py and moe/router.py, declared with the schema that
# checks them. The kernel choices (model.attention_impl, model.moe.gmm_impl,
# model.norm_impl, model.mxfp8_gemm_impl) are the lower kernels layer's table,
# olmo_jax/kernels/select.py, imported above.
# model.remat: none | block (each block's activations recomputed in the backward pass,
# transformer.run_blocks) | attention (the attention sub-layer only, transformer.Block) |
# mlp (the feed-forward sub-layer only, dense or MoE: the attention's activations kept) |
# dots (the block, keeping every weight GEMM's output: norms, RoPE, SwiGLU and the
# attention core recomputed; OLMo-core's "selected ops", transformer.block_step)
Remat = Literal["none", "block", "attention", "mlp", "dots"]
REMATS = get_args(Remat)
# model.block_norm, OLMo-core's block layouts (nn/transformer/block.py, nn/ddp/block.py):
# pre = x + f(norm(x)); post = its "reordered" norm, x + norm(f(x)); peri = x + norm(f(norm(x))).
BlockNorm = Literal["pre", "post", "peri"]
BLOCK_NORMS = get_args(BlockNorm)
Gating = Literal["softmax", "sigmoid", "topk_softmax"]  # model.moe.gating (router.gate_scores)
GATINGS = get_args(Gating)
# model.rope_scaling, OLMo-core's RoPE scalings (nn/rope.py; model/rope.inv_freq): none |
# abf (a new base) | pi (position interpolation) | stepwise (Llama 3.1's per-band) | yarn
RopeScalingKind = Literal["none", "abf", "pi", "stepwise", "yarn"]
ROPE_SCALINGS = get_args(RopeScalingKind)
# model.rope_scaling_layers: the layers model.rope_scaling applies to: full (the
# full-attention layers; the sliding-window ones keep plain RoPE: OLMo-core's
# `with_rope_scaling(full_attn_layers_only=True)`, Hugging Face Olmo3's per-layer-type
# rope_parameters) | all (every layer)
RopeScalingLayers = Literal["full", "all"]
ROPE_SCALING_LAYERS = get_args(RopeScalingLayers)
# model.moe.routing_mode (router.route): learned | random (OLMo-core: U(0,1) scores replace
# the gate) | random_choice (random experts, learned weights) | uniform (round-robin)
RoutingMode = Literal["learned", "random", "random_choice", "uniform"]
ROUTING_MODES = get_args(RoutingMode)
# The run config's value of a field when it differs from the dataclass default (metadata).
RUN_DEFAULT = "run_default"

# The block layout of Hugging Face's OLMoE (OlmoeForCausalLM): pre-norm blocks, one QK-norm
# over all heads, embeddings neither scaled nor normed. The defaults below are OLMo-core 3's
# reference MoE layout instead (its 47B script: the reordered post-norm, per-head QK-norm,
# embeddings scaled by sqrt(d_model) and RMSNormed, eps 1e-6, init std 0.01);
# checkpoint/hf_config.from_hf_config sets this layout, and a model built with it exports to HF.
HF_OLMOE_LAYOUT = {"block_norm": "pre", "qk_norm": True, "head_qk_norm": False,
                   "embed_scale": 0.0, "embedding_norm": False}

# What a model field that a saved config lacks meant when that config was written: the
# architecture fields issue 16 added, whose defaults are OLMo-core's now (a checkpoint from
# before them is a pre-norm model without those norms). checkpoint/manager reads with it.
ABSENT_FIELD_MEANING = {"block_norm": "pre", "head_qk_norm": False, "embed_scale": 0.0,
                        "embedding_norm": False, "lm_z_loss_coef": 0.0}

__all__ = ["ABSENT_FIELD_MEANING", "COMPUTE_DTYPES", "DTYPES", "HF_OLMOE_LAYOUT", "MoEConfig",
           "ROPE_SCALINGS", "TransformerConfig"]


@dataclass(frozen=True)
class MoEConfig:
    num_experts: int = 8
    top_k: int = 2
    expert_hidden: int = 512
    # Router (model/moe/router.py; every option is documented in docs/training.md's routing table).
    gating: Gating = "softmax"  # GATINGS: softmax | sigmoid | topk_softmax
    norm_topk_prob: bool = False  # softmax gating: renormalize the k weights to sum to 1
    # sigmoid gating: renormalize the k weights to sum to 1 (OLMo-core renormalizes only
    # with normalize_expert_weights=1; without it the weights are the raw sigmoid scores).
    sigmoid_renorm: bool = True
    sigmoid_eps: float = 0.0  # added to the sigmoid scores (OLMo-core's sigmoid_stability_epsilon 1e-7)
    router_weight_scale: float = 1.0  # multiplies the combine weights
    n_group: int = 1  # group-limited routing: experts split into n_group groups (1 = off) ...
    topk_group: int = 1  # ... of which the best topk_group may be chosen from
    bias_rate: float = 0.0  # > 0: auxiliary-loss-free balancing with this bias step size (0 = off)
    # ROUTING_MODES: learned | random (OLMo-core: U(0,1) scores replace the gate) |
    # random_choice (random experts, learned weights) | uniform (round-robin); all but
    # learned: system benchmarks.
    routing_mode: RoutingMode = "learned"
    router_jitter: float = 0.0  # training only: router input *= U(1 - j, 1 + j)
    # Shared experts (always applied, added to the routed output).
    n_shared_experts: int = 0
    shared_hidden: int = 0
    # Expert capacity, the one capacity factor of every dispatch: each expert's buffer holds
    # ceil(capacity_factor x tokens x top_k / num_experts) rows, overflow is dropped
    # (dropped_frac). 0 = dropless where the dispatch can be: one rank (model/moe/layer.py),
    # parallel.dispatch=ragged or allgather; rowwise dispatch (parallel.expert > 1) has fixed
    # receive slots and then uses OLMo-core's 1.25 (parallel/expert ROWWISE_CAPACITY_FACTOR).
    capacity_factor: float = 0.0
    gmm_impl: GmmImpl = "auto"  # GMM_IMPLS; which runs where: olmo_jax/kernels/select.py
    # Expert GEMM precision (model/mxfp8_gemm.PRECISIONS): bf16 (= model.dtype) | mxfp8
    # (model/moe/mxfp8_experts.py).
    precision: str = "bf16"
    mxfp8_wgrad: bool = False  # mxfp8: also round the weight-gradient GEMM operands
    # Auxiliary losses (model/moe/losses.py).
    lb_loss_coef: float = 0.01
    z_loss_coef: float = 0.001
    lb_loss_type: str = "per_layer"  # losses.LB_LOSS_TYPES: per_layer (OLMo-core) | pooled (HF)
    # Counts the load-balancing loss sees (losses.LB_GRANULARITIES): global (summed over every
    # device's tokens) | local (each data-parallel rank's own tokens, the per-rank losses
    # averaged; OLMo-core's local_batch) | instance (each sequence's own tokens, averaged;
    # OLMo-core's instance).
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
        check_choice(f"{prefix}.gating", self.gating, GATINGS, one_of=False)
        if self.n_shared_experts < 0 or (self.n_shared_experts > 0 and self.shared_hidden < 1):
            raise ConfigError(
                f"{prefix}.n_shared_experts={self.n_shared_experts} needs "
                f"{prefix}.shared_hidden >= 1 (got {self.shared_hidden})"
            )
        if self.capacity_factor < 0:
            raise ConfigError(
                f"{prefix}.capacity_factor must be >= 0 (0 = dropless), got {self.capacity_factor}"
            )
        check_choice(f"{prefix}.gmm_impl", self.gmm_impl, GMM_IMPLS, one_of=False)
        check_choice(f"{prefix}.precision", self.precision, PRECISIONS, one_of=False)
        if self.precision == "mxfp8" and self.expert_hidden % 32:
            raise ConfigError(
                f"{prefix}.precision=mxfp8 quantizes blocks of 32 along the hidden size: "
                f"{prefix}.expert_hidden={self.expert_hidden} must be a multiple of 32"
            )
        check_choice(f"{prefix}.lb_loss_type", self.lb_loss_type, LB_LOSS_TYPES, one_of=False)
        self._validate_routing(prefix, ROUTING_MODES)

    def _validate_routing(self, prefix: str, routing_modes) -> None:
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
        check_choice(f"{prefix}.routing_mode", self.routing_mode, routing_modes, one_of=False)
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
        check_choice(f"{prefix}.lb_granularity", self.lb_granularity, LB_GRANULARITIES, one_of=False)
        if self.lb_loss_coef < 0 or self.z_loss_coef < 0:
            raise ConfigError(
                f"{prefix}.lb_loss_coef={self.lb_loss_coef} and {prefix}.z_loss_coef="
                f"{self.z_loss_coef} must be >= 0"
            )
        if self.router_weight_scale <= 0:
            raise ConfigError(
                f"{prefix}.router_weight_scale must be > 0, got {self.router_weight_scale}"
            )


@dataclass(frozen=True)
class TransformerConfig:
    # The resolved vocabulary; the run config's 0 = the tokenizer's padded vocabulary
    # (olmo_jax.config.model_config fills it in).
    vocab_size: int = field(default=384, metadata={RUN_DEFAULT: 0})
    d_model: int = 256
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 0  # 0 = n_heads (no grouping)
    head_dim: int = 0  # 0 = d_model // n_heads
    n_dense_layers: int = 0  # the first blocks use a dense SwiGLU MLP instead of MoE
    dense_hidden: int = 0  # hidden size of those dense MLPs (0 = 4 * d_model)
    rope_theta: float = 500_000.0
    # RoPE scaling for long context (model/rope.py, OLMo-core's nn/rope.py; docs/training.md).
    rope_scaling: RopeScalingKind = "none"  # ROPE_SCALINGS: none | abf | pi | stepwise | yarn
    rope_scaling_layers: RopeScalingLayers = "full"  # ROPE_SCALING_LAYERS: full | all
    # pi / stepwise / yarn: the context expansion multiplier; 0 = OLMo-core's default (2 / 32 / 8)
    rope_scaling_factor: float = 0.0
    rope_new_theta: float = 0.0  # abf: the new RoPE base; 0 = OLMo-core's 8,000,000
    rope_old_context_len: int = 8192  # stepwise / yarn: the length the base model trained at
    rope_low_freq_proportion: float = 0.0  # stepwise: the low-frequency (fully scaled) band
    rope_high_freq_proportion: float = 0.25  # stepwise: the high-frequency (unchanged) band
    rope_beta_fast: float = 32.0  # yarn: the ramp's high-frequency end, in rotations
    rope_beta_slow: float = 1.0  # yarn: the ramp's low-frequency end, in rotations
    # The factor the cos / sin tables are multiplied by (q and k each, so the attention
    # scores by its square); 0 = the scaling's own: yarn 0.1 ln(factor) + 1, the others 1.
    rope_attention_factor: float = 0.0
    norm_eps: float = 1e-6  # RMSNorm epsilon (OLMo-core 3 reference: 1e-6; HF OLMoE: 1e-5)
    qk_norm: bool = True
    head_qk_norm: bool = True  # QK-norm per head over head_dim, one [head_dim] weight (OLMo-core's use_head_qk_norm)
    block_norm: BlockNorm = "post"  # BLOCK_NORMS: pre | post (OLMo-core's reordered norm) | peri
    # embeddings *= this: -1 = sqrt(d_model) (OLMo-core 3's reference), 0 = off, > 0 = this factor
    embed_scale: float = -1.0
    embedding_norm: bool = True  # RMSNorm of the (scaled) embeddings (OLMo-core's embedding_norm)
    # 0 = off; else clamp q, k, v to [-clip_qkv, clip_qkv] after the QK-norm (Hugging Face
    # OLMoE's order; OLMo-core clamps before its QK-norm, and olmo3moe exports refuse it)
    clip_qkv: float = 0.0
    tie_embeddings: bool = False
    init_std: float = 0.01  # OLMo-core 3 reference: 0.01; HF OLMoE initializer_range: 0.02
    # The LM head's z-loss: coef * mean over labelled tokens of logsumexp(logits)^2
    # (OLMo-core's z_loss_multiplier; its reference runs use 1e-4). 0 = off.
    lm_z_loss_coef: float = 0.0
    # The LM loss chunked over this many tokens with its own VJP (model/lm_loss.py): no
    # float32 [B, T, V] logits are held, one chunk's at a time (the head's forward GEMM is
    # recomputed in the backward). 0 = off: the whole batch's logits, then the loss.
    lm_loss_chunk: int = 0
    dtype: str = "float32"  # compute dtype, COMPUTE_DTYPES: float32 | bfloat16 (params: float32)
    remat: Remat = "none"  # REMATS: none | block | attention | mlp | dots
    scan_unroll: int = 1  # blocks per layer-scan iteration (= n_layers unrolls; compile time grows)
    attention_precision: str = "bf16"  # model/mxfp8_gemm.PRECISIONS: bf16 (= dtype) | mxfp8 (q/k/v/o GEMMs)
    # ATTENTION_IMPLS, the softmax(q k^T) v core (model/attention.py): auto | cudnn | blas |
    # xla; which runs where: olmo_jax/kernels/select.py
    attention_impl: AttentionImpl = "auto"
    # NORM_IMPLS, the RMSNorm (model/norm.py): auto | blas (the CPU FFI kernel) | xla
    norm_impl: NormImpl = "auto"
    # MXFP8_GEMM_IMPLS, the MXFP8 GEMMs (model/mxfp8_gemm.py): auto | scaled_matmul (cuDNN's
    # block-scaled GEMM, Blackwell) | dequantize; which runs where: olmo_jax/kernels/select.py
    mxfp8_gemm_impl: Mxfp8GemmImpl = "auto"
    # Document masking (model/attention.py): >= 0 = the token id that ends a document (EOS);
    # attention stays inside each document of a packed sequence and RoPE positions restart
    # at each document's start. -1 = off. The trainer sets it from data.doc_mask and the
    # tokenizer's eos_id (olmo_jax.config.RunConfig.model_config).
    doc_mask_eos: int = -1
    # Document masking on cuDNN (attention_impl cudnn): the documents a row may hold in
    # cuDNN's packed layout, whose softmax statistics are [B * this, heads, T] float32 (this
    # times the unmasked step's). A row with more attends its documents past the last slot
    # as one; the xla and blas cores have no limit. data/loader.document_lengths counts them.
    cudnn_max_docs: int = 16
    # Context parallelism (parallel.context > 1; olmo_jax/kernels/ring_attention.py): the
    # attention over the sequence's shards, CONTEXT_ATTENTIONS: ring (K/V passed around the
    # ring) | allgather (K/V all-gathered). `context_parallel` is set by the parallel plan
    # from parallel.context (the model then runs inside the plan's shard_map); leave it 1.
    # `context_ring_hops` (RING_HOPS), how the ring's K/V travel, is set by the plan too:
    # permute (collective-permutes around the ring), or pairs under a pipeline
    # (parallel.pipe > 1: exchanges inside pairs of context ranks, whose replica groups
    # stay inside a stage; ring_attention._ring_loop).
    context_attention: ContextAttention = "ring"
    context_parallel: int = 1
    context_ring_hops: RingHops = "permute"
    # Sliding-window attention per layer, OLMo-core's SlidingWindowAttentionConfig
    # (nn/attention/__init__.py; `layer_windows`): window sizes in tokens cycled over the
    # layers, -1 = full attention, e.g. (4096, 4096, 4096, -1): three windowed layers of
    # every four. Empty = off (every layer full). A query at t attends keys [t - W + 1, t].
    window_pattern: tuple[int, ...] = ()
    # The first / last layer attends fully whatever the pattern says (OLMo-core's
    # force_full_attention_on_first_layer / _last_layer, both True by default there; OLMo
    # 3 sets first False, last True). With the first forced, the pattern starts at layer 1.
    window_full_first: bool = True
    window_full_last: bool = True
    moe: MoEConfig = field(default_factory=MoEConfig)

    def __post_init__(self):  # a list (a saved config's JSON) -> a tuple: configs hash
        pattern = self.window_pattern
        if isinstance(pattern, (list, tuple)):
            pattern = tuple(int(w) if isinstance(w, numbers.Integral) and not isinstance(w, bool)
                            else w for w in pattern)
        object.__setattr__(self, "window_pattern", pattern)

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
    def embedding_scale(self) -> float:
        """The factor the embeddings are multiplied by (0.0 = none): embed_scale resolved."""
        return math.sqrt(self.d_model) if self.embed_scale == -1 else float(self.embed_scale)

    @property
    def layer_windows(self) -> tuple[int, ...]:
        """Each layer's sliding window in tokens, 0 = full attention: OLMo-core's
        `SlidingWindowAttentionConfig._get_window_size` (its -1 is 0 here, the cores' "no
        window"). Layer i takes pattern[(i - 1 if window_full_first else i) % len(pattern)]
        unless it is a forced-full first or last layer."""
        n, pat = self.n_layers, self.window_pattern
        if not pat:
            return (0,) * n
        out = []
        for i in range(n):
            if (self.window_full_first and i == 0) or (self.window_full_last and i == n - 1):
                out.append(0)
                continue
            w = pat[(i - 1 if self.window_full_first else i) % len(pat)]
            out.append(0 if w == -1 else int(w))
        return tuple(out)

    @property
    def window_choices(self) -> tuple[int, ...]:
        """The distinct windows of the layers, sorted (0 = full first): what an attention
        layer compiles a core for (model/attention.py); one entry = a static window."""
        return tuple(sorted(set(self.layer_windows)))

    @property
    def layer_window_index(self) -> tuple[int, ...]:
        """Each layer's window as an index into `window_choices` (the scanned per-layer
        value, transformer.run_blocks)."""
        choices = self.window_choices
        return tuple(choices.index(w) for w in self.layer_windows)

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
        self._validate_rope(prefix)
        if self.lm_loss_chunk < 0:
            raise ConfigError(
                f"{prefix}.lm_loss_chunk must be >= 0 (0 = off; else tokens per chunk, e.g. "
                f"1024), got {self.lm_loss_chunk}")
        if self.lm_z_loss_coef < 0:
            raise ConfigError(f"{prefix}.lm_z_loss_coef must be >= 0 (0 = off), got {self.lm_z_loss_coef}")
        if self.n_heads % self.kv_heads:
            raise ConfigError(
                f"{prefix}.n_kv_heads={self.kv_heads} must divide {prefix}.n_heads={self.n_heads}"
            )
        if not 0 <= self.n_dense_layers <= self.n_layers:
            raise ConfigError(
                f"{prefix}.n_dense_layers={self.n_dense_layers} must be in [0, "
                f"{prefix}.n_layers={self.n_layers}]"
            )
        check_choice(f"{prefix}.dtype", self.dtype, COMPUTE_DTYPES)
        if self.embed_scale < 0 and self.embed_scale != -1:
            raise ConfigError(
                f"{prefix}.embed_scale must be -1 (sqrt(d_model)), 0 (off) or > 0, got {self.embed_scale}"
            )
        if self.scan_unroll < 1:
            raise ConfigError(f"{prefix}.scan_unroll must be >= 1, got {self.scan_unroll}")
        if self.cudnn_max_docs < 1:
            raise ConfigError(f"{prefix}.cudnn_max_docs must be >= 1, got {self.cudnn_max_docs}")
        if not -1 <= self.doc_mask_eos < self.vocab_size:
            raise ConfigError(
                f"{prefix}.doc_mask_eos={self.doc_mask_eos} must be -1 (off) or a token id below "
                f"{prefix}.vocab_size={self.vocab_size}; turn document masking on with "
                "data.doc_mask=True instead (it takes the tokenizer's EOS id)")
        check_choice(f"{prefix}.block_norm", self.block_norm, BLOCK_NORMS)
        check_choice(f"{prefix}.remat", self.remat, REMATS, one_of=False)
        check_choice(f"{prefix}.attention_precision", self.attention_precision, PRECISIONS, one_of=False)
        check_choice(f"{prefix}.attention_impl", self.attention_impl, ATTENTION_IMPLS)
        check_choice(f"{prefix}.norm_impl", self.norm_impl, NORM_IMPLS)
        check_choice(f"{prefix}.mxfp8_gemm_impl", self.mxfp8_gemm_impl, MXFP8_GEMM_IMPLS)
        check_choice(f"{prefix}.context_attention", self.context_attention, CONTEXT_ATTENTIONS)
        check_choice(f"{prefix}.context_ring_hops", self.context_ring_hops, RING_HOPS)
        if self.context_parallel < 1:
            raise ConfigError(f"{prefix}.context_parallel must be >= 1 (set by the plan from "
                              f"parallel.context), got {self.context_parallel}")
        self._validate_windows(prefix)
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

    def _validate_windows(self, prefix: str) -> None:
        if not isinstance(self.window_pattern, tuple):
            raise ConfigError(
                f"{prefix}.window_pattern={self.window_pattern!r} must be a tuple of windows in "
                f"tokens (-1 = full attention), e.g. (4096, 4096, 4096, -1), or () for off")
        for i, w in enumerate(self.window_pattern):
            if isinstance(w, bool) or not isinstance(w, int) or (w < 1 and w != -1):
                raise ConfigError(
                    f"{prefix}.window_pattern[{i}]={w!r}: each entry is a window in tokens "
                    f"(an int >= 1) or -1 for full attention, e.g. (4096, 4096, 4096, -1); "
                    f"() turns sliding windows off")

    def _validate_rope(self, prefix: str) -> None:
        check_choice(f"{prefix}.rope_scaling", self.rope_scaling, ROPE_SCALINGS, one_of=False)
        check_choice(f"{prefix}.rope_scaling_layers", self.rope_scaling_layers, ROPE_SCALING_LAYERS,
                     one_of=False)
        if self.rope_theta <= 0:
            raise ConfigError(f"{prefix}.rope_theta must be > 0, got {self.rope_theta}")
        for name in ("rope_scaling_factor", "rope_new_theta", "rope_attention_factor"):
            value = getattr(self, name)
            if value < 0:
                raise ConfigError(f"{prefix}.{name} must be >= 0 (0 = the default), got {value}")
            if value and self.rope_scaling == "none":
                raise ConfigError(
                    f"{prefix}.{name}={value} has no effect with {prefix}.rope_scaling=none; "
                    f"choose a scaling (abf | pi | stepwise | yarn) or leave it at 0"
                )
        if self.rope_old_context_len < 1:
            raise ConfigError(
                f"{prefix}.rope_old_context_len must be >= 1, got {self.rope_old_context_len}")
        low, high = self.rope_low_freq_proportion, self.rope_high_freq_proportion
        if not (0 <= low < 1 and 0 < high <= 1 and low + high < 1):
            raise ConfigError(
                f"{prefix}.rope_low_freq_proportion={low} and {prefix}.rope_high_freq_proportion="
                f"{high} must satisfy 0 <= low < 1, 0 < high <= 1 and low + high < 1 (the "
                "stepwise bands may not overlap)"
            )
        if not 0 < self.rope_beta_slow < self.rope_beta_fast:
            raise ConfigError(
                f"{prefix}.rope_beta_slow={self.rope_beta_slow} and {prefix}.rope_beta_fast="
                f"{self.rope_beta_fast} must satisfy 0 < beta_slow < beta_fast"
            )
