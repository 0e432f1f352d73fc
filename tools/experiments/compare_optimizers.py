"""AdamW vs Muon on the tiny config (configs/tiny.py: 4 blocks, 8 experts top-2, the
embedded stdlib corpus), each at its best learning rate from a small sweep, through the
real training loop (olmo_jax.trainer.loop.train) with the same data, seed and schedule.

    .venv/bin/python tools/experiments/compare_optimizers.py [--steps 200] [--batch 32] \\
        [--adamw-lrs 2e-3,4e-3,8e-3] [--muon-lrs 4e-3,8e-3,1.6e-2] [--out runs/compare_optimizers]

For every (optimizer, lr) it prints the final and best training loss (mean of the last /
best window of 10 logged steps) and the final eval loss; then the tuned pair (the lr of
each with the lowest final training loss) with both loss curves, every 10th step.
Muon's lr is the peak of the shared schedule (optim.lr: with the RMS-matching scale rule
AdamW's embeddings, head, norms and router use it too).
"""

from __future__ import annotations

import argparse
import json
import runpy
import shutil
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]


def run(name: str, lr: float, steps: int, batch: int, out: Path) -> dict:
    from olmo_jax import config as config_lib
    from olmo_jax.trainer.loop import train

    cfg = runpy.run_path(str(ROOT / "configs" / "tiny.py"))["get_config"]()
    cfg.optim.name, cfg.optim.lr = name, lr
    t = cfg.trainer
    t.max_steps, t.log_every, t.eval_every, t.sample_tokens = steps, 1, steps, 0
    t.global_batch_size = batch or t.global_batch_size
    t.save_every, t.run_dir = steps, str(out / f"{name}_{lr:g}")
    shutil.rmtree(t.run_dir, ignore_errors=True)
    summary = train(config_lib.validate(cfg))
    lines = (Path(t.run_dir) / "metrics.jsonl").read_text().splitlines()
    loss = np.array([r["loss"] for r in map(json.loads, lines) if "loss" in r])
    window = np.convolve(loss, np.ones(10) / 10, mode="valid")
    return {"optim": name, "lr": lr, "final": float(window[-1]), "best": float(window.min()),
            "eval": summary.final_eval_loss, "curve": loss}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--batch", type=int, default=0, help="global batch (0 = the config's 32)")
    ap.add_argument("--adamw-lrs", default="2e-3,4e-3,8e-3")
    ap.add_argument("--muon-lrs", default="4e-3,8e-3,1.6e-2")
    ap.add_argument("--out", default="runs/compare_optimizers")
    args = ap.parse_args()
    out = Path(args.out)
    results = []
    for name, lrs in (("adamw", args.adamw_lrs), ("muon", args.muon_lrs)):
        for lr in map(float, lrs.split(",")):
            results.append(run(name, lr, args.steps, args.batch, out))
    print(f"\n{args.steps} steps of configs/tiny.py (global batch {args.batch or 32}); losses: "
          "mean of 10 logged steps")
    print(f"{'optim':<6} {'lr':>8} {'final':>8} {'best':>8} {'eval':>8}")
    for r in results:
        print(f"{r['optim']:<6} {r['lr']:>8.1e} {r['final']:>8.4f} {r['best']:>8.4f} {r['eval']:>8.4f}")
    tuned = {n: min((r for r in results if r["optim"] == n), key=lambda r: r["final"])
             for n in ("adamw", "muon")}
    a, m = tuned["adamw"], tuned["muon"]
    print(f"\ntuned: adamw lr {a['lr']:.1e} final {a['final']:.4f} best {a['best']:.4f} eval "
          f"{a['eval']:.4f} | muon lr {m['lr']:.1e} final {m['final']:.4f} best {m['best']:.4f} "
          f"eval {m['eval']:.4f}")
    print(f"{'step':>6} {'adamw':>8} {'muon':>8}")
    for i in range(9, len(a["curve"]), 10):
        print(f"{i + 1:>6} {a['curve'][i]:>8.4f} {m['curve'][i]:>8.4f}")


if __name__ == "__main__":
    main()
