"""OLMo-core 3's 47B MoE benchmark model (docs/reference.md): 8 blocks (the first dense),
d_model 4096, 32 heads / 8 kv heads of 128, 128 experts top-4 plus one shared expert,
expert and shared hidden 4096, dense hidden 20480, dolma2 vocab padded to 100,352,
sequences of 8192. 46.863B total / 3.175B active parameters; 18.19 GFLOP/token.
Benchmarked by the reference on 8 B300s with EP8 (52k tokens/s/GPU, 42% MFU).

Every value is the reference's, read from allenai/OLMo-core
src/examples/olmo_ddp/moe_8l_ddp.py and moe_8l_common.py (TECH_REPORT_NUM_EXPERTS=128;
the defaults otherwise); tests/test_reference_configs.py checks them against a table.
The benchmark routes at random (`random_expert_assignment`, OLMo-core's noise gate): set
--config.model.moe.routing_mode=learned to train the model for real."""

import math

from olmo_jax.config import default_config


def olmoe3_base(num_experts: int):
    c = default_config()
    m = c.model
    m.vocab_size = 100_352  # dolma2, padded_vocab_size()
    m.d_model = 4096  # D_MODEL
    m.n_layers = 8  # NUM_LAYERS
    m.n_heads = 32  # D_ATTN // HEAD_DIM
    m.n_kv_heads = 8  # NUM_HEADS // 4
    m.head_dim = 128  # HEAD_DIM
    m.n_dense_layers = 1  # block_overrides={0: dense_first_block}
    m.dense_hidden = 20_480  # DENSE_LAYER_MLP = TOP_K * MOE_HIDDEN_SIZE + SHARED_MLP_HIDDEN_SIZE
    m.rope_theta = 500_000.0  # RoPEConfig(theta=500_000)
    m.norm_eps = 1e-6  # LayerNormConfig(rms, eps=1e-6)
    m.qk_norm = True  # qk_norm=layer_norm
    m.head_qk_norm = True  # use_head_qk_norm=True
    m.block_norm = "post"  # use_peri_norm=False: the reordered post-branch norm
    m.embed_scale = math.sqrt(4096)  # embed_scale=math.sqrt(D_MODEL)
    m.embedding_norm = True  # embedding_norm=layer_norm
    m.init_std = 0.01  # init_std=0.01
    m.lm_z_loss_coef = 1e-4  # train module z_loss_multiplier=1e-4
    m.dtype = "bfloat16"
    # olmo_jax, not the script: the 7 MoE blocks unrolled, so no microbatch copies layer
    # slices of the stacked expert weights or stacks their gradients (docs/performance.md)
    m.scan_unroll = 7
    m.moe.num_experts = num_experts  # NUM_EXPERTS
    m.moe.top_k = 4  # TOP_K
    m.moe.expert_hidden = 4096  # MOE_HIDDEN_SIZE
    m.moe.n_shared_experts = 1  # NUM_SHARED_EXPERTS
    m.moe.shared_hidden = 4096  # SHARED_MLP_HIDDEN_SIZE
    m.moe.gating = "softmax"  # gating_function=softmax
    m.moe.norm_topk_prob = True  # normalize_expert_weights=1.0
    m.moe.router_weight_scale = 4.0  # restore_weight_scale=True: weights sum to top_k
    m.moe.routing_mode = "random"  # random_expert_assignment=not UNIFORM_ROUTING (benchmark)
    m.moe.lb_loss_coef = 0.015  # lb_loss_weight=0.015
    m.moe.z_loss_coef = 1e-4  # z_loss_weight=1e-4
    m.moe.lb_granularity = "local"  # lb_loss_granularity=local_batch
    m.moe.capacity_factor = 1.25  # ExpertParallelConfig(capacity_factor=CAPACITY_FACTOR)
    c.parallel.data = -1
    c.parallel.expert = 8  # PARALLEL_DEGREE
    c.data.tokenizer = "bytes"  # replace with the dolma2 tokenizer.json and token files
    c.data.repetition_filter = False  # include_instance_filter=False
    o = c.optim
    o.lr = 3e-4  # LEARNING_RATE
    o.weight_decay = 0.1  # WEIGHT_DECAY
    o.b1, o.b2 = 0.9, 0.95  # BETAS
    o.decay_embeddings = False  # OptimGroupOverride("*embeddings.weight", weight_decay=0.0)
    o.schedule = "cosine"  # CosWithWarmup (alpha_f 0.1)
    o.min_lr_ratio = 0.1
    o.warmup_steps = 10  # WARMUP_STEPS
    o.clip_grad_norm = 1.0  # max_grad_norm=1.0
    t = c.trainer
    t.seq_len = 8192  # SEQUENCE_LENGTH
    t.global_batch_size = 512  # GLOBAL_BATCH_SIZE = 4Mi tokens
    # RANK_MICROBATCH_SEQUENCES = 2 on each of 8 ranks: 16 sequences a microbatch.
    t.grad_accum = 32
    t.max_steps = 100  # MAX_STEPS
    t.seed = 2026  # SEED (init_seed)
    t.run_dir = f"runs/olmoe3_{num_experts}e"
    return c


def get_config():
    return olmoe3_base(128)
