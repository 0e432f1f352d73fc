"""The configuration schema: every field, its default, and validation with clear errors.

A run's config is an `ml_collections.ConfigDict` with five sections: `model`, `parallel`,
`optim`, `data`, `trainer`. `default_config()` returns it with every field present (types
are locked by ml_collections, so `--config.x=y` overrides are type-checked); files in
configs/ derive from it. `validate(cfg)` checks cross-field consistency and returns the
typed model config; each error names the field and the fix.
"""

from __future__ import annotations

import difflib
import importlib.util

import ml_collections

from olmo_jax.model.config import ConfigError, MoEConfig, TransformerConfig


def default_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()

    c.model = m = ml_collections.ConfigDict()
    m.vocab_size = 0  # 0 = the tokenizer's padded vocabulary
    m.d_model = 256
    m.n_layers = 4
    m.n_heads = 4
    m.n_kv_heads = 0  # 0 = n_heads
    m.head_dim = 0  # 0 = d_model // n_heads
    m.n_dense_layers = 0
    m.dense_hidden = 0  # 0 = 4 * d_model
    m.rope_theta = 500_000.0
    m.norm_eps = 1e-5
    m.qk_norm = True
    m.head_qk_norm = False  # QK-norm per head (OLMo-core's use_head_qk_norm)
    m.block_norm = "pre"  # pre | post (OLMo-core's reordered norm) | peri
    m.embed_scale = 0.0  # embeddings *= embed_scale (0 = off)
    m.embedding_norm = False  # RMSNorm of the embeddings
    m.clip_qkv = 0.0
    m.tie_embeddings = False
    m.init_std = 0.02
    m.dtype = "float32"  # compute dtype: float32 | bfloat16 (params stay float32)
    m.remat = "none"  # none | block | attention
    m.scan_unroll = 1  # blocks per layer-scan iteration; = n_layers unrolls fully
    m.attention_precision = "bf16"  # bf16 (= dtype) | mxfp8 (q/k/v/o projection GEMMs)
    m.attention_impl = "auto"  # auto (cuDNN fused attention on a GPU in bf16/fp16) | cudnn | xla
    m.moe = e = ml_collections.ConfigDict()
    e.num_experts = 8
    e.top_k = 2
    e.expert_hidden = 512
    e.gating = "softmax"  # softmax | sigmoid | topk_softmax
    e.norm_topk_prob = False
    e.sigmoid_renorm = True  # sigmoid gating: renormalize the k weights
    e.sigmoid_eps = 0.0  # added to the sigmoid scores (OLMo-core: 1e-7)
    e.router_weight_scale = 1.0
    e.n_group = 1  # group-limited routing (1 = off)
    e.topk_group = 1
    e.bias_rate = 0.0  # auxiliary-loss-free balancing (0 = off)
    e.routing_mode = "learned"  # learned | random | random_choice | uniform
    e.router_jitter = 0.0
    e.n_shared_experts = 0
    e.shared_hidden = 0
    e.capacity_factor = 0.0  # 0 = dropless
    e.gmm_impl = "auto"  # auto | tiled | pallas | ragged_dot | einsum (olmo_jax/kernels)
    e.precision = "bf16"  # bf16 (= model.dtype) | mxfp8 expert GEMMs
    e.mxfp8_wgrad = False  # mxfp8: round the weight-gradient GEMM operands too
    e.lb_loss_coef = 0.01
    e.z_loss_coef = 0.001
    e.lb_loss_type = "per_layer"  # per_layer (OLMo-core) | pooled (Hugging Face)
    e.lb_granularity = "global"  # global | local (per data-parallel shard) | instance

    c.parallel = p = ml_collections.ConfigDict()
    p.pipe = 1
    p.data = -1  # -1 = fill the remaining devices
    p.expert = 1
    p.strategy = "ddp"  # ddp (experts resident, tokens travel) | fsdp (baseline)
    p.dispatch = "rowwise"  # rowwise | ragged | allgather (expert-parallel dispatch, expert > 1)
    p.capacity_factor = 1.25  # rowwise: receive slots = ceil(cf * tokens * top_k / expert) per rank
    p.zero1 = True  # shard fp32 params + AdamW moments over the data-parallel devices
    # Pipeline (parallel.pipe > 1; olmo_jax/parallel/pipeline):
    p.pipeline_schedule = "1f1b"  # gpipe | 1f1b | interleaved_1f1b
    p.microbatches = 1  # microbatches per pipeline flush (the batch rows split in order)
    p.virtual_stages = 1  # chunks per stage: interleaved_1f1b needs >= 2 (gpipe: circular)

    c.optim = o = ml_collections.ConfigDict()
    o.name = "adamw"  # adamw | muon (Muon on weight matrices, AdamW on the rest; olmo_jax/optim)
    o.lr = 3e-3
    o.schedule = "cosine"  # cosine | wsd | constant
    o.warmup_steps = 20
    o.min_lr_ratio = 0.1  # final lr / peak lr
    o.decay_fraction = 0.2  # wsd: fraction of steps spent decaying
    o.weight_decay = 0.1
    o.b1 = 0.9
    o.b2 = 0.95
    o.eps = 1e-8
    o.clip_grad_norm = 1.0  # 0 = no clipping
    o.muon_beta = 0.95  # muon: momentum
    o.muon_ns_steps = 5  # muon: Newton-Schulz iterations
    o.muon_rms = 0.2  # muon: update RMS of every matrix (scale rule: RMS matched to AdamW)
    o.muon_lr = 0.0  # muon: peak lr of the matrices (0 = optim.lr, which the scale rule allows)

    c.data = d = ml_collections.ConfigDict()
    d.paths = ""  # comma-separated token files; "" = the embedded stdlib corpus
    d.tokenizer = "bytes"  # bytes | path to a tokenizer.json
    d.vocab_size = 0  # vocab of the token files (0 = the tokenizer's padded vocab)
    d.dtype = ""  # "" = from the vocab size; uint16 | uint32
    d.eval_fraction = 0.01  # the default eval split: this share of the windows held out of training
    # Named eval sets {name: token files (a list or comma-separated)}, held out by the user;
    # each logged as eval/<name>/loss and eval/<name>/perplexity (olmo_jax/data/loader.py).
    d.eval_sets = ml_collections.ConfigDict()
    d.prefetch = 2  # batches the grain pipeline reads ahead on its own thread (0 = none)

    c.trainer = t = ml_collections.ConfigDict()
    t.max_steps = 100
    t.seed = 0
    t.run_dir = "runs/default"
    t.cache_dir = ".cache/olmo_jax"
    t.global_batch_size = 32
    t.seq_len = 256
    t.grad_accum = 1  # microbatches accumulated per step
    t.log_every = 10
    t.eval_every = 50  # 0 = only at the end
    t.eval_batches = 4
    t.expert_counts_every = 0  # > 0: per-expert counts to {run_dir}/expert_counts.jsonl
    # Metric sinks (olmo_jax/trainer/sinks.py), comma-separated: jsonl (always) | tensorboard | wandb
    t.loggers = "jsonl"
    t.wandb = w = ml_collections.ConfigDict()
    w.mode = "offline"  # online | offline (no network; `wandb sync` later) | disabled
    w.project = "olmo_jax"
    w.entity = ""  # "" = the W&B default
    w.name = ""  # "" = the run_dir's folder name
    w.group = ""
    w.tags = ""  # comma-separated
    t.profile_steps = ""  # "START:END": jax.profiler trace of steps [START, END) into {run_dir}/profile
    t.sample_prompt = "import os\nimport sys\n\n\ndef "
    t.sample_tokens = 120
    t.sample_temperature = 0.6  # 0 = greedy
    # Checkpoints (olmo_jax/checkpoint): {run_dir}/checkpoints, saved asynchronously.
    t.save_every = 100  # save every N steps (0 = only at the end / at hard_stop)
    t.keep_last = 3  # keep the N most recent checkpoints (0 = keep all)
    t.keep_every = 0  # also keep every checkpoint whose step is a multiple of K forever (0 = off)
    t.resume = True  # continue from the latest complete checkpoint in run_dir, if any
    t.init_from = ""  # a checkpoint (e.g. from `python -m olmo_jax.convert hf-to-orbax`):
    #                   its weights start a fresh run (new optimizer state, step 0)
    t.hard_stop = 0  # stop (with a checkpoint) after this step, before max_steps (0 = off)
    t.overwrite = False  # accept a config that differs from the one run_dir already holds
    # Reliability (olmo_jax/trainer/guard.py, preflight.py; olmo_jax/distributed).
    t.nan_policy = "skip"  # skip | halt: a step with a non-finite loss or gradient norm
    t.max_skipped = 10  # halt after this many skipped steps in a row (0 = never)
    t.spike_sigma = 0.0  # skip steps whose loss / grad norm is this many std above the mean (0 = off)
    t.spike_window = 128  # ... of the last N steps
    t.memory_limit_gb = 0.0  # per device; 0 = the device's memory (CPU: RAM / local devices); < 0 = no check
    t.peer_timeout_s = 60.0  # multi-process: a process silent this long is lost; the others exit
    return c


