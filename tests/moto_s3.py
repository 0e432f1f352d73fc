"""A real S3-compatible server for the tests: moto's server mode on 127.0.0.1 (a free
port), started as a child process, with its credentials and endpoint handed over the
standard way (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL)."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time

from olmo_jax import storage

KEY_ID = "AKIAOLMOJAXTESTKEY02"
SECRET = "olmoJaxBucketSecret/NeverLogged+9876543210yz"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def server(auth: bool = False):
    """Yields the endpoint URL of a fresh moto S3 server; `auth`: it checks credentials
    (none are valid: every request is denied, InvalidAccessKeyId)."""
    port = free_port()
    env = {**os.environ, **({"INITIAL_NO_AUTH_ACTION_COUNT": "0"} if auth else {})}
    with local_server([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                      port, "the moto server", env) as url:
        yield url


@contextlib.contextmanager
def local_server(cmd: list[str], port: int, name: str, env: dict | None = None):
    """Runs `cmd` (a server listening on 127.0.0.1:`port`) as a child process, yields its
    URL once the port accepts connections, and stops it at the end."""
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    try:
        for _ in range(300):
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                assert proc.poll() is None, f"{name} did not start"
                time.sleep(0.05)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@contextlib.contextmanager
def patched_environ(env: dict):
    """`env` in os.environ (the child processes inherit it), the old values back after;
    storage's cached filesystems are dropped on the way in and out."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    storage._FILESYSTEMS.clear()
    try:
        yield env
    finally:
        storage._FILESYSTEMS.clear()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def environment(endpoint: str):
    """The credentials and `endpoint` in os.environ (patched_environ)."""
    env = {"AWS_ACCESS_KEY_ID": KEY_ID, "AWS_SECRET_ACCESS_KEY": SECRET,
           "AWS_ENDPOINT_URL": endpoint, "AWS_DEFAULT_REGION": "us-east-1"}
    with patched_environ(env):
        yield env
