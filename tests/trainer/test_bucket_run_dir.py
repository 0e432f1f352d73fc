"""A run folder in an S3 bucket (trainer.run_dir=s3://...), against a real S3-compatible
server: moto's, on 127.0.0.1 (tests/moto_s3.py), with the credentials and the endpoint in
the environment.

1. Kill and resume (one shared run): a child process trains into the bucket and is killed
   with SIGKILL when the save of step 4 has written everything but its commit marker. The
   bucket then holds checkpoint 2 (complete) and an incomplete step 4 that every reader
   ignores. While the child is alive, a second trainer (the CLI) is refused with exit 2,
   naming the owner's pid and host and the lease object. The resumed run takes the dead
   child's lease over at once, continues from step 2 and logs every step's loss and grad
   norm bitwise equal to a run on local disk that was never interrupted, each step once.
2. The folder holds what a local one holds (config, metrics, errors log, mesh, checkpoints
   with commit markers); no credential is in any object, the local copy or the output.
3. init_from and convert read the bucket's checkpoints: the same weights as the local run;
   the report reads the bucket's run files and uploads its page there.
4. The lease on its own: a second owner is refused, a silent one's lease expires (on the
   store's clock) and is taken over, the paused owner then finds it lost; a dead owner on
   this machine is replaced at once.
5. A missing bucket and denied access are one ConfigError naming the path.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("s3fs")
pytest.importorskip("moto")

from rich.console import Console  # noqa: E402

from olmo_jax import config as config_lib  # noqa: E402
from olmo_jax import storage  # noqa: E402
from olmo_jax.checkpoint import manager as m  # noqa: E402
from olmo_jax.checkpoint.object_store import COMMIT_MARKER  # noqa: E402
from olmo_jax.errors import ConfigError  # noqa: E402
from olmo_jax.trainer.lease import Lease, LeaseHeld, LeaseLost  # noqa: E402
from olmo_jax.trainer.loop import train  # noqa: E402
from tests import moto_s3  # noqa: E402
from tests.conftest import compile_cache_env  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
CHILD = ROOT / "tests" / "checkpoint" / "kill_child.py"
BUCKET = "runs-bkt"
RUN = f"s3://{BUCKET}/team/run1"
STEPS = 6


def run_config(run_dir: str, cache: Path):
    cfg = config_lib.default_config()
    mc = cfg.model
    mc.d_model, mc.n_layers, mc.n_heads, mc.n_dense_layers = 32, 2, 2, 1
    mc.moe.num_experts, mc.moe.top_k, mc.moe.expert_hidden = 4, 2, 32
    cfg.optim.lr, cfg.optim.warmup_steps = 1e-2, 2
    t = cfg.trainer
    t.run_dir, t.cache_dir = run_dir, str(cache)
    t.max_steps, t.log_every, t.eval_every, t.sample_tokens = STEPS, 1, 0, 0
    t.global_batch_size, t.seq_len = 8, 16
    t.save_every, t.keep_last = 2, 0
    cfg.data.eval_fraction = 0.0
    return cfg


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def s3():
    with moto_s3.server() as endpoint, moto_s3.environment(endpoint):
        storage.filesystem("s3://").mkdir(BUCKET)
        yield endpoint


@pytest.fixture(scope="module")
def runs(s3, tmp_path_factory, compile_cache):
    """The straight local run, and the bucket run killed mid-save and resumed."""
    tmp = tmp_path_factory.mktemp("bucket_runs")
    cache = tmp / "cache"
    straight = train(config_lib.validate(run_config(str(tmp / "straight"), cache)),
                     console=Console(quiet=True))
    out = {"straight": (straight, records(tmp / "straight" / "metrics.jsonl")), "tmp": tmp}

    config_json, marker, log_path = tmp / "child.json", tmp / "saving", tmp / "child.log"
    config_json.write_text(run_config(RUN, cache).to_json())
    env = {**os.environ, "PYTHONPATH": str(ROOT), **compile_cache_env(compile_cache)}
    with open(log_path, "w") as log:
        child = subprocess.Popen([sys.executable, str(CHILD), str(config_json), "4", str(marker)],
                                 cwd=tmp, env=env, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.time() + 300
    while not marker.exists():
        assert child.poll() is None, log_path.read_text()[-4000:]
        assert time.time() < deadline, "the child never reached the save of step 4"
        time.sleep(0.05)
    # A second trainer on the folder while the child owns it: refused at once, exit 2.
    cli = subprocess.run(
        [sys.executable, "-m", "olmo_jax.train", "--config=configs/tiny.py",
         f"--config.trainer.run_dir={RUN}", f"--config.trainer.cache_dir={cache}"],
        cwd=ROOT, env={**env, "XLA_FLAGS": "--xla_force_host_platform_device_count=1"},
        capture_output=True, text=True, timeout=300)
    out["refused"] = (cli, child.pid)
    child.send_signal(signal.SIGKILL)
    child.wait()
    out["child_log"] = log_path.read_text()
    with m.Checkpoints(f"{RUN}/checkpoints", read_only=True) as ckpts:
        out["after_kill"] = (ckpts.latest_step(), ckpts.complete_steps_on_disk(),
                             storage.exists(f"{RUN}/checkpoints/4/model"))
    console = Console(record=True, width=300)
    out["resumed"] = train(config_lib.validate(run_config(RUN, cache)), console=console)
    out["console"] = console.export_text()
    return out


def test_killed_run_resumes_bitwise_from_the_bucket(runs):
    latest, complete, step4_written = runs["after_kill"]
    assert latest == 2 and complete == [2] and step4_written  # 4 lacks only its marker
    assert "resumed from checkpoint step 2 in s3://runs-bkt/team/run1/checkpoints" in runs["console"]
    fs = storage.filesystem(RUN)
    got = [json.loads(line) for line in fs.cat_file(f"{RUN}/metrics.jsonl").decode().splitlines()]
    straight_summary, straight = runs["straight"]
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))  # each step once
    for a, b in zip(straight, got, strict=True):
        assert (a["loss"], a["grad_norm"]) == (b["loss"], b["grad_norm"]), a["step"]  # bitwise
    assert runs["resumed"].final_loss == straight_summary.final_loss
    assert runs["resumed"].metrics_path == f"{RUN}/metrics.jsonl"
    with m.Checkpoints(f"{RUN}/checkpoints", read_only=True) as ckpts:
        assert ckpts.all_steps() == [2, 4, 6]
        for step in (2, 4, 6):
            assert fs.isfile(f"{RUN}/checkpoints/{step}/{COMMIT_MARKER}")
            assert ckpts.read_iterator_state(step) == {"next_index": step}


def test_a_second_trainer_is_refused_while_the_owner_lives(runs):
    cli, pid = runs["refused"]
    assert cli.returncode == 2, cli.stderr[-3000:]
    line = cli.stderr.strip().splitlines()[-1]
    assert line.startswith(f"error: trainer.run_dir={RUN} is in use by another trainer (pid {pid} "
                           f"on host "), line
    assert line.endswith(f"; {RUN}/owner.lease): wait for it to end or stop it, or choose another "
                         "trainer.run_dir"), line
    assert "Traceback" not in cli.stderr
    assert not storage.exists(f"{RUN}/owner.lease")  # the resumed run gave its lease back


def test_the_bucket_holds_the_run_folder_and_no_credentials(runs):
    fs = storage.filesystem(RUN)
    keys = [k.split("/team/run1/", 1)[1] for k in fs.find(f"{BUCKET}/team/run1")]
    local = runs["tmp"] / "straight"
    held = {p.relative_to(local).as_posix() for p in local.rglob("*") if p.is_file()}
    run_files = {k for k in held if not k.startswith("checkpoints/")} - {"owner.lock"}
    assert {"config.json", "metrics.jsonl", "mesh.json"} <= run_files
    assert run_files <= set(keys), run_files - set(keys)  # what a local run folder holds
    assert {k.split("/")[1] for k in keys if k.startswith("checkpoints/")} == {"2", "4", "6"}
    assert json.loads(fs.cat_file(f"{RUN}/config.json"))["trainer"]["run_dir"] == RUN
    texts = [runs["console"], runs["child_log"], runs["refused"][0].stdout, runs["refused"][0].stderr]
    for secret in (moto_s3.KEY_ID, moto_s3.SECRET):
        for k in fs.find(f"{BUCKET}/team/run1"):
            assert secret.encode() not in fs.cat_file(k), k
        for path in (runs["tmp"] / "cache").rglob("*"):
            if path.is_file():
                assert secret.encode() not in path.read_bytes(), path
        for text in texts:
            assert secret not in text


def test_the_report_reads_the_bucket(runs):
    """python -m olmo_jax.report on the bucket's run folder: the page goes next to it."""
    done = subprocess.run([sys.executable, "-m", "olmo_jax.report", RUN], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == f"{RUN}/report.html"
    html = storage.read_text(f"{RUN}/report.html")
    assert "<html" in html.lower() and str(runs["straight"][1][-1]["loss"]) in html
    assert moto_s3.SECRET not in html + done.stdout + done.stderr


def final_params(where, steps: int) -> dict:
    """The weights of a run folder's last checkpoint (step `steps`), found as
    trainer.init_from finds them, on one device."""
    import jax

    ckpts, step = m.resolve(where)
    with ckpts:
        assert step == steps
        names = ckpts.array_metadata(step, m.MODEL)
        sh = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        target = {n: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=sh) for n, v in names.items()}
        return ckpts.restore_arrays(step, m.MODEL, target)