_CHOICES = {
    "model.dtype": ("float32", "bfloat16"),
    "model.remat": ("none", "block", "attention"),
    "parallel.strategy": ("ddp", "fsdp"),
    "parallel.dispatch": ("rowwise", "ragged", "allgather"),
    "parallel.pipeline_schedule": ("gpipe", "1f1b", "interleaved_1f1b"),
    "optim.schedule": ("cosine", "wsd", "constant"),
    "optim.name": ("adamw", "muon"),
    "trainer.nan_policy": ("skip", "halt"),
    "trainer.wandb.mode": ("online", "offline", "disabled"),
}
LOGGERS = ("jsonl", "tensorboard", "wandb")
_LOGGER_PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb"}  # logger -> module (extra)


def _get(cfg, dotted: str):
    node = cfg
    for part in dotted.split("."):
        node = node[part]
    return node


def unknown_key_error(cfg: ml_collections.ConfigDict, dotted: str) -> ConfigError:
    """A ConfigError for an override of a field that does not exist, with suggestions."""
    parts = dotted.split(".")
    node, path = cfg, []
    for part in parts:
        if isinstance(node, ml_collections.ConfigDict) and part in node:
            node, path = node[part], path + [part]
            continue
        options = list(node.keys()) if isinstance(node, ml_collections.ConfigDict) else []
        near = difflib.get_close_matches(part, options, n=3)
        where = ".".join(path) or "the top level"
        hint = f"; did you mean {', '.join('.'.join(path + [n]) for n in near)}?" if near else ""
        return ConfigError(f"unknown config field '{dotted}': {where} has no field '{part}'{hint}")
    return ConfigError(f"config field '{dotted}' is not overridable")


