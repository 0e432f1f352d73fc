"""The fault-injection suite's shared pieces: real `python -m olmo_jax.train` runs of
configs/tiny.py (its model; a small batch, 6 steps, a checkpoint every 2) on one CPU
device, reading one token file written here, and the uninterrupted reference run whose
per-step losses every resumed run must reproduce bitwise."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from olmo_jax.data import write_token_file
from tests.conftest import compile_cache_env

REPO = Path(__file__).resolve().parents[2]
STEPS = 6


def tiny_args(run_dir: Path, tokens: Path, *extra: str) -> list[str]:
    return [
        "--config=configs/tiny.py", f"--config.trainer.run_dir={run_dir}",
        f"--config.data.paths={tokens}", "--config.data.eval_fraction=0.0",
        f"--config.trainer.max_steps={STEPS}", "--config.trainer.save_every=2",
        "--config.trainer.log_every=1", "--config.trainer.eval_every=0",
        "--config.trainer.eval_batches=0", "--config.trainer.sample_tokens=0",
        "--config.trainer.global_batch_size=8", "--config.trainer.seq_len=64",
        "--config.optim.warmup_steps=2", *extra,
    ]


def child_env(cache) -> dict:
    """One CPU device, the session's compilation cache, this checkout on the path."""
    return {**os.environ, "XLA_FLAGS": "", "PYTHONPATH": str(REPO), **compile_cache_env(cache)}


def start(args: list[str], cache, module: str = "olmo_jax.train") -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", module, *args], cwd=REPO,
                            env=child_env(cache), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def finish(proc: subprocess.Popen, timeout: float = 300) -> subprocess.CompletedProcess:
    out, err = proc.communicate(timeout=timeout)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def run(args: list[str], cache, module: str = "olmo_jax.train") -> subprocess.CompletedProcess:
    return finish(start(args, cache, module))


def wait_for(predicate, proc: subprocess.Popen, what: str, timeout: float = 300) -> None:
    """Polls `predicate()` every 2 ms until true; fails if `proc` ends first."""
    end = time.monotonic() + timeout
    while not predicate():
        if proc.poll() is not None:
            out, err = proc.communicate()
            pytest.fail(f"the run ended (code {proc.returncode}) before {what}:\n{out[-2000:]}"
                        f"\n{err[-3000:]}")
        if time.monotonic() > end:
            proc.kill()
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.002)


def temporary_saves(run_dir: Path) -> list[str]:
    ckpts = run_dir / "checkpoints"
    try:
        return [p for p in os.listdir(ckpts) if ".orbax-checkpoint-tmp" in p]
    except FileNotFoundError:
        return []


def losses(run_dir: Path) -> dict[int, float]:
    """{step: loss} of metrics.jsonl; every line must be a whole JSON record and every step
    appear once."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in records]
    assert steps == sorted(set(steps)), f"steps logged twice or out of order: {steps}"
    return {r["step"]: r["loss"] for r in records}


def one_error_line(proc: subprocess.CompletedProcess) -> str:
    """The run's single `error:` line; no traceback anywhere in its output."""
    both = proc.stdout + proc.stderr
    assert "Traceback" not in both, both[-4000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, proc.stderr[-4000:]
    return errors[0]


@pytest.fixture(scope="module")
def tokens(tmp_path_factory) -> Path:
    """A token file of random byte-tokenizer ids (uint16: the padded vocabulary 384)."""
    path = tmp_path_factory.mktemp("data") / "tokens.npy"
    write_token_file(path, np.random.default_rng(0).integers(0, 256, 64 * 8 * 12), "uint16")
    return path


@pytest.fixture(scope="module")
def reference(tmp_path_factory, tokens, compile_cache):
    """(run folder, {step: loss}) of the uninterrupted run."""
    run_dir = tmp_path_factory.mktemp("reference") / "run"
    proc = run(tiny_args(run_dir, tokens), compile_cache)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    got = losses(run_dir)
    assert sorted(got) == list(range(1, STEPS + 1)), got
    return run_dir, got
