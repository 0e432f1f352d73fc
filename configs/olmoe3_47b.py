"""OLMo-core 3's 47B MoE benchmark model (DESIGN §6): 8 blocks (the first dense),
d_model 4096, 32 heads / 8 kv heads of 128, 128 experts top-4 plus one shared expert,
expert and shared hidden 4096, dense hidden 20480, dolma2 vocab padded to 100,352,
sequences of 8192. 46.863B total / 3.175B active parameters; 18.19 GFLOP/token.
Benchmarked by the reference on 8 B300s with EP8 (52k tokens/s/GPU, 42% MFU)."""

from olmo_jax.config import default_config


def olmoe3_base(num_experts: int):
    c = default_config()
    m = c.model
    m.vocab_size = 100_352
    m.d_model = 4096
    m.n_layers = 8
    m.n_heads = 32
    m.n_kv_heads = 8
    m.head_dim = 128
    m.n_dense_layers = 1
    m.dense_hidden = 20_480
    m.rope_theta = 500_000.0
    m.dtype = "bfloat16"
    m.moe.num_experts = num_experts
    m.moe.top_k = 4
    m.moe.expert_hidden = 4096
    m.moe.n_shared_experts = 1
    m.moe.shared_hidden = 4096
    c.parallel.data = -1
    c.parallel.expert = 8
    c.data.tokenizer = "bytes"  # replace with the dolma2 tokenizer.json and token files
    t = c.trainer
    t.seq_len = 8192
    t.global_batch_size = 64
    # One 8192-token sequence per device per microbatch on 8 devices: without accumulation
    # the step needs ~730 GB per device (python -m olmo_jax.plan shows where it goes).
    t.grad_accum = 8
    t.run_dir = f"runs/olmoe3_{num_experts}e"
    return c


def get_config():
    return olmoe3_base(128)