def assert_same_weights(local_run, bucket_run, steps: int) -> None:
    local, bucket = final_params(local_run, steps), final_params(bucket_run, steps)
    assert local.keys() == bucket.keys()
    for name in local:
        np.testing.assert_array_equal(np.asarray(local[name]), np.asarray(bucket[name]), err_msg=name)


def assert_same_export(local_run, bucket_run, out: str, local_out: Path) -> None:
    """`convert orbax-to-olmo3moe` of the bucket's run into `out` (a bucket folder) writes
    the bytes it writes from the local run into `local_out`."""
    from olmo_jax import convert

    assert convert.main(["orbax-to-olmo3moe", "--ckpt", bucket_run, "--out", out]) == 0
    assert convert.main(["orbax-to-olmo3moe", "--ckpt", str(local_run), "--out", str(local_out)]) == 0
    tensors = [f for f in local_out.iterdir() if f.suffix == ".safetensors"]
    assert tensors
    for f in tensors:
        assert storage.read_bytes(f"{out}/{f.name}") == f.read_bytes(), f.name


def test_init_from_and_convert_read_the_bucket(runs, tmp_path):
    assert_same_weights(runs["tmp"] / "straight", RUN, STEPS)
    assert_same_export(runs["tmp"] / "straight", RUN, f"s3://{BUCKET}/exports/olmo3moe", tmp_path / "hf")


