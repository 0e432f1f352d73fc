"""Auxiliary-loss-free balancing vs no balancing on a config (default configs/tiny.py).

    python tools/experiments/compare_balancing.py [--config configs/tiny.py] [--steps 200]
        [--bias-rate 1e-3] [--out runs/balancing] [--with-lb-loss]

Trains the config once per variant, same seed and data, and prints each run's
expert_imbalance (worst block, global batch) at the last step and averaged over the last
quarter of logged steps, with rank_imbalance, lb_loss (computed even when its coefficient
is 0) and the LM loss:
  none        lb_loss_coef = 0, bias_rate = 0
  bias        lb_loss_coef = 0, bias_rate = --bias-rate (aux-loss-free balancing)
  lb_loss     the config's lb_loss_coef, bias_rate = 0 (with --with-lb-loss)
Each run writes metrics.jsonl and expert_counts.jsonl under OUT/<variant>
(plot one with tools/experiments/plot_routing.py OUT/<variant>).
"""

from __future__ import annotations

import argparse
import json
import runpy
from pathlib import Path

from rich.console import Console
from rich.table import Table

from olmo_jax import config as config_lib
from olmo_jax.trainer.loop import train


def variants(args) -> dict[str, dict]:
    out = {
        "none": {"lb_loss_coef": 0.0, "bias_rate": 0.0},
        "bias": {"lb_loss_coef": 0.0, "bias_rate": args.bias_rate},
    }
    if args.with_lb_loss:
        out["lb_loss"] = {"bias_rate": 0.0}
    return out


def summarize(metrics_path: Path) -> dict[str, float]:
    records = [json.loads(line) for line in metrics_path.read_text().splitlines()]
    tail = records[-max(1, len(records) // 4):]
    mean = lambda k: sum(r[k] for r in tail) / len(tail)
    last = records[-1]
    return {
        "step": last["step"],
        "imbalance_last": last["expert_imbalance"],
        "imbalance_tail": mean("expert_imbalance"),
        "rank_imbalance_tail": mean("rank_imbalance"),
        "lb_loss_tail": mean("lb_loss"),
        "loss_tail": mean("loss"),
        "eval_loss": last.get("eval_loss", float("nan")),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--config", default="configs/tiny.py")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--bias-rate", type=float, default=1e-3)
    ap.add_argument("--out", type=Path, default=Path("runs/balancing"))
    ap.add_argument("--with-lb-loss", action="store_true")
    args = ap.parse_args()
    console = Console()
    results = {}
    for name, moe_overrides in variants(args).items():
        cfg = runpy.run_path(args.config)["get_config"]()
        cfg.trainer.max_steps = args.steps
        cfg.trainer.run_dir = str(args.out / name)
        cfg.trainer.expert_counts_every = cfg.trainer.log_every
        cfg.trainer.sample_tokens = 0
        for k, v in moe_overrides.items():
            cfg.model.moe[k] = v
        overrides = ", ".join(f"model.moe.{k}={v}" for k, v in moe_overrides.items())
        console.rule(f"{name}: {overrides}")
        summary = train(config_lib.validate(cfg), console)
        results[name] = summarize(Path(summary.metrics_path))

    table = Table(title=f"{args.config}, {args.steps} steps (tail = last quarter of logged steps)")
    cols = list(next(iter(results.values())))
    table.add_column("variant")
    for c in cols:
        table.add_column(c, justify="right")
    for name, r in results.items():
        table.add_row(name, *(f"{r[c]:.4g}" for c in cols))
    Console(width=max(console.width, 120)).print(table)
    (args.out / "summary.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
