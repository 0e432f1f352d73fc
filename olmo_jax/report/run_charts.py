"""Report sections of a run: "curves" (loss, tokens/s, MFU over steps; one chart per
downstream task, trainer.downstream_evals) and "balance" (the
per-block expert-load heatmap over steps, the imbalance metrics and the dropped fraction).

Inputs are the run folder's records as the trainer writes them (`metrics.jsonl`, and
`expert_counts.jsonl` with `trainer.expert_counts_every` > 0; see docs/training.md).
Non-finite values (written as strings) become None: a gap in the curve.
"""

from __future__ import annotations

import math
import re

import numpy as np

CURVES = ("loss", "eval_loss", "tokens_per_s", "mfu")
BALANCE = ("expert_imbalance", "expert_imbalance_local", "rank_imbalance", "dropped_frac")
MAX_HEATMAP_CELLS = 200_000  # beyond, every stride-th counts record is drawn
_BLOCK = re.compile(r"^(\w+)/block(\d+)$")


def _value(v):
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    return float(v) if math.isfinite(v) else None


def series(records: list[dict], key: str) -> dict:
    """{"step": [...], "value": [...]} over the records that have `key`."""
    rows = [(r["step"], _value(r[key])) for r in records if key in r and "step" in r]
    return {"step": [s for s, _ in rows], "value": [v for _, v in rows]}


def curves_section(records: list[dict]) -> dict:
    """CURVES, and `downstream`: {label: {metric: series}} of trainer.downstream_evals'
    `downstream/<label>/<metric>` records (their `seconds` left out)."""
    out = {key: series(records, key) for key in CURVES}
    downstream: dict = {}
    for key in sorted({k for r in records for k in r if k.startswith("downstream/")}):
        _, label, metric = key.split("/", 2)
        if metric != "seconds":
            downstream.setdefault(label, {})[metric] = series(records, key)
    out["downstream"] = downstream
    return out


def balance_section(records: list[dict], counts: list[dict], counts_every: int) -> dict:
    """Imbalance series (worst block and per block) and the heatmap's counts (the page
    colours each cell by its load, counts / mean over the block's experts)."""
    metrics = {}
    for key in BALANCE:
        per_block = {}
        for name in sorted({k for r in records for k in r}):
            m = _BLOCK.match(name)
            if m and m.group(1) == key:
                per_block[int(m.group(2))] = series(records, name)
        metrics[key] = {"all": series(records, key),
                        "blocks": {str(b): per_block[b] for b in sorted(per_block)}}
    heatmap = None
    if counts:
        stride = max(1, math.ceil(len(counts) * len(counts[0]["counts"]) * len(counts[0]["counts"][0])
                                  / MAX_HEATMAP_CELLS))
        kept = counts[::stride]
        counts_WLE = np.asarray([r["counts"] for r in kept], np.int64)
        heatmap = {"steps": [int(r["step"]) for r in kept], "blocks": kept[0]["blocks"],
                   "stride": stride,
                   "counts": counts_WLE.transpose(1, 0, 2).tolist(),  # [L][W][E] routed assignments
                   "mean": counts_WLE.mean(axis=-1).T.tolist()}  # [L][W]: load = counts / mean
    return {"metrics": metrics, "heatmap": heatmap, "counts_every": counts_every}
