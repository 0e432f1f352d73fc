"""Faults injected into real training runs (configs/tiny.py on one CPU device, see
conftest.py). Each asserts the message and exit code and, by resuming, that nothing was
lost: the losses of every step are bitwise those of the uninterrupted reference run.

- kill -9 at the moment a save's temporary folder appears, then SIGTERM at the moment the
  next one appears (the relaunch also shows a killed owner leaves no stale lock), then a
  torn last line of metrics.jsonl, then the resume to the end;
- two trainers started at once on one run folder: one trains, the other is refused;
- a token file truncated in place while the run reads it;
- a full disk: a tmpfs run folder where one checkpoint fits and the second does not.
"""

import os
import shutil
import signal
import socket
import subprocess
import sys

import pytest

from tests.reliability.conftest import (
    REPO,
    child_env,
    finish,
    losses,
    one_error_line,
    run,
    start,
    temporary_saves,
    tiny_args,
    wait_for,
)


def test_kill9_and_sigterm_mid_save_and_a_torn_metrics_line(tmp_path, tokens, reference, compile_cache):
    run_dir, args = tmp_path / "run", tiny_args(tmp_path / "run", tokens)
    ckpts = run_dir / "checkpoints"

    first = start(args, compile_cache)
    wait_for(lambda: (ckpts / "2").is_dir() and any(p.startswith("4.") for p in temporary_saves(run_dir)),
             first, "the save of step 4 to start")
    first.send_signal(signal.SIGKILL)
    assert finish(first).returncode == -signal.SIGKILL
    assert temporary_saves(run_dir), "killed after the save of step 4 had finished"

    second = start(args, compile_cache)  # the killed owner's lock went with it
    wait_for(lambda: not temporary_saves(run_dir), second, "the interrupted save to be cleaned up")
    wait_for(lambda: bool(temporary_saves(run_dir)), second, "a save to start")
    assert f"pid {second.pid} on host" in (run_dir / "owner.lock").read_text()
    second.send_signal(signal.SIGTERM)
    done = finish(second)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    said = " ".join(done.stdout.split())  # (the console wraps long lines)
    assert "resumed from checkpoint step 2" in said, said[-2000:]
    assert "SIGTERM: saved a checkpoint at step" in said, said[-2000:]
    assert not temporary_saves(run_dir)

    with open(run_dir / "metrics.jsonl", "a") as f:  # a line cut short by a crash
        f.write('{"step": 5, "loss": 3.2')
    last = run(args, compile_cache)
    assert last.returncode == 0, last.stdout[-2000:] + last.stderr[-4000:]
    assert losses(run_dir) == reference[1]


def test_a_second_trainer_on_the_folder_is_refused(tmp_path, tokens, reference, compile_cache):
    run_dir = tmp_path / "run"
    args = tiny_args(run_dir, tokens)
    a, b = start(args, compile_cache), start(args, compile_cache)
    results = {a.pid: finish(a), b.pid: finish(b)}
    codes = sorted(r.returncode for r in results.values())
    assert codes == [0, 2], {pid: r.stderr[-3000:] for pid, r in results.items()}
    (owner, _), (refused_pid, refused) = sorted(results.items(), key=lambda kv: kv[1].returncode)
    line = one_error_line(refused)
    assert f"trainer.run_dir={run_dir} is in use by another trainer" in line, line
    assert f"pid {owner} on host {socket.gethostname()}" in line, line
    assert losses(run_dir) == reference[1]  # the refused one wrote and removed nothing


def test_a_token_file_truncated_during_the_run(tmp_path, tokens, reference, compile_cache):
    data = tmp_path / "tokens.npy"
    shutil.copy(tokens, data)
    run_dir = tmp_path / "run"
    args = tiny_args(run_dir, data)
    # prefetch 0: each batch is read when its step starts (a run setting, not the run's data)
    proc = start([*args, "--config.data.prefetch=0"], compile_cache)
    metrics = run_dir / "metrics.jsonl"
    wait_for(lambda: metrics.is_file() and metrics.stat().st_size > 0, proc, "step 1")
    proc.send_signal(signal.SIGSTOP)  # hold it while the file shrinks
    original = data.read_bytes()
    os.truncate(data, len(original) // 2)
    proc.send_signal(signal.SIGCONT)
    failed = finish(proc)
    assert failed.returncode == 2, failed.stderr[-4000:]  # not SIGBUS (-7)
    line = one_error_line(failed)
    assert f"token file {data} changed while the run was reading it" in line, line

    with open(data, "r+b") as f:  # put the data back; the run resumes
        f.write(original)
    resumed = run(args, compile_cache)
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-4000:]
    assert losses(run_dir) == reference[1]


def _can_mount(where) -> str | None:
    probe = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c",
                            f"mount -t tmpfs -o size=1m tmpfs {where}"],
                           capture_output=True, text=True)
    if probe.returncode:
        return f"cannot mount a tmpfs in a private mount namespace: {probe.stderr.strip()}"
    return None


def test_a_full_disk_stops_the_run_with_one_error(tmp_path, tokens, reference, compile_cache):
    mnt, kept = tmp_path / "mnt", tmp_path / "kept"
    mnt.mkdir()
    reason = _can_mount(mnt)
    if reason:
        pytest.skip(reason)
    one = sum(f.stat().st_size for f in (reference[0] / "checkpoints" / "2").rglob("*") if f.is_file())
    size_kb = int(1.5 * one) // 1024  # the first checkpoint fits, the second does not
    run_dir = mnt / "run"
    args = " ".join(tiny_args(run_dir, tokens))
    script = (f"mount -t tmpfs -o size={size_kb}k tmpfs {mnt} && cd {REPO} && "
              f"{sys.executable} -m olmo_jax.train {args}; rc=$?; cp -a {run_dir} {kept}; exit $rc")
    proc = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", script],
                          env=child_env(compile_cache), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 74, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert f"warning: trainer.run_dir={run_dir} has" in proc.stdout, proc.stdout[-2000:]
    assert "fewer than two fit" in proc.stdout, proc.stdout[-2000:]
    line = one_error_line(proc)
    for part in (f"cannot write checkpoint step 4 in trainer.run_dir={run_dir}",
                 "no space left on device", "MiB is free",
                 f"the last complete checkpoint is step 2 ({run_dir}/checkpoints/2)",
                 f"{run_dir}/errors.log"):
        assert part in line, line
    assert not temporary_saves(kept)  # the failed save's temporary folder is gone
    assert "No space left on device" in (kept / "errors.log").read_text()

    resumed = run(tiny_args(kept, tokens), compile_cache)  # the copy, elsewhere
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-4000:]
    assert "resumed from checkpoint step 2" in " ".join(resumed.stdout.split())
    assert losses(kept) == reference[1]
