"""The default quick run (`make train`): a 4-block MoE (first block dense), 8 experts top-2,
d_model 128, trained on the embedded stdlib corpus with the byte tokenizer. A global batch
of 32 x 256 tokens divides meshes of 8 devices and 4 microbatches. It holds 1% of the corpus's
instances out of training as its eval split (data.eval_fraction; the default holds none)."""

from olmo_jax.config import default_config


def get_config():
    c = default_config()
    m = c.model
    m.d_model = 128
    m.n_layers = 4
    m.n_heads = 4
    m.n_dense_layers = 1
    m.dense_hidden = 512
    m.moe.num_experts = 8
    m.moe.top_k = 2
    m.moe.expert_hidden = 256
    m.dtype = "float32"

    c.data.eval_fraction = 0.01  # a stated split: 1% of the instances, at least one batch

    c.optim.lr = 4e-3
    c.optim.warmup_steps = 30

    t = c.trainer
    t.run_dir = "runs/tiny"
    t.max_steps = 200
    t.global_batch_size = 32
    t.seq_len = 256
    t.log_every = 10
    t.eval_every = 50
    return c
