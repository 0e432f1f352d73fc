"""A small report setup shared by the report tests: a config (3 blocks, the first dense,
8 experts top-2 over a pipe=1 x data=2 x expert=4 mesh, or `pipelined`: pipe=2 x data=1 x
expert=4, 1F1B over 2 microbatches) and a run folder written with the
trainer's own writers (config.json as the loop writes it, metrics.jsonl through
MetricsLog, expert_counts.jsonl through ExpertCountsLog, mesh.json), holding synthetic but
well-formed values (one non-finite loss, written as the trainer writes it)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from olmo_jax.config import default_config
from olmo_jax.trainer.logger import ExpertCountsLog, MetricsLog

STEPS, COUNTS_EVERY, BLOCKS, EXPERTS, TOP_K = 12, 2, (1, 2), 8, 2
TOKENS = 16 * 64  # global batch x seq_len
NAN_STEP = 5  # its loss is written as "nan"


def report_config(pipelined: bool = False):
    c = default_config()
    m = c.model
    m.vocab_size, m.d_model, m.n_layers, m.n_heads, m.n_dense_layers = 64, 32, 3, 2, 1
    m.dense_hidden = 64
    m.moe.num_experts, m.moe.top_k, m.moe.expert_hidden = EXPERTS, TOP_K, 32
    c.parallel.data, c.parallel.expert = 2, 4
    if pipelined:
        c.parallel.pipe, c.parallel.data, c.parallel.microbatches = 2, 1, 2
    t = c.trainer
    t.global_batch_size, t.seq_len, t.max_steps = 16, 64, STEPS
    t.log_every, t.expert_counts_every = 1, COUNTS_EVERY
    return c


def write_run(run_dir: Path, pipelined: bool = False) -> Path:
    cfg = report_config(pipelined)
    cfg.trainer.run_dir = str(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2, default=str))
    p = cfg.parallel
    (run_dir / "mesh.json").write_text(json.dumps({"pipe": p.pipe, "data": p.data, "expert": p.expert}))
    rng = np.random.default_rng(0)
    log = MetricsLog(run_dir / "metrics.jsonl")
    counts_log = ExpertCountsLog(run_dir, COUNTS_EVERY, first_block=BLOCKS[0])
    for step in range(1, STEPS + 1):
        # routed counts drifting towards expert 0 (imbalance grows)
        p = np.full(EXPERTS, 1.0) + np.eye(EXPERTS)[0] * step / 3
        counts = rng.multinomial(TOKENS * TOP_K, p / p.sum(), size=len(BLOCKS))
        imb = counts.max(-1) / counts.mean(-1)
        record = {"step": step, "loss": float("nan") if step == NAN_STEP else 5.0 - 0.2 * step,
                  "tokens_per_s": 1000.0 + 10 * step, "mfu": 0.01 + 0.001 * step,
                  "expert_imbalance": float(imb.max()), "rank_imbalance": float(imb.max() * 0.8),
                  "expert_imbalance_local": float(imb.max() * 1.2),
                  "dropped_frac": 0.01 * step}
        for i, b in enumerate(BLOCKS):
            record[f"expert_imbalance/block{b}"] = float(imb[i])
            record[f"dropped_frac/block{b}"] = 0.01 * step * (i + 1) / 2
        if step % 6 == 0:
            record["eval_loss"] = 4.9 - 0.2 * step
        log.write(record)
        counts_log.maybe_write(step, {"expert_counts": counts})
    log.close()
    counts_log.close()
    return run_dir