def model_config(cfg: ml_collections.ConfigDict, vocab_size: int | None = None) -> TransformerConfig:
    """The typed model config for a run (vocab from the data when model.vocab_size is 0)."""
    m = cfg.model.to_dict()
    moe = MoEConfig(**m.pop("moe"))
    if not m["vocab_size"]:
        if vocab_size is None:
            raise ConfigError("model.vocab_size is 0 (= from the tokenizer) but no tokenizer vocab is known")
        m["vocab_size"] = vocab_size
    return TransformerConfig(**m, moe=moe).validate()


def validate(cfg: ml_collections.ConfigDict) -> None:
    """Checks the non-model sections (the model is checked by `model_config`)."""
    for dotted, choices in _CHOICES.items():
        if _get(cfg, dotted) not in choices:
            raise ConfigError(f"{dotted}={_get(cfg, dotted)!r}: choose one of {', '.join(choices)}")
    t, o = cfg.trainer, cfg.optim
    for name in ("max_steps", "global_batch_size", "seq_len", "grad_accum", "log_every"):
        if t[name] < 1:
            raise ConfigError(f"trainer.{name} must be >= 1, got {t[name]}")
    for name in ("microbatches", "virtual_stages"):
        if cfg.parallel[name] < 1:
            raise ConfigError(f"parallel.{name} must be >= 1, got {cfg.parallel[name]}")
    if t.expert_counts_every < 0:
        raise ConfigError(
            f"trainer.expert_counts_every must be >= 0 (0 = off), got {t.expert_counts_every}"
        )
    if t.global_batch_size % t.grad_accum:
        raise ConfigError(
            f"trainer.grad_accum={t.grad_accum} must divide trainer.global_batch_size="
            f"{t.global_batch_size}"
        )
    for name in ("save_every", "keep_last", "keep_every", "hard_stop"):
        if t[name] < 0:
            raise ConfigError(f"trainer.{name} must be >= 0 (0 = off), got {t[name]}")
    if t.hard_stop and t.hard_stop >= t.max_steps:
        raise ConfigError(
            f"trainer.hard_stop={t.hard_stop} must be below trainer.max_steps={t.max_steps} "
            "(or 0 = run to max_steps)"
        )
    if t.max_skipped < 0:
        raise ConfigError(f"trainer.max_skipped must be >= 0 (0 = never halt), got {t.max_skipped}")
    if t.spike_sigma < 0:
        raise ConfigError(f"trainer.spike_sigma must be >= 0 (0 = off), got {t.spike_sigma}")
    if t.spike_window < 2:
        raise ConfigError(f"trainer.spike_window must be >= 2, got {t.spike_window}")
    if t.peer_timeout_s <= 0:
        raise ConfigError(f"trainer.peer_timeout_s must be > 0, got {t.peer_timeout_s}")
    loggers(t)
    profile_window(t.profile_steps)
    if cfg.data.prefetch < 0:
        raise ConfigError(f"data.prefetch must be >= 0 (0 = no read-ahead), got {cfg.data.prefetch}")
    if o.lr <= 0:
        raise ConfigError(f"optim.lr must be > 0, got {o.lr}")
    if not 0 <= o.min_lr_ratio <= 1:
        raise ConfigError(f"optim.min_lr_ratio must be in [0, 1], got {o.min_lr_ratio}")
    if o.name == "muon":
        if not 0 <= o.muon_beta < 1:
            raise ConfigError(f"optim.muon_beta must be in [0, 1), got {o.muon_beta}")
        if o.muon_ns_steps < 1:
            raise ConfigError(f"optim.muon_ns_steps must be >= 1, got {o.muon_ns_steps}")
        if o.muon_rms <= 0:
            raise ConfigError(f"optim.muon_rms must be > 0, got {o.muon_rms}")
        if o.muon_lr < 0:
            raise ConfigError(f"optim.muon_lr must be >= 0 (0 = optim.lr), got {o.muon_lr}")
    if o.warmup_steps < 0:
        raise ConfigError(f"optim.warmup_steps must be >= 0, got {o.warmup_steps}")
    if not 0 < o.decay_fraction <= 1:
        raise ConfigError(f"optim.decay_fraction must be in (0, 1], got {o.decay_fraction}")
    if cfg.model.vocab_size and cfg.data.vocab_size and cfg.model.vocab_size < cfg.data.vocab_size:
        raise ConfigError(
            f"model.vocab_size={cfg.model.vocab_size} is smaller than data.vocab_size="
            f"{cfg.data.vocab_size}; raise model.vocab_size (or set it to 0 = from the data)"
        )


