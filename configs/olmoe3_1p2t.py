"""OLMo-core 3's 1.2T MoE (docs/reference.md): 63 blocks (blocks 0-1 dense), d_model 6144,
64 heads / 32 kv heads of 128 (attention width 8192), 128 experts top-4 plus one shared
expert, expert and shared hidden 8192, dense hidden 40960, vocab 100,352, sequences of
8192. 1.2005T total / 58.36B active. The reference trains it with EP8 x PP8
(interleaved 1F1B) on 512 GPUs at 858 TFLOP/s/GPU.

Every value is the reference's, read from allenai/OLMo-core
src/examples/olmo_ddp/OLMoE3-dev-u001.py; tests/test_reference_configs.py checks them
against a table. Like the script (RANDOM_ASSIGN=True) it routes at random, OLMo-core's
noise gate: set --config.model.moe.routing_mode=learned to train the model for real."""

import math

from olmo_jax.config import default_config

GLOBAL_BATCH_SEQUENCES = (8 * 8) * 2 * 64  # GLOBAL_BATCH_SIZE_SEQ: 8192 x 8192 = 64Mi tokens
# LR = 1.2e-4 * (GLOBAL_BATCH_SIZE / 8Mi) ** 0.53 (LR_ALPHA, LR_REF_BSZ_IN_M = 8)
LR = 1.2e-4 * (GLOBAL_BATCH_SEQUENCES * 8192 / (8 * 1024 * 1024)) ** 0.53
# SCHED_WARMUP_TOKENS = (30e9 // GLOBAL_BATCH_SIZE) * GLOBAL_BATCH_SIZE: 447 steps
WARMUP_STEPS = int(30e9 // (GLOBAL_BATCH_SEQUENCES * 8192))


def olmoe3_large(num_experts: int):
    c = default_config()
    m = c.model
    m.vocab_size = 100_352
    m.d_model = 6144  # D_MODEL
    m.n_layers = 63  # ORIGINAL_NUM_LAYERS - MINUS_LAST_STAGE
    m.n_heads = 64  # D_ATTN // HEAD_DIM
    m.n_kv_heads = 32  # NUM_HEAD // 2
    m.head_dim = 128
    m.n_dense_layers = 2  # block_overrides {0, 1}: dense blocks
    m.dense_hidden = 40_960  # DENSE_LAYER_MLP
    m.rope_theta = 500_000.0
    m.norm_eps = 1e-6  # LayerNormConfig(rms, eps=1e-6)
    m.qk_norm = True
    m.head_qk_norm = True  # use_head_qk_norm=True
    m.block_norm = "peri"  # USE_PERI_NORM = True
    m.embed_scale = math.sqrt(6144)  # embed_scale=math.sqrt(d_model)
    m.embedding_norm = True  # embedding_norm=layer_norm
    m.init_std = 0.01  # init_std=0.01
    m.lm_z_loss_coef = 1e-4  # z_loss_multiplier=1e-4
    m.dtype = "bfloat16"
    m.remat = "block"  # PER_LAYER_RECOMPUTE = True
    m.attention_precision = "mxfp8"  # USE_FP8_ATTN_QKV / USE_FP8_ATTN_OUT = USE_FP8
    m.moe.num_experts = num_experts  # NUM_EXPERTS
    m.moe.top_k = 4  # TOP_K
    m.moe.expert_hidden = 8192  # MOE_HIDDEN_SIZE
    m.moe.n_shared_experts = 1  # NUM_SHARED_EXPERTS
    m.moe.shared_hidden = 8192  # SHARED_MLP_HIDDEN_SIZE
    m.moe.gating = "softmax"
    m.moe.norm_topk_prob = True  # normalize_expert_weights=1.0
    m.moe.router_weight_scale = 4.0  # restore_weight_scale=True: weights sum to top_k
    m.moe.routing_mode = "random"  # RANDOM_ASSIGN = True
    m.moe.lb_loss_coef = 0.005  # lb_loss_weight=0.005
    m.moe.z_loss_coef = 2e-4  # z_loss_weight=2e-4
    m.moe.lb_granularity = "local"  # lb_loss_granularity=local_batch
    m.moe.capacity_factor = 1.1875  # EP_NO_SYNC_CAPACITY_FACTOR
    m.moe.precision = "mxfp8"  # MoERowwiseFP8Config(enabled=USE_FP8)
    c.parallel.pipe = 8  # PP_DIM
    c.parallel.expert = 8  # EP_DIM
    c.parallel.data = -1
    # custom_interleaved_1F1B over PP_DIM * 2 stages (_get_split_points(64, 16, 1)): two
    # chunks per rank. One sequence per microbatch (MICRO_BSZ = 1): 8192 sequences over 64
    # data x expert shards are NUM_MICRO_BATCHES = 128 microbatches in one schedule, so the
    # bubble is (P - 1) / (V * M + P - 1) = 7 / 263 = 2.7%.
    c.parallel.pipeline_schedule = "interleaved_1f1b"
    c.parallel.virtual_stages = 2
    c.parallel.microbatches = 128
    c.data.tokenizer = "bytes"  # replace with the dolma2 tokenizer.json and token files
    c.data.repetition_filter = True  # InstanceFilterConfig(13, 1, 32)
    c.data.repetition_max_period = 13
    c.data.repetition_min_period = 1
    c.data.repetition_max_count = 32
    o = c.optim
    o.lr = LR
    o.weight_decay = 0.1
    o.b1, o.b2 = 0.9, 0.95
    o.decay_embeddings = False  # group_overrides: "*embeddings.weight" weight_decay=0.0
    # Linear warmup, then a cosine to end_lr_fraction SCHED_FINAL_FRACTION = 1.0: constant.
    o.schedule = "constant"
    o.warmup_steps = WARMUP_STEPS
    o.clip_grad_norm = 1.0  # max_grad_norm=1.0
    t = c.trainer
    t.seq_len = 8192  # SEQUENCE_LENGTH
    t.global_batch_size = GLOBAL_BATCH_SEQUENCES
    t.grad_accum = 1
    t.seed = 2026  # SEED
    t.run_dir = f"runs/olmoe3_large_{num_experts}e"
    return c


def get_config():
    return olmoe3_large(128)
