"""The public OLMoE-1B-7B shape (allenai/OLMoE-1B-7B-0924): 16 blocks, d_model 2048,
16 heads, 64 experts top-8 of hidden 1024, vocab 50,304, RoPE theta 10,000, untied
embeddings, sequences of 4096. ~6.9B total / ~1.3B active parameters."""

from olmo_jax.config import default_config
from olmo_jax.model.config import HF_OLMOE_LAYOUT


def get_config():
    c = default_config()
    m = c.model
    m.update(HF_OLMOE_LAYOUT)  # Hugging Face OLMoE's block layout: the model transformers runs
    m.norm_eps, m.init_std = 1e-5, 0.02  # OlmoeConfig's rms_norm_eps, initializer_range
    m.vocab_size = 50_304
    m.d_model = 2048
    m.n_layers = 16
    m.n_heads = 16
    m.rope_theta = 10_000.0
    m.dtype = "bfloat16"
    m.moe.num_experts = 64
    m.moe.top_k = 8
    m.moe.expert_hidden = 1024
    m.moe.lb_loss_type = "pooled"  # as trained with Hugging Face's definition
    c.parallel.expert = 8
    c.parallel.data = -1
    c.data.tokenizer = "bytes"  # replace with the OLMoE tokenizer.json and token files
    t = c.trainer
    t.seq_len = 4096
    t.global_batch_size = 64
    t.run_dir = "runs/olmoe_1b7b"
    return c