def loggers(t: ml_collections.ConfigDict) -> tuple[str, ...]:
    """The metric sinks named by trainer.loggers, checked (known, installed, jsonl kept)."""
    names = tuple(dict.fromkeys(x.strip() for x in t.loggers.split(",") if x.strip()))
    for name in names:
        if name not in LOGGERS:
            raise ConfigError(
                f"trainer.loggers={t.loggers!r}: unknown logger {name!r}; choose from {', '.join(LOGGERS)}"
            )
    if "jsonl" not in names:
        raise ConfigError(
            f"trainer.loggers={t.loggers!r} must include jsonl: metrics.jsonl is what resuming, "
            "the report and the summary read; e.g. trainer.loggers=jsonl,tensorboard"
        )
    for name in names:
        module = _LOGGER_PACKAGES.get(name)
        if module and importlib.util.find_spec(module) is None:
            raise ConfigError(
                f"trainer.loggers includes {name}, but the {module} package is not installed; "
                f"pip install 'olmo-jax[{name}]' (or remove {name} from trainer.loggers)"
            )
    return names


def profile_window(spec: str) -> tuple[int, int] | None:
    """trainer.profile_steps 'START:END' -> (START, END): the steps START..END-1 (numbered
    as in metrics.jsonl, the first step is 1) are traced; '' -> None."""
    if not spec.strip():
        return None
    fix = "write it as START:END with 1 <= START < END, e.g. trainer.profile_steps=10:13"
    try:
        a, b = (int(x) for x in spec.split(":"))
    except ValueError:
        raise ConfigError(f"trainer.profile_steps={spec!r} is not START:END; {fix}") from None
    if not 1 <= a < b:
        raise ConfigError(f"trainer.profile_steps={spec!r}: need 1 <= START < END; {fix}")
    return a, b
