"""The data loader reading token files from an S3-compatible server against local disk, side
by side in one run, on a config's batches (default configs/tiny.py: 32 x 257-token windows a
step) over the first --mb MiB of its data (the embedded stdlib corpus).

    python tools/bench/bench_object_store.py [--config configs/tiny.py] [--mb 16]
        [--steps 40] [--step_ms 20] [--cache_mb 256] [--small_cache_mb 2]

Starts moto's S3 server on 127.0.0.1 (a free port; credentials and AWS_ENDPOINT_URL in the
environment, as a real run takes them), uploads the token file, and builds the same loader
from the local file and from its s3:// URL (olmo_jax/data/token_file.py RemoteTokenFile,
byte ranges through a data.remote_cache_mb cache). A third row reads the bucket through a
--small_cache_mb cache, smaller than the file. Prints for each: the first batch,
random-access `batch(step)` (tokens/s), and the prefetched stream the trainer reads: the
time a step waits for its batch when each step computes for --step_ms, and tokens/s. The
batches are checked equal. The numbers are the loopback server's (no network latency).
"""

from __future__ import annotations

import argparse
import os
import runpy
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from olmo_jax import config as config_lib  # noqa: E402
from olmo_jax import storage  # noqa: E402
from olmo_jax.data import build_data, write_token_file  # noqa: E402


def start_server() -> subprocess.Popen:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p",
                               str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    os.environ.update({"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench",
                       "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
                       "AWS_DEFAULT_REGION": "us-east-1"})
    for _ in range(300):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return server
        except OSError:
            time.sleep(0.1)
    server.kill()
    raise SystemExit("moto's server did not start (pip install 'moto[server]')")


def measure(name, data, t, steps, step_ms):
    loader = data.train
    t0 = time.perf_counter()
    first = loader.batch(0)
    first_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for s in range(1, steps + 1):
        loader.batch(s)
    per = (time.perf_counter() - t0) / steps
    tokens = t.global_batch_size * t.seq_len
    loader.step = steps + 1  # the stream reads steps batch(step) has not (a cold cache)
    stream = loader.stream(prefetch=2)
    next(stream)
    waits = []
    t_run = time.perf_counter()
    for _ in range(steps):
        w0 = time.perf_counter()
        next(stream)
        waits.append(time.perf_counter() - w0)
        time.sleep(step_ms / 1e3)  # the train step computing while the next batch is read
    run_s = time.perf_counter() - t_run
    print(f"{name:10s} first batch {first_s * 1e3:8.2f} ms | batch(step) {per * 1e3:7.3f} ms = "
          f"{tokens / per / 1e6:6.2f} M tokens/s | stream: wait {np.mean(waits) * 1e3:6.3f} ms "
          f"mean, {np.max(waits) * 1e3:7.2f} ms max per step, {steps * tokens / run_s:9,.0f} "
          f"tokens/s at {step_ms:g} ms a step")
    return first, [loader.batch(s) for s in range(3)]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--config", default="configs/tiny.py")
    p.add_argument("--mb", type=int, default=16)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--step_ms", type=float, default=20.0)
    p.add_argument("--cache_mb", type=int, default=256)
    p.add_argument("--small_cache_mb", type=int, default=2, help="a third row: the bucket "
                   "through a cache smaller than the file (blocks evicted and read again)")
    a = p.parse_args()
    cfg = runpy.run_path(str(ROOT / a.config))["get_config"]()
    t = cfg.trainer
    run = config_lib.parse(cfg)
    source = build_data(run.data, t.seq_len, t.global_batch_size, t.seed, t.cache_dir)
    src = source.windows.files[0]
    n_tokens = min(len(src), (a.mb << 20) // src.dtype.itemsize)
    server = start_server()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            local = Path(tmp) / "tokens.npy"
            write_token_file(local, np.asarray(src.tokens[:n_tokens]), src.dtype)
            fs = storage.filesystem("s3://")
            fs.mkdir("bench")
            t0 = time.perf_counter()
            fs.put_file(str(local), "bench/tokens.npy")
            print(f"{n_tokens:,} {src.dtype.name} tokens ({local.stat().st_size / 2**20:.1f} MiB), "
                  f"uploaded in {time.perf_counter() - t0:.2f} s; batch {t.global_batch_size} x "
                  f"{t.seq_len} tokens; {a.steps} steps; moto server on 127.0.0.1")
            results = {}
            url = "s3://bench/tokens.npy"
            for name, path, cache_mb in (("disk", str(local), a.cache_mb), ("s3", url, a.cache_mb),
                                         (f"s3 {a.small_cache_mb}MiB", url, a.small_cache_mb)):
                data = build_data({"paths": path, "vocab_size": source.vocab_size,
                                   "remote_cache_mb": cache_mb},
                                  t.seq_len, t.global_batch_size, t.seed)
                results[name] = measure(name, data, t, a.steps, a.step_ms)
                if path == url:
                    cache = data.windows.files[0].cache
                    print(f"{'':10s} fetched {cache.fetched_bytes / 2**20:.1f} MiB from the "
                          f"store, {cache.held_bytes / 2**20:.1f} MiB held (bound {cache_mb} MiB)")
            for name in results:
                for x, y in zip(results["disk"][1], results[name][1], strict=True):
                    np.testing.assert_array_equal(x, y)
            print("the batches from s3 equal the batches from disk")
    finally:
        server.terminate()
        server.wait(timeout=30)


if __name__ == "__main__":
    main()
