"""Starts and watches the processes of a multi-process run on 127.0.0.1 (test helper)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from tests.conftest import compile_cache_env

ROOT = Path(__file__).resolve().parents[2]
CONFIG = "tests/run_config.py"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env(cache: Path, devices: int) -> dict:
    """Each process: `devices` CPU devices, float32 matmuls as the test process, and the
    test session's persistent compilation cache (a relaunch loads the program)."""
    return {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}",
        **compile_cache_env(cache),
    }


class Run:
    """`n` processes of `python -m olmo_jax.train --config=CONFIG ARGS` on one coordinator."""

    def __init__(self, n: int, args: list[str], logs: Path, cache: Path, devices: int = 4,
                 config: str = CONFIG):
        port = free_port()
        logs.mkdir(parents=True, exist_ok=True)
        self.logs = [logs / f"process{i}.log" for i in range(n)]
        self.procs = []
        for i in range(n):
            cmd = [sys.executable, "-m", "olmo_jax.train", f"--config={config}", *args,
                   f"--coordinator=127.0.0.1:{port}", f"--num_processes={n}", f"--process_id={i}"]
            with open(self.logs[i], "w") as log:
                self.procs.append(subprocess.Popen(cmd, cwd=ROOT, env=child_env(cache, devices),
                                                   stdout=log, stderr=subprocess.STDOUT))

    def log(self, i: int) -> str:
        return self.logs[i].read_text()

    def wait(self, timeout: float) -> list[int]:
        deadline = time.time() + timeout
        codes = []
        for i, p in enumerate(self.procs):
            try:
                codes.append(p.wait(max(1.0, deadline - time.time())))
            except subprocess.TimeoutExpired as e:
                self.kill()
                raise AssertionError(f"process {i} did not end in {timeout} s:\n{self.log(i)[-3000:]}") from e
        return codes

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
                p.wait()


def logged_steps(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:  # a line being written
            break
    return out


def wait_for_step(run_dir: Path, step: int, run: Run, timeout: float = 300) -> None:
    deadline = time.time() + timeout
    while not any(r["step"] >= step for r in logged_steps(run_dir)):
        for i, p in enumerate(run.procs):
            assert p.poll() is None, f"process {i} ended early:\n{run.log(i)[-3000:]}"
        if time.time() > deadline:
            run.kill()
            raise AssertionError(f"step {step} not reached in {timeout} s:\n{run.log(0)[-3000:]}")
        time.sleep(0.05)
