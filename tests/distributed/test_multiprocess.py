"""Real multi-process runs on loopback: 2 processes x 4 CPU devices, started like
`python -m olmo_jax.train ... --coordinator 127.0.0.1:PORT --num_processes 2 --process_id I`,
with the 8 experts on an `expert` axis of 8 devices that spans both processes.

1. The first launch trains; once step 5 is logged, SIGTERM to process 1 alone stops both
   at one agreed step S with a collective checkpoint, and both exit 0.
2. A second launch resumes from S. Once it has trained a few steps, `kill -9` of process 1
   makes process 0 exit with EXIT_PEER_LOST and a message naming process 1 within
   trainer.peer_timeout_s (+ slack) instead of hanging in a collective.
3. Every step both launches logged (before and after the resume) has the loss and gradient
   norm of this process's single-process 8-device run of the same steps within 1e-5.
4. With trainer.loggers=jsonl,tensorboard, process 0 alone writes event files (one per
   launch), and they hold the steps of metrics.jsonl (the steps past the checkpoint that the
   first launch logged are dropped on resume).
"""

import os
import runpy
import signal
import time

import pytest

from olmo_jax import config as config_lib
from olmo_jax.distributed import EXIT_PEER_LOST
from olmo_jax.trainer.loop import train
from tests.distributed.launcher import CONFIG, ROOT, Run, logged_steps, wait_for_step


def checkpoint_steps(run_dir):
    return sorted(int(p) for p in os.listdir(run_dir / "checkpoints") if p.isdigit())


@pytest.mark.slow
def test_two_processes_match_one_through_preemption_resume_and_a_dead_peer(tmp_path, compile_cache):
    cache, run = compile_cache, tmp_path / "run"
    args = [f"--config.trainer.run_dir={run}", "--config.trainer.peer_timeout_s=5",
            "--config.trainer.loggers=jsonl,tensorboard"]

    first = Run(2, args, tmp_path / "logs1", cache)
    wait_for_step(run, 5, first)
    first.procs[1].send_signal(signal.SIGTERM)  # only process 1 gets the notice
    assert first.wait(120) == [0, 0], first.log(0)[-3000:] + first.log(1)[-3000:]
    saved = checkpoint_steps(run)
    assert len(saved) == 1 and saved[0] >= 5, saved
    assert f"SIGTERM: saved a checkpoint at step {saved[0]}" in first.log(0)
    assert "x 2 processes" in first.log(0) and "x 2 processes" not in first.log(1)

    second = Run(2, args, tmp_path / "logs2", cache)
    wait_for_step(run, saved[0] + 3, second)
    killed_at = time.time()
    second.procs[1].send_signal(signal.SIGKILL)
    code = second.procs[0].wait(60)
    elapsed = time.time() - killed_at
    second.kill()
    log = second.log(0)
    assert f"resumed from checkpoint step {saved[0]}" in log
    assert code == EXIT_PEER_LOST, log[-3000:]
    assert "error: lost process 1 of 2: no heartbeat for 5 s" in log, log[-3000:]
    assert "relaunch every process" in log
    assert elapsed < 5 + 15, elapsed

    records = logged_steps(run)
    last = records[-1]["step"]
    assert [r["step"] for r in records] == list(range(1, last + 1)) and last >= saved[0] + 3
    events = sorted((run / "tensorboard").glob("events.out.tfevents.*"))
    writers = [int(e.name.split(".")[-2]) for e in events]  # ...<time>.<host>.<pid>.<uid>
    assert writers == [first.procs[0].pid, second.procs[0].pid], (events, first.procs, second.procs)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    tb_steps, steps = [e.step for e in acc.Scalars("loss")], [r["step"] for r in records]
    assert tb_steps in (steps, steps[:-1]), tb_steps  # process 0 may die before flushing the last
    cfg = runpy.run_path(str(ROOT / CONFIG))["get_config"]()
    cfg.trainer.run_dir, cfg.trainer.hard_stop = str(tmp_path / "reference"), last
    train(config_lib.validate(cfg))  # one process, 8 devices, uninterrupted
    reference = logged_steps(tmp_path / "reference")
    for got, ref in zip(records, reference, strict=True):
        for key in ("loss", "grad_norm"):
            assert abs(got[key] - ref[key]) <= 1e-5, (got["step"], key, got[key], ref[key])
