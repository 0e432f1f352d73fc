"""What every JAX section process of the GPU check shares: its command line, the model
and trainer config it measures (configs/gpu_check_1b.py, or its tiny dry-run version),
and writing its result (or its error) as JSON for the driver. Needs no GPU."""

from __future__ import annotations

import argparse
import contextlib
import json
import runpy
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "gpu_check_1b.py"
nullcontext = contextlib.nullcontext


def config(dry: bool):
    """configs/gpu_check_1b.py; --dry-run: the same design shrunk (d_model 64, 2 blocks, 4
    experts top-2, vocab 384, 2 x 32 tokens) so every section runs on a CPU in seconds."""
    cfg = runpy.run_path(str(CONFIG))["get_config"]()
    if dry:
        m = cfg.model
        m.vocab_size, m.d_model, m.n_layers, m.n_heads = 384, 64, 2, 2
        m.moe.num_experts, m.moe.top_k, m.moe.expert_hidden = 4, 2, 64
        cfg.trainer.global_batch_size, cfg.trainer.seq_len = 2, 32
    return cfg


def model_and_trainer(dry: bool):
    from olmo_jax import config as config_lib

    cfg = config(dry)
    return config_lib.model_config(cfg), cfg.trainer


def shape(dry: bool) -> dict:
    """The shape the torch sections build (tools/gpu_check/torch_train.py), the same model."""
    cfg = config(dry)
    m, t = cfg.model, cfg.trainer
    return dict(vocab_size=m.vocab_size, d_model=m.d_model, n_layers=m.n_layers, n_heads=m.n_heads,
                n_kv_heads=m.n_kv_heads or m.n_heads, num_experts=m.moe.num_experts,
                top_k=m.moe.top_k, expert_hidden=m.moe.expert_hidden, rope_theta=m.rope_theta,
                norm_eps=m.norm_eps, init_std=m.init_std, lb_loss_coef=m.moe.lb_loss_coef,
                z_loss_coef=m.moe.z_loss_coef, lr=cfg.optim.lr, weight_decay=cfg.optim.weight_decay,
                b1=cfg.optim.b1, b2=cfg.optim.b2, clip=cfg.optim.clip_grad_norm,
                batch=t.global_batch_size, seq_len=t.seq_len)


def section_args(sections):
    p = argparse.ArgumentParser()
    p.add_argument("section", choices=sorted(sections))
    p.add_argument("out")
    p.add_argument("--dry-run", action="store_true")
    p.add_argument("--gmm-impl", default="pallas")
    p.add_argument("--steps", type=int, default=30)
    return p.parse_args()


def run_section(args, fn) -> None:
    """Runs fn() and writes {"result": ...} or {"error": ..., "traceback": ...} to args.out;
    exits 0 either way (the driver reads the file; a crash or a timeout leaves none)."""
    t0 = time.perf_counter()
    try:
        out = {"result": fn()}
    except Exception as e:
        out = {"error": f"{type(e).__name__}: {e}"[:3000], "traceback": traceback.format_exc()[-6000:]}
        print(out["traceback"], file=sys.stderr, flush=True)
    out["seconds"] = time.perf_counter() - t0
    Path(args.out).write_text(json.dumps(out, indent=1, default=str))
