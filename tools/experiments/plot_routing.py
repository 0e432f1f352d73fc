"""Heatmap of expert load over training steps, one panel per MoE block.

    python tools/experiments/plot_routing.py RUN_DIR [-o out.png]

Reads {RUN_DIR}/expert_counts.jsonl (written when trainer.expert_counts_every > 0) and
writes {RUN_DIR}/routing.png: for each block, experts on the y axis, logged steps on the x
axis, colour = the expert's load relative to the mean (1.0 = balanced), with the block's
max/mean imbalance over steps in the panel title.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402


def load_counts(run_dir: Path) -> tuple[np.ndarray, list[int], np.ndarray]:
    """(steps [N], blocks [L], counts [N, L, E]) from the run's expert_counts.jsonl."""
    path = run_dir / "expert_counts.jsonl"
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} not found: train with --config.trainer.expert_counts_every=N (N > 0) "
            f"to record per-expert counts"
        )
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if not records:
        raise ValueError(f"{path} has no records yet")
    steps = np.array([r["step"] for r in records])
    counts = np.array([r["counts"] for r in records], np.float64)
    return steps, records[0]["blocks"], counts


def plot(run_dir: Path, out: Path) -> Path:
    steps, blocks, counts = load_counts(run_dir)
    load = counts / np.maximum(counts.mean(axis=-1, keepdims=True), 1e-9)  # [N, L, E]
    n_blocks, n_experts = load.shape[1], load.shape[2]
    fig, axes = plt.subplots(n_blocks, 1, figsize=(8, 1.2 + 0.25 * n_experts * n_blocks),
                             squeeze=False, sharex=True)
    vmax = max(2.0, float(load.max()))
    for l, ax in enumerate(axes[:, 0]):
        im = ax.imshow(load[:, l, :].T, aspect="auto", origin="lower", cmap="magma",
                       vmin=0.0, vmax=vmax, interpolation="nearest",
                       extent=(steps[0] - 0.5, steps[-1] + 0.5, -0.5, n_experts - 0.5))
        worst = load[:, l, :].max(axis=-1)
        ax.set_title(f"block {blocks[l]}: max/mean {worst[0]:.2f} (step {steps[0]}) -> "
                     f"{worst[-1]:.2f} (step {steps[-1]})", fontsize=9)
        ax.set_ylabel("expert")
        fig.colorbar(im, ax=ax, label="load / mean")
    axes[-1, 0].set_xlabel("step")
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("-o", "--out", type=Path, default=None, help="default: RUN_DIR/routing.png")
    args = ap.parse_args(argv)
    try:
        out = plot(args.run_dir, args.out or args.run_dir / "routing.png")
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
