"""A short real training run through the whole loop: the loss decreases, metrics.jsonl
has the documented fields, per-expert counts go to expert_counts.jsonl and plot, the
summary has a sample."""

import json
import subprocess
import sys
from pathlib import Path

from olmo_jax import config as config_lib
from olmo_jax.config import default_config
from olmo_jax.report import page, sources
from olmo_jax.trainer.loop import train

REPO = Path(__file__).resolve().parents[2]

FIELDS = {"step", "loss", "lb_loss", "z_loss", "grad_norm", "lr", "tokens_per_s",
          "tflops_per_device", "mfu", "expert_imbalance", "dropped_frac",
          "expert_imbalance_local", "rank_imbalance", "rank_imbalance/block1",
          "expert_imbalance/block1", "lb_loss/block1", "z_loss/block1"}


def smoke_config(tmp_path, steps=20):
    cfg = default_config()
    m = cfg.model
    m.d_model, m.n_layers, m.n_heads, m.n_dense_layers = 64, 2, 4, 1
    m.moe.num_experts, m.moe.top_k, m.moe.expert_hidden = 4, 2, 64
    cfg.optim.lr, cfg.optim.warmup_steps = 1e-2, 5
    t = cfg.trainer
    t.run_dir = str(tmp_path / "run")
    t.max_steps, t.log_every, t.eval_every, t.eval_batches = steps, 1, 10, 1
    t.global_batch_size, t.seq_len = 8, 64
    t.sample_tokens = 8
    t.expert_counts_every = 5
    cfg.data.eval_fraction = 0.01  # a stated default split (data.eval_fraction defaults to 0)
    return cfg


def test_twenty_steps_loss_decreases(tmp_path):
    summary = train(config_lib.validate(smoke_config(tmp_path)))
    records = [json.loads(line) for line in open(summary.metrics_path)]
    assert [r["step"] for r in records] == list(range(1, 21))
    assert FIELDS <= set(records[0]), set(records[0])
    losses = [r["loss"] for r in records]
    assert sum(losses[-5:]) / 5 < 0.8 * sum(losses[:5]) / 5, losses
    assert "eval_loss" in records[9] and "eval_loss" in records[19]
    assert records[-1]["expert_imbalance"] >= 1.0
    assert records[-1]["dropped_frac"] == 0.0
    assert summary.sample.startswith("import os\nimport sys")
    assert summary.final_eval_loss < records[0]["loss"]
    run_dir = Path(summary.metrics_path).parent
    assert json.loads((run_dir / "mesh.json").read_text()) == {"pipe": 1, "data": 8, "context": 1, "expert": 1}
    _check_report(run_dir, records)
    _check_expert_counts(run_dir, records)


def _check_report(run_dir, records):
    """The report's run page reads this real run folder (drawn and browser-checked in
    tests/report)."""
    run = sources.load_run(run_dir)
    sections = {s["id"]: s for s in page.run_page(run, sources.model_config(run.cfg))["sections"]}
    assert sections["curves"]["data"]["loss"]["value"] == [r["loss"] for r in records]
    assert sections["balance"]["data"]["heatmap"]["steps"] == [5, 10, 15, 20]
    assert sections["mesh"]["data"]["shape"] == [1, 8, 1]


def _check_expert_counts(run_dir, records):
    counts = [json.loads(line) for line in open(run_dir / "expert_counts.jsonl")]
    assert [c["step"] for c in counts] == [5, 10, 15, 20]
    assert counts[0]["blocks"] == [1]
    for c in counts:  # 8 x 64 tokens, top-2, one MoE block; the metric agrees
        assert sum(c["counts"][0]) == 8 * 64 * 2
        rec = records[c["step"] - 1]
        assert abs(max(c["counts"][0]) / (8 * 64 * 2 / 4) - rec["expert_imbalance"]) < 1e-5
    plot = [sys.executable, str(REPO / "tools" / "experiments" / "plot_routing.py"), str(run_dir)]
    r = subprocess.run(plot, capture_output=True, text=True, check=False)
    assert r.returncode == 0, r.stderr
    assert (run_dir / "routing.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (run_dir / "expert_counts.jsonl").unlink()
    r = subprocess.run(plot, capture_output=True, text=True, check=False)
    assert r.returncode == 2 and "trainer.expert_counts_every" in r.stderr, r.stderr
