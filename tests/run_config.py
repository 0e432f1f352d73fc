"""The run of the reliability tests (a config file: `get_config()`): a tiny MoE whose 8
experts spread over an `expert` axis of 8 devices (across both processes of the
multi-process tests). Loaded in the test process and by launched runs
(`python -m olmo_jax.train --config=tests/run_config.py`); every test that trains it
with these settings shares one compiled step through the session's compilation cache."""

from olmo_jax.config import default_config


def get_config():
    cfg = default_config()
    m = cfg.model
    m.d_model, m.n_layers, m.n_heads, m.n_dense_layers = 32, 1, 2, 0
    m.moe.num_experts, m.moe.top_k, m.moe.expert_hidden = 8, 2, 32
    cfg.parallel.data, cfg.parallel.expert = 1, 8
    # A constant schedule after warmup: max_steps does not enter the compiled step, so
    # short and open-ended (max_steps=100000) launches share one compiled program.
    cfg.optim.lr, cfg.optim.warmup_steps, cfg.optim.schedule = 1e-2, 2, "constant"
    t = cfg.trainer
    t.max_steps, t.log_every, t.eval_every, t.eval_batches = 100_000, 1, 0, 1
    t.global_batch_size, t.seq_len, t.sample_tokens = 8, 32, 0
    t.save_every, t.keep_last = 0, 2
    t.run_dir = "runs/reliability_test"
    return cfg


def run_config(run_dir, **trainer):
    """get_config() writing to `run_dir`, with trainer fields overridden."""
    cfg = get_config()
    cfg.trainer.run_dir = str(run_dir)
    for k, v in trainer.items():
        cfg.trainer[k] = v
    return cfg
