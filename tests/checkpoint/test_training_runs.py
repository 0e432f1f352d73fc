"""Checkpoints through the real training loop, on the architecture of the Hugging Face
base parity case (so every run below compiles the same train step: a persistent
compilation cache, on for this module only, makes all but the first cheap).

1. Resume: 20 steps straight vs 10 steps (hard stop), a resumed child process killed with
   SIGKILL in the middle of saving step 15, and a second resume to 20. Every step's loss
   in metrics.jsonl is bitwise the straight run's, each step appears once, the
   checkpoint of step 10 is untouched by the kill, the interrupted save is ignored; the
   TensorBoard events of the three launches read back (EventAccumulator) as metrics.jsonl,
   each step once; every checkpoint holds the grain iterator state of its step.
2. Fine-tune: hf-to-orbax, then trainer.init_from starts from exactly those weights (the
   first loss is the HF model's loss on that batch) with a fresh optimizer; a run whose
   architecture differs from the checkpoint's is refused, naming the field.
"""

import hashlib
import json
import os
import runpy
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from olmo_jax import config as config_lib
from olmo_jax.checkpoint import hf
from olmo_jax.data import build_data
from olmo_jax.errors import CheckpointError
from olmo_jax.objective import forward_losses
from olmo_jax.optim import build_optimizer
from olmo_jax.trainer.loop import train
from tests.checkpoint.oracle import ROOT, case_config
from tests.conftest import compile_cache_env

CHILD = Path(__file__).with_name("kill_child.py")


def set_trainer(cfg, run_dir: Path, **trainer):
    t = cfg.trainer
    t.run_dir = str(run_dir)
    t.max_steps, t.log_every, t.eval_every, t.eval_batches = 20, 1, 0, 1
    t.global_batch_size, t.seq_len, t.sample_tokens = 8, 32, 0
    t.save_every, t.keep_last, t.keep_every = 5, 2, 10
    t.loggers = "jsonl,tensorboard"
    cfg.data.eval_fraction = 0.01  # a stated eval split: a resumed run must match its loss too
    for k, v in trainer.items():
        t[k] = v
    return cfg


def run_config(run_dir: Path, **trainer):
    cfg = config_lib.default_config()
    cfg.update(hf.run_config(case_config("base")))
    return set_trainer(cfg, run_dir, **trainer)


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def tree_hash(folder: Path) -> str:
    h = hashlib.sha256()
    for f in sorted(p for p in folder.rglob("*") if p.is_file()):
        h.update(str(f.relative_to(folder)).encode() + f.read_bytes())
    return h.hexdigest()


def run_child_until_saving(run: Path, step: int, compile_cache: Path, tmp_path: Path):
    """Starts kill_child.py on `run` and returns it once the save of `step` is at its
    commit point."""
    config_json, marker = tmp_path / "child_config.json", tmp_path / "saving"
    config_json.write_text(run_config(run).to_json())
    env = {**os.environ, "PYTHONPATH": str(ROOT), **compile_cache_env(compile_cache)}
    log_path = tmp_path / "child.log"
    with open(log_path, "w") as log:
        child = subprocess.Popen(
            [sys.executable, str(CHILD), str(config_json), str(step), str(marker)],
            cwd=ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    deadline = time.time() + 300
    while not marker.exists():
        assert child.poll() is None, log_path.read_text()[-4000:]
        assert time.time() < deadline, f"the child never reached the save of step {step}"
        time.sleep(0.05)
    return child


@pytest.mark.slow
def test_resume_is_bitwise_and_survives_kill_mid_save(tmp_path, compile_cache):
    straight = train(config_lib.validate(run_config(tmp_path / "straight")))
    straight_records = records(tmp_path / "straight")

    run = tmp_path / "run"
    train(config_lib.validate(run_config(run, hard_stop=10)))
    ckpts = run / "checkpoints"
    assert sorted(os.listdir(ckpts)) == ["10", "5"]
    assert [r["step"] for r in records(run)] == list(range(1, 11))
    before = tree_hash(ckpts / "10")

    # A child resumes from 10 and is killed exactly when saving step 15 is about to commit.
    child = run_child_until_saving(run, 15, compile_cache, tmp_path)
    child.send_signal(signal.SIGKILL)
    child.wait()
    tmp_dirs = [p for p in os.listdir(ckpts) if ".orbax-checkpoint-tmp" in p]
    assert tmp_dirs and tmp_dirs[0].startswith("15"), os.listdir(ckpts)
    assert "15" not in os.listdir(ckpts)  # the interrupted save never became a checkpoint
    assert tree_hash(ckpts / "10") == before  # and the previous one is untouched
    killed_steps = [r["step"] for r in records(run)]
    assert killed_steps[:10] == list(range(1, 11)) and max(killed_steps) >= 15

    resumed = train(config_lib.validate(run_config(run)))  # resumes from 10, the incomplete 15 ignored
    got = records(run)
    assert [r["step"] for r in got] == list(range(1, 21))  # appended, no duplicates
    for a, b in zip(straight_records, got, strict=True):
        assert a["loss"] == b["loss"], (a["step"], a["loss"], b["loss"])  # bitwise
        assert a["grad_norm"] == b["grad_norm"]
    assert resumed.final_loss == straight.final_loss
    acc = EventAccumulator(str(run / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("loss")] == [
        (r["step"], np.float32(r["loss"])) for r in got]
    for step in (10, 15, 20):
        state = json.loads((ckpts / str(step) / "data_iter" / "process_0-of-1.json").read_text())
        assert state == {"next_index": step}
    assert resumed.final_eval_loss == straight.final_eval_loss
    # Retention: the newest two plus multiples of keep_every; the temporary folder is gone.
    assert sorted(os.listdir(ckpts), key=int) == ["10", "15", "20"]
    assert sorted(os.listdir(tmp_path / "straight" / "checkpoints"), key=int) == ["10", "15", "20"]

    with pytest.raises(CheckpointError, match="trainer.resume=False"):
        train(config_lib.validate(run_config(run, resume=False)))


@pytest.mark.slow
def test_init_from_a_converted_hf_model(hf_cases, tmp_path, compile_cache):
    config_py = hf.hf_to_orbax(hf_cases / "base" / "hf", tmp_path / "converted")
    converted = runpy.run_path(str(config_py))["get_config"]()
    assert converted.trainer.init_from == str(tmp_path / "converted")
    assert converted.model == run_config(tmp_path).model  # config.py = the converted model
    cfg = set_trainer(converted, tmp_path / "run", hard_stop=2)

    train(config_lib.validate(cfg))
    first = records(tmp_path / "run")[0]
    t = cfg.trainer
    batch = build_data(config_lib.parse(cfg).data, t.seq_len, t.global_batch_size, t.seed, t.cache_dir).train.batch(0)
    model = hf.load_model(hf_cases / "base" / "hf")
    parts = forward_losses(
        model.graphdef, model.params, model.model_state, jnp.asarray(batch), model.config
    )
    expected = float(parts.ce_sum / parts.n_tokens)
    assert abs(first["loss"] - expected) <= 1e-5 * expected, (first["loss"], expected)
    schedule = build_optimizer(cfg.optim, t.max_steps)[1]
    assert first["lr"] == pytest.approx(float(schedule(0)))  # step 0: a fresh optimizer

    other = set_trainer(runpy.run_path(str(config_py))["get_config"](), tmp_path / "other")
    other.model.rope_theta = 500000.0
    with pytest.raises(CheckpointError, match=r"model\.rope_theta=10000\.0 but this run has"):
        train(config_lib.validate(other))
