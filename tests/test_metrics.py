"""FLOPs per token (docs/reference.md) against a hand count, and parameter counts against the
actual model."""

import jax
import numpy as np
from flax import nnx

from olmo_jax import metrics
from olmo_jax.model import MoEConfig, Transformer, TransformerConfig


def test_flops_per_token_hand_count():
    # d=64, 4 heads (head 16), 2 kv heads, 3 layers (first dense, hidden 100), E=8 top-2,
    # expert hidden 32, one shared expert of hidden 24, vocab 256, seq 128.
    cfg = TransformerConfig(
        vocab_size=256, d_model=64, n_layers=3, n_heads=4, n_kv_heads=2, n_dense_layers=1,
        dense_hidden=100,
        moe=MoEConfig(num_experts=8, top_k=2, expert_hidden=32, n_shared_experts=1, shared_hidden=24),
    )
    attn_params = 64 * 64 + 64 * 32 + 64 * 32 + 64 * 64  # q, k, v, o = 12288
    assert attn_params == 12288
    attention = 6 * attn_params + 12 * 4 * 16 * (128 + 1) / 2  # 73728 + 49536
    router = 6 * 64 * 8  # 3072
    routed = 18 * 64 * 32 * 2  # 73728
    shared = 18 * 64 * 24  # 27648
    dense = 18 * 64 * 100  # 115200
    head = 6 * 64 * 256  # 98304
    expected = 3 * attention + 2 * (router + routed + shared) + dense + head
    assert expected == 3 * 123264 + 2 * 104448 + 115200 + 98304
    assert metrics.flops_per_token(cfg, 128) == expected


def test_param_counts_match_the_model():
    cfg = TransformerConfig(
        vocab_size=256, d_model=64, n_layers=3, n_heads=4, n_kv_heads=2, n_dense_layers=1,
        moe=MoEConfig(num_experts=8, top_k=2, expert_hidden=32, n_shared_experts=1, shared_hidden=24),
    )
    model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
    n = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    total, active = metrics.param_counts(cfg)
    assert total == n
    experts = model.moe_blocks.ffn.experts
    per_expert = sum(int(np.prod(w.shape[2:])) for w in (experts.w_gate, experts.w_up, experts.w_down))
    assert active == total - 2 * (8 - 2) * per_expert


def test_windowed_layers_count_their_window_pairs():
    """OLMo-core's count: a window w < s scores w (w + 1) / 2 + (s - w) w pairs, full
    attention s (s + 1) / 2; each layer by its own window (model.window_pattern)."""
    assert metrics.attention_positions(8) == 36
    assert metrics.attention_positions(8, 3) == 6 + 5 * 3  # 1 + 2 + 3, then 3 a query
    assert metrics.attention_positions(8, 8) == metrics.attention_positions(8, 100) == 36
    full = TransformerConfig(n_layers=4, n_heads=2, d_model=32)
    windowed = full.replace(window_pattern=(3, 3, 3, -1), window_full_first=False)
    per_pair = 12 * 2 * 16 / 8  # 12 * heads * head_dim / s
    f, w = (metrics.flops_per_token_parts(c, 8)["attention_scores"] for c in (full, windowed))
    assert f == 4 * 36 * per_pair
    assert w == (3 * 21 + 36) * per_pair