def test_the_lease_on_its_own(s3):
    url = f"s3://{BUCKET}/lease-test"
    a = Lease(url, ttl_s=2.0)
    a.acquire()
    with pytest.raises(LeaseHeld, match=rf"pid {os.getpid()} on host "):
        Lease(url, ttl_s=2.0).acquire()
    a._stop.set()  # a paused owner: no heartbeat
    a._thread.join()
    time.sleep(3.5)  # > ttl on the store's clock (Last-Modified has one-second resolution)
    b = Lease(url, ttl_s=2.0)
    b.acquire()  # stale: taken over
    with pytest.raises(LeaseLost, match=r"taken over by pid"):
        a.check()
    a.release()  # a lost lease is left to its new owner
    assert storage.exists(f"{url}/owner.lease")
    b.release()
    assert not storage.exists(f"{url}/owner.lease")
    # an owner on this machine whose process is gone: replaced at once
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    c = Lease(url, ttl_s=600.0)
    body = json.loads(c._body())
    storage.write_bytes(f"{url}/owner.lease", json.dumps({**body, "pid": dead.pid}).encode())
    c.acquire()
    c.release()


def test_missing_bucket_and_denied_access_name_the_path(s3, tmp_path):
    cfg = run_config("s3://no-such-bkt/run", tmp_path / "cache")
    with pytest.raises(ConfigError, match=r"trainer\.run_dir: writing s3://no-such-bkt/run: the "
                                          r"bucket 'no-such-bkt' does not exist"):
        train(config_lib.validate(cfg))
    with moto_s3.server(auth=True) as endpoint, moto_s3.environment(endpoint):
        with pytest.raises(ConfigError, match=rf"trainer\.run_dir: writing {RUN}: access to bucket "
                                              rf"'{BUCKET}' is denied") as e:
            train(config_lib.validate(run_config(RUN, tmp_path / "cache")))
        assert moto_s3.SECRET not in str(e.value) and moto_s3.KEY_ID not in str(e.value)
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").rglob("*.json"))


