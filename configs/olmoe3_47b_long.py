"""The 47B MoE (configs/olmoe3_47b.py) at long context, as OLMo 3 extends its context:
sequences of 65,536 tokens, sliding-window attention in three of every four layers
(window 4,096; OLMo-core's OLMo 3 preset `SlidingWindowAttentionConfig(pattern=[4096,
4096, 4096, -1], force_full_attention_on_first_layer=False,
force_full_attention_on_last_layer=True)`; tests/olmo_core/test_window_pattern_oracle.py
checks it against OLMo-core's), documents masked from each other (data.doc_mask), RoPE
extended with YaRN x8 from the 8,192 tokens the base trained at (OLMo 3's long-context
models: factor 8, original context 8,192, beta 32 / 1), and context parallelism 8: each
sequence in zig-zag shards of 8,192 tokens (the ring kernel; it skips the blocks a window
does not reach, docs/parallelism.md).

With 8 layers the windows are [4096, 4096, 4096, full, 4096, 4096, 4096, full]. The mesh
is context 8 x expert 8 (64 devices): the batch of 64 sequences (4Mi tokens, as the
short run's 512 x 8,192) in 8 microbatches of one sequence per data x expert rank.
YaRN scales the full-attention layers' RoPE only (model.rope_scaling_layers=full), as
OLMo-core's `with_rope_scaling(full_attn_layers_only=True)` builds OLMo 3's long-context
models; the sliding-window layers keep plain RoPE."""

from configs.olmoe3_47b import olmoe3_base


def get_config():
    c = olmoe3_base(128)
    m = c.model
    m.window_pattern = (4096, 4096, 4096, -1)
    m.window_full_first = False
    m.window_full_last = True
    m.rope_scaling = "yarn"
    m.rope_scaling_factor = 8.0
    m.rope_old_context_len = 8192
    m.rope_scaling_layers = "full"
    m.context_attention = "ring"
    c.data.doc_mask = True
    c.parallel.context = 8
    c.parallel.expert = 8
    c.parallel.data = -1
    t = c.trainer
    t.seq_len = 65_536
    t.global_batch_size = 64  # 4Mi tokens
    t.grad_accum = 8  # one 65,536-token sequence per data x expert rank a microbatch
    t.run_dir = "runs/olmoe3_47b_long"
    return c
