"""The ~1B-active MoE that tools/gpu_check.sh trains on one GPU, side by side with Hugging
Face transformers' OlmoeForCausalLM and OLMo-core 3's MoE model (tools/gpu_check/).

This project's MoE design in the shape all three express alike: every block MoE (no dense
first block, no shared expert: OlmoeForCausalLM has neither), d_model 2048, 16 blocks of
16 heads x 128 with QK-norm and RoPE theta 500k (Hugging Face OLMoE's pre-norm layout), 32 experts top-4 of hidden 1024
(dropless, softmax router, load-balancing and z losses), untied embeddings over the dolma2
vocabulary padded to 100,352; bf16 compute on fp32 master weights, AdamW. 1.08B active of
3.90B parameters; a step is 4 sequences of 4096 tokens (6.07 GFLOP/token by
metrics.flops_per_token: ~0.1 PFLOP a step). fp32 weights, gradients and AdamW moments
take ~62 GB: one H200 (141 GB) holds them with the activations, on one device, without
expert parallelism."""

from olmo_jax.config import default_config
from olmo_jax.model.config import HF_OLMOE_LAYOUT


def get_config():
    c = default_config()
    m = c.model
    m.update(HF_OLMOE_LAYOUT)  # Hugging Face OLMoE's block layout: the model transformers runs
    m.vocab_size = 100_352
    m.d_model = 2048
    m.n_layers = 16
    m.n_heads = 16
    m.norm_eps = 1e-6
    m.init_std = 0.02
    m.dtype = "bfloat16"
    m.moe.num_experts = 32
    m.moe.top_k = 4
    m.moe.expert_hidden = 1024
    c.parallel.data = 1
    c.parallel.expert = 1
    c.optim.lr = 4e-4
    c.optim.warmup_steps = 10
    t = c.trainer
    t.seq_len = 4096
    t.global_batch_size = 4
    t.max_steps = 30
    t.run_dir = "runs/gpu_check_1b"
    return c