def test_a_lost_lease_stops_the_run_and_a_refused_launch_leaves_nothing(s3, tmp_path):
    from olmo_jax.errors import StorageError
    from olmo_jax.trainer.run_dir import RunFolder

    url = f"s3://{BUCKET}/folder-test"
    cfg = config_lib.validate(run_config(url, tmp_path / "cache"))
    folder = RunFolder(cfg, main=True)
    (folder.path / "metrics.jsonl").write_text('{"step": 1}\n')
    folder.on_save(1)  # the owner: the run's files reach the bucket before the save
    assert storage.read_text(f"{url}/metrics.jsonl") == '{"step": 1}\n'
    storage.write_text(f"{url}/owner.lease", json.dumps({"owner": "pid 7 on host elsewhere"}))
    with pytest.raises(StorageError, match=rf"trainer\.run_dir={url}: its lease {url}/owner\.lease "
                                           r"was taken over by pid 7 on host elsewhere.*before "
                                           r"saving step 2"):
        folder.on_save(2)
    folder.release()
    assert json.loads(storage.read_text(f"{url}/owner.lease"))["owner"] == "pid 7 on host elsewhere"
    storage.filesystem(url).rm(f"{url}/owner.lease")
    # a launch refused for a different config: the lease goes, the bucket is as it was
    storage.write_text(f"{url}/config.json", json.dumps({"trainer": {"seed": 99}}))
    before = sorted(storage.filesystem(url).find(url))
    with pytest.raises(ConfigError, match=r"holds a run with a different config"):
        RunFolder(cfg, main=True)
    assert sorted(storage.filesystem(url).find(url)) == before
    assert not folder.path.exists()


def test_other_processes_never_read_their_local_copy(s3, tmp_path, monkeypatch):
    """A multi-process run (tests/distributed/test_bucket_multiprocess.py) on a bucket run
    folder: only process 0 judges the folder's config, by the bucket's files. Another
    process's local folder may hold another run's config.json (a stale cache; on one host,
    process 0's copy being replaced): it is not read, so the processes cannot disagree.
    Process 0's copy is replaced whole even when another process makes the folder while
    it is being replaced."""
    from olmo_jax.trainer import mirror
    from olmo_jax.trainer.run_dir import RunFolder

    url = f"s3://{BUCKET}/stale-copy"
    cfg = config_lib.validate(run_config(url, tmp_path / "cache"))
    local = mirror.local_copy(cfg.trainer.cache_dir, url)
    local.mkdir(parents=True)
    (local / "config.json").write_text(json.dumps({"trainer": {"seed": 99}}))
    other = RunFolder(cfg, main=False)  # the bucket holds no config: nothing to refuse
    other.release()
    rmtree = mirror.shutil.rmtree

    def rmtree_then_another_process_mkdirs(path, *args, **kwargs):
        rmtree(path, *args, **kwargs)
        path.mkdir()

    monkeypatch.setattr(mirror.shutil, "rmtree", rmtree_then_another_process_mkdirs)
    owner = RunFolder(cfg, main=True)  # the copy becomes the bucket's (empty) folder
    assert not (local / "config.json").exists()
    owner.release()
