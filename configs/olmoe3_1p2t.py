"""OLMo-core 3's 1.2T MoE (DESIGN §6): 63 blocks (blocks 0-1 dense), d_model 6144,
64 heads / 32 kv heads of 128 (attention width 8192), 128 experts top-4 plus one shared
expert, expert and shared hidden 8192, dense hidden 40960, vocab 100,352, sequences of
8192. 1.2005T total / 58.36B active. The reference trains it with EP8 x PP8
(interleaved 1F1B) on 512 GPUs at 858 TFLOP/s/GPU."""

from olmo_jax.config import default_config


def olmoe3_large(num_experts: int):
    c = default_config()
    m = c.model
    m.vocab_size = 100_352
    m.d_model = 6144
    m.n_layers = 63
    m.n_heads = 64
    m.n_kv_heads = 32
    m.head_dim = 128
    m.n_dense_layers = 2
    m.dense_hidden = 40_960
    m.rope_theta = 500_000.0
    m.dtype = "bfloat16"
    m.remat = "block"
    m.moe.num_experts = num_experts
    m.moe.top_k = 4
    m.moe.expert_hidden = 8192
    m.moe.n_shared_experts = 1
    m.moe.shared_hidden = 8192
    c.parallel.pipe = 8
    c.parallel.expert = 8
    c.parallel.data = -1
    # Interleaved 1F1B: 61 MoE blocks in 8 x 4 chunks of 2 slots (3 padding), 8
    # microbatches of one sequence per data x expert shard on 512 devices: bubble
    # (P-1)/(V*M + P-1) = 7/39 = 17.9% of the schedule.
    c.parallel.pipeline_schedule = "interleaved_1f1b"
    c.parallel.virtual_stages = 4
    c.parallel.microbatches = 8
    c.data.tokenizer = "bytes"  # replace with the dolma2 tokenizer.json and token files
    t = c.trainer
    t.seq_len = 8192
    t.global_batch_size = 512
    t.run_dir = f"runs/olmoe3_large_{num_experts}e"
    return c


def get_config():
    return olmoe3_large(128)
