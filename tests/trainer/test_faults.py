"""Faults inside a real training run (tests/run_config.py, one compiled step shared
through the session's compilation cache):

- preemption: a child `python -m olmo_jax.train` gets SIGTERM, saves a checkpoint at its
  current step and exits 0; a resumed run then gets SIGINT (sent while it reads a batch)
  and does the same; a last resume finishes. Every step's loss and gradient norm is
  bitwise that of an uninterrupted run.
- non-finite batches (a target id outside the vocabulary: the loss is nan, the gradient
  finite), injected by wrapping the data loader the loop builds: with nan_policy=skip the
  step is skipped, counted and training goes on, and max_skipped in a row halt it; with
  nan_policy=halt it halts, naming the step and what was non-finite, without saving the
  halted state, the previous checkpoint kept. Through the command line's error path:
  one `error:` line, exit code 1.
- preflight: a memory limit below the compiled step's estimate refuses to start.
"""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from olmo_jax import config as config_lib
from olmo_jax.errors import ConfigError
from olmo_jax.train import run_training
from olmo_jax.trainer import loop
from olmo_jax.trainer.guard import TrainingHalted
from tests.conftest import compile_cache_env
from tests.run_config import run_config

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def records(run_dir):
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def checkpoints(run_dir):
    return sorted(int(p) for p in os.listdir(run_dir / "checkpoints") if p.isdigit())


def wrap_loader(monkeypatch, edit):
    """The loop's training batches pass through edit(step, rows) (step 0-based)."""
    real = loop.build_data

    def build(*args, **kwargs):
        data = real(*args, **kwargs)
        batch = data.train.batch
        data.train.batch = lambda step, rows=None: edit(step, batch(step, rows), data.vocab_size)
        return data

    monkeypatch.setattr(loop, "build_data", build)


def poison(monkeypatch, steps):
    """Steps `steps` (1-based) get every row's last target = vocab_size (out of range)."""
    def edit(step, rows, vocab):
        if step + 1 in steps:
            rows = rows.copy()
            rows[:, -1] = vocab
        return rows

    wrap_loader(monkeypatch, edit)


@pytest.mark.slow
def test_sigterm_and_sigint_save_exit_and_resume_bitwise(tmp_path, compile_cache, monkeypatch):
    run = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": ROOT, **compile_cache_env(compile_cache)}
    with open(tmp_path / "child.log", "w") as log:
        child = subprocess.Popen(
            [sys.executable, "-m", "olmo_jax.train", "--config=tests/run_config.py",
             f"--config.trainer.run_dir={run}"],
            cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.time() + 300
    while not (run / "metrics.jsonl").exists() or len(records(run)) < 3:
        assert child.poll() is None and time.time() < deadline, (tmp_path / "child.log").read_text()
        time.sleep(0.05)
    child.send_signal(signal.SIGTERM)
    assert child.wait(60) == 0, (tmp_path / "child.log").read_text()
    term_step = checkpoints(run)[-1]
    assert f"SIGTERM: saved a checkpoint at step {term_step}" in (tmp_path / "child.log").read_text()

    int_step = term_step + 2  # SIGINT arrives while the batch of this step is read
    sent = []

    def interrupt(step, rows, vocab):
        if step + 1 == int_step and not sent:  # once: a second Ctrl-C would interrupt at once
            sent.append(step)
            os.kill(os.getpid(), signal.SIGINT)
        return rows

    wrap_loader(monkeypatch, interrupt)
    cfg = run_config(run)
    cfg.data.prefetch = 0  # batches read on the loop's thread, in step: the signal lands in int_step
    # What the run must restore: Python's default, or SIG_IGN when this process started as a
    # background job (a shell's `cmd &` ignores SIGINT in the job, and children inherit it).
    before = signal.getsignal(signal.SIGINT)
    summary = loop.train(config_lib.validate(cfg))
    assert summary.preempted and summary.steps == int_step and checkpoints(run)[-1] == int_step
    assert signal.getsignal(signal.SIGINT) is before  # restored
    monkeypatch.undo()

    end = int_step + 2
    loop.train(config_lib.validate(run_config(run, hard_stop=end)))
    loop.train(config_lib.validate(run_config(tmp_path / "straight", hard_stop=end)))
    got, want = records(run), records(tmp_path / "straight")
    assert [r["step"] for r in got] == list(range(1, end + 1))
    for a, b in zip(got, want, strict=True):
        assert (a["loss"], a["grad_norm"]) == (b["loss"], b["grad_norm"]), a["step"]  # bitwise


@pytest.mark.slow
def test_nonfinite_steps_are_skipped_then_halt(tmp_path, compile_cache, monkeypatch):
    poison(monkeypatch, {2, *range(4, 14)})  # step 2, then 10 in a row: trainer.max_skipped=10
    cfg = run_config(tmp_path / "run", save_every=3)
    with pytest.raises(TrainingHalted) as err:
        loop.train(config_lib.validate(cfg))
    msg = str(err.value)
    assert "training halted at step 13: 10 steps in a row were skipped" in msg, msg
    assert "loss is non-finite and grad_norm is finite" in msg and "step 12 in" in msg
    got = {r["step"]: r for r in records(tmp_path / "run")}
    # metrics.jsonl writes non-finite numbers as strings
    assert got[2]["skipped"] == 1 and got[2]["loss"] == "nan" and np.isfinite(got[2]["grad_norm"])
    assert got[3]["skipped"] == 0 and got[3]["skipped_steps"] == 1 and np.isfinite(got[3]["loss"])
    assert got[12]["skipped_steps"] == 10 and 13 not in got
    assert checkpoints(tmp_path / "run") == [9, 12]


@pytest.mark.slow
def test_nan_policy_halt_keeps_the_last_checkpoint(tmp_path, compile_cache, monkeypatch, capsys):
    poison(monkeypatch, {4})
    # Metrics are read every 3 steps; the save of step 4 reads the halt flag first.
    cfg = run_config(tmp_path / "run", nan_policy="halt", save_every=2, log_every=3)
    assert run_training(cfg) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: training halted at step 4: loss is non-finite and grad_norm "
                          "is finite (trainer.nan_policy=halt)"), err
    assert "the last checkpoint, step 2 in" in err and "Traceback" not in err
    assert checkpoints(tmp_path / "run") == [2]
    assert [r["step"] for r in records(tmp_path / "run")] == [1, 3]


def test_preflight_refuses_a_step_that_does_not_fit(tmp_path, compile_cache, capsys):
    cfg = run_config(tmp_path / "run", memory_limit_gb=1e-4)
    with pytest.raises(ConfigError, match=r"the train step needs an estimated .* GiB per device"):
        loop.train(config_lib.validate(cfg))
    assert run_training(cfg) == 2
    err = capsys.readouterr().err
    assert "GiB are available (trainer.memory_limit_gb=0.0001)" in err
    for knob in ("model.remat=block", "trainer.grad_accum", "trainer.seq_len",
                 "trainer.global_batch_size", "model.dtype=bfloat16", "parallel.expert"):
        assert knob in err, knob
    assert not (tmp_path / "run" / "checkpoints").exists() or not checkpoints(tmp_path / "run")
