"""The data pipeline's cost on a config's data (default configs/tiny.py: the embedded stdlib
corpus, 32 x 257-token windows a step): grain (olmo_jax/data/stream.py) against the
hand-written numpy loader it replaced (olmo_jax/data/loader.py at --baseline, read with
`git show`).

    python tools/bench/bench_loader.py [--config configs/tiny.py] [--steps 400] [--step_ms 20]

Prints, for each: random-access batches/s (`batch(step)`, what evaluation and multi-process
placement call), the first batch (the numpy loader draws a whole epoch's permutation), and
for grain's prefetched stream the time the consumer waits per step when each step computes
for --step_ms (a stand-in for the train step running while the next batch is read), and
the CPU time the stream costs per step (its reader thread included)."""

from __future__ import annotations

import argparse
import runpy
import subprocess
import sys
import time
import types
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from olmo_jax import config as config_lib  # noqa: E402
from olmo_jax.data import build_data  # noqa: E402


def baseline_loader_class(commit: str):
    source = subprocess.run(["git", "show", f"{commit}:olmo_jax/data/loader.py"], cwd=ROOT,
                            capture_output=True, text=True, check=True).stdout
    module = types.ModuleType("baseline_loader")
    sys.modules["baseline_loader"] = module
    exec(compile(source, "baseline_loader.py", "exec"), module.__dict__)
    return module.BatchLoader


def timed(fn, n):
    t0 = time.perf_counter()
    for i in range(n):
        fn(i)
    return (time.perf_counter() - t0) / n


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--config", default="configs/tiny.py")
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--step_ms", type=float, default=20.0)
    p.add_argument("--baseline", default="32d4299")
    a = p.parse_args()
    cfg = runpy.run_path(str(ROOT / a.config))["get_config"]()
    t = cfg.trainer
    data = build_data(config_lib.parse(cfg).data, t.seq_len, t.global_batch_size, t.seed, t.cache_dir)
    ids = data.train.window_ids
    print(f"{len(ids)} training windows, batch {t.global_batch_size} x {t.seq_len + 1} tokens")
    Old = baseline_loader_class(a.baseline)
    from olmo_jax.data import BatchLoader

    results = {}
    for name, cls in (("numpy (baseline)", Old), ("grain", BatchLoader)):
        loader = cls(data.windows, ids, t.global_batch_size, t.seed)
        t0 = time.perf_counter()
        loader.batch(0)
        first = time.perf_counter() - t0
        per = timed(lambda i, loader=loader: loader.batch(i + 1), a.steps)
        results[name] = per
        tok = t.global_batch_size * t.seq_len / per
        print(f"{name:17s} first batch {first * 1e3:7.2f} ms; batch(step) {per * 1e3:6.3f} ms "
              f"= {1 / per:8.0f} batches/s = {tok / 1e6:6.2f} M tokens/s")
    for prefetch in (0, 2):
        stream = BatchLoader(data.windows, ids, t.global_batch_size, t.seed).stream(prefetch=prefetch)
        next(stream)
        waits, cpu0 = [], time.process_time()
        for _ in range(min(a.steps, 200)):
            t0 = time.perf_counter()
            next(stream)
            waits.append(time.perf_counter() - t0)
            time.sleep(a.step_ms / 1e3)  # the train step computing
        cpu_ms = (time.process_time() - cpu0) / len(waits) * 1e3  # all threads of this process
        stream.close()
        print(f"grain stream, prefetch {prefetch}: the step waits {np.median(waits) * 1e3:6.3f} ms "
              f"(median; mean {np.mean(waits) * 1e3:.3f}) for its batch with {a.step_ms:g} ms steps; "
              f"{cpu_ms:.2f} ms CPU per step")


if __name__ == "__main__":
    main()
