"""The CPU speed benchmark shape (tools/bench/bench_vs_torch.py): 4 MoE blocks, d_model 256,
expert hidden 512, 8 experts top-2, 4 heads, vocab 384, 32 sequences x 256 tokens,
float32, dropless. Also trainable: `make train CONFIG=configs/bench_cpu.py`."""

from olmo_jax.config import default_config
from olmo_jax.model.config import HF_OLMOE_LAYOUT


def get_config():
    c = default_config()
    m = c.model
    m.update(HF_OLMOE_LAYOUT)  # Hugging Face OLMoE's block layout: the model transformers runs
    m.norm_eps, m.init_std = 1e-5, 0.02  # OlmoeConfig's rms_norm_eps, initializer_range
    m.vocab_size = 384
    m.d_model = 256
    m.n_layers = 4
    m.n_heads = 4
    m.n_dense_layers = 0
    m.moe.num_experts = 8
    m.moe.top_k = 2
    m.moe.expert_hidden = 512
    m.moe.capacity_factor = 0.0  # dropless
    m.dtype = "float32"
    m.scan_unroll = 4  # four blocks: unrolling the layer scan is cheap to compile here
    c.trainer.run_dir = "runs/bench_cpu"
    c.trainer.global_batch_size = 32
    c.trainer.seq_len = 256
    return c
