"""Throughput accounting: FLOPs per token (OLMo-core's formula), peak FLOP/s per device,
MFU, and parameter counts.

FLOPs per token, training (forward + backward), docs/reference.md:
  attention  6 * attn_params + 12 * heads * head_dim * (s + 1) / 2   (causal)
             a layer with a sliding window w < s: 12 * heads * head_dim * P / s, P = the
             (query, key) pairs w (w + 1) / 2 + (s - w) w (OLMo-core's
             `_causal_attention_positions`; full attention's P is s (s + 1) / 2)
  router     6 * d * E
  routed     18 * d * h * k
  shared     18 * d * h_s * n_s
  dense MLP  18 * d * h_dense   (blocks before the first MoE block)
  LM head    6 * d * V
The input embedding is not counted; norm weights are negligible and not counted.
"""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp

from olmo_jax.model.config import TransformerConfig

# Dense peak FLOP/s per device by kind and dtype (vendor datasheets, dense, no sparsity).
PEAK_FLOPS = {
    "b300": {"bfloat16": 2.25e15, "float32": 75e12},  # docs/reference.md
    "b200": {"bfloat16": 2.25e15, "float32": 75e12},
    "h200": {"bfloat16": 0.989e15, "float32": 67e12},  # same SXM die as H100
    "h100": {"bfloat16": 0.989e15, "float32": 67e12},
    "a100": {"bfloat16": 312e12, "float32": 19.5e12},
}


def attention_params(cfg: TransformerConfig) -> int:
    D, N, K, H = cfg.d_model, cfg.n_heads, cfg.kv_heads, cfg.head_size
    return D * N * H * 2 + D * K * H * 2


def attention_positions(seq_len: int, window: int = 0) -> int:
    """The (query, key) pairs causal attention over `seq_len` tokens scores, with a
    sliding `window` (0 = full): OLMo-core's `_causal_attention_positions`."""
    if not window or window >= seq_len:
        return seq_len * (seq_len + 1) // 2
    return window * (window + 1) // 2 + (seq_len - window) * window


def flops_per_token_parts(cfg: TransformerConfig, seq_len: int) -> dict[str, float]:
    """The terms of `flops_per_token`, summed over the layers that have them (each
    layer's scores over its own window, model.window_pattern)."""
    D, m = cfg.d_model, cfg.moe
    L, L_moe = cfg.n_layers, cfg.n_moe_layers
    pairs = sum(attention_positions(seq_len, w) for w in cfg.layer_windows)
    return {
        "attention_proj": L * 6 * attention_params(cfg),
        "attention_scores": 12 * cfg.n_heads * cfg.head_size * pairs / seq_len,
        "router": L_moe * 6 * D * m.num_experts,
        "routed_experts": L_moe * 18 * D * m.expert_hidden * m.top_k,
        "shared_experts": L_moe * 18 * D * m.shared_hidden * m.n_shared_experts,
        "dense_mlp": cfg.n_dense_layers * 18 * D * cfg.dense_hidden_size,
        "lm_head": 6 * D * cfg.vocab_size,
    }


def flops_per_token(cfg: TransformerConfig, seq_len: int) -> float:
    return sum(flops_per_token_parts(cfg, seq_len).values())


def param_counts(cfg: TransformerConfig) -> tuple[int, int]:
    """(total, active) parameters. Active counts the top-k routed experts per token."""
    D, V, m = cfg.d_model, cfg.vocab_size, cfg.moe
    # QK-norm weights: over the whole q / k projections, or one [head_dim] each per head.
    qk_norm = 2 * cfg.head_size if cfg.head_qk_norm else (cfg.n_heads + cfg.kv_heads) * cfg.head_size
    attn = attention_params(cfg) + qk_norm * cfg.qk_norm
    norms = (4 if cfg.block_norm == "peri" else 2) * D  # peri: a norm before and after each branch
    expert = 3 * D * m.expert_hidden
    shared = 3 * D * m.shared_hidden * m.n_shared_experts
    moe_common = attn + norms + D * m.num_experts + shared
    dense_block = attn + norms + 3 * D * cfg.dense_hidden_size
    embed = V * D * (1 if cfg.tie_embeddings else 2) + D * (2 if cfg.embedding_norm else 1)
    total = embed + cfg.n_dense_layers * dense_block
    total += cfg.n_moe_layers * (moe_common + m.num_experts * expert)
    active = embed + cfg.n_dense_layers * dense_block
    active += cfg.n_moe_layers * (moe_common + m.top_k * expert)
    return total, active


@functools.cache
def measured_cpu_peak(n: int = 1024, repeats: int = 8) -> float:
    """Dense float32 matmul FLOP/s of one CPU device, measured once (best of `repeats`)."""
    a = jax.device_put(jnp.ones((n, n), jnp.float32), jax.devices("cpu")[0])
    return 2 * n**3 / best_seconds(jax.jit(lambda x: x @ x), a, repeats)


def best_seconds(f, x, repeats: int) -> float:
    """The fastest of `repeats` timed calls f(x) (after one untimed warm-up call)."""
    f(x).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        f(x).block_until_ready()
        best = min(best, time.perf_counter() - t)
    return best


def device_kind() -> str:
    d = jax.devices()[0]
    if d.platform == "cpu":
        return "cpu"
    kind = d.device_kind.lower()
    for name in PEAK_FLOPS:
        if name in kind:
            return name
    return kind


def peak_flops_per_device(dtype: str = "bfloat16", kind: str | None = None) -> float:
    """Peak dense FLOP/s of one device: from the table, or measured for the CPU (the fake
    CPU devices of a simulated mesh share the host's cores, so the host peak is split)."""
    kind = kind or device_kind()
    if kind == "cpu":
        return measured_cpu_peak() / max(1, len(jax.devices("cpu")))
    if kind not in PEAK_FLOPS:
        raise KeyError(f"no peak FLOP/s known for device kind {kind!r}; known: {sorted(PEAK_FLOPS)}")
    table = PEAK_FLOPS[kind]
    return table.get(dtype, table["bfloat16"])
