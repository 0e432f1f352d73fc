"""Where metrics go: one JSON object per line in {run_dir}/metrics.jsonl, optional
per-expert routed counts in {run_dir}/expert_counts.jsonl, and a rich progress bar on the
terminal (loss, tokens/s, MFU, ETA)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn


def _jsonable(v):
    if hasattr(v, "tolist"):
        v = v.tolist()
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return v


class MetricsLog:
    """`enabled=False` (processes other than 0 of a multi-process run): writes nothing."""

    def __init__(self, path: Path, append: bool = False, enabled: bool = True):
        self.path = Path(path)
        self._f = None
        if enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._f = open(self.path, "a" if append else "w", buffering=1)

    def write(self, record: dict) -> None:
        if self._f is not None:
            self._f.write(json.dumps({k: _jsonable(v) for k, v in record.items()}) + "\n")

    def close(self) -> None:
        if self._f is not None:
            self._f.close()


class ExpertCountsLog:
    """Every `every` steps (0 = never), one line {"step", "blocks", "counts"}: counts[l][e]
    are the step's routed assignments of MoE block blocks[l] to expert e (global batch).
    Reads only the metrics' `expert_counts` array, only on those steps."""

    def __init__(self, run_dir: Path, every: int, first_block: int, append: bool = False):
        self.every, self.first_block = every, first_block
        self._log = MetricsLog(Path(run_dir) / "expert_counts.jsonl", append) if every else None

    def maybe_write(self, step: int, metrics: dict) -> None:
        if self._log is None or step % self.every:
            return
        counts = np.asarray(metrics["expert_counts"])
        blocks = list(range(self.first_block, self.first_block + counts.shape[0]))
        self._log.write({"step": step, "blocks": blocks, "counts": counts.astype(np.int64)})

    def close(self) -> None:
        if self._log is not None:
            self._log.close()


class ProgressBar:
    def __init__(self, total_steps: int, start_step: int = 0, console: Console | None = None):
        self.console = console or Console()
        self.progress = Progress(
            TextColumn("[bold]train"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[status]}"),
            TimeRemainingColumn(),
            console=self.console,
        )
        self.task = self.progress.add_task("train", total=total_steps, completed=start_step, status="")

    def __enter__(self):
        self.progress.start()
        return self

    def __exit__(self, *exc):
        self.progress.stop()

    def update(self, step: int, m: dict) -> None:
        status = (
            f"loss {m['loss']:.3f}  {m['tokens_per_s']:,.0f} tok/s  MFU {100 * m['mfu']:.1f}%"
            + (f"  eval {m['eval_loss']:.3f}" if "eval_loss" in m else "")
        )
        self.progress.update(self.task, completed=step, status=status)
