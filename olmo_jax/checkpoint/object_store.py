"""orbax checkpoints in `s3://` and `gs://` buckets, written and read by tensorstore's own
`s3` and `gcs` kvstores.

orbax 0.12 gives tensorstore a `gcs` kvstore for `gs://` folders and a `file` one for
everything else, so an `s3://` folder would become a local path named "s3:". `install()`
wraps orbax's one spec builder (`tensorstore_utils.build_kvstore_tspec`, which every array,
OCDBT and JSON write and read goes through) so that an `s3://bucket/key` folder gets
tensorstore's `s3` driver:

- the endpoint from `AWS_ENDPOINT_URL_S3` or `AWS_ENDPOINT_URL` (an S3-compatible server),
  the region from `AWS_REGION` / `AWS_DEFAULT_REGION`;
- the credentials from the environment (`AWS_ACCESS_KEY_ID` / `AWS_SECRET_ACCESS_KEY`)
  when they are set there, otherwise tensorstore's default chain (profile, instance
  role). They are never put into a spec, so they never reach orbax's logs or metadata.

Folders, listings and small files (orbax's `epath`) go through fsspec's `s3fs`, with the
same environment (olmo_jax/storage.py), its listings never cached (`install()` sets
fsspec's s3 default `use_listings_cache=False`: other processes write the same folders).

A `gs://` folder keeps orbax's own `gcs` spec, whose credentials are Application Default
Credentials (read by tensorstore, never put into a spec). A GCS-compatible server named by
`STORAGE_EMULATOR_HOST` (what gcsfs and Google's client libraries read) is handed to
tensorstore as `TENSORSTORE_GCS_HTTP_URL` (its `gcs` spec has no endpoint field), unless
that is set already; folders and small files go through gcsfs (`storage.gcs_setup`).

Completeness: an object store has no atomic rename, so a step is written in place and is
complete only once its commit marker (`commit_success.txt`, orbax's COMMIT_FILE
atomicity, `atomicity_options()`) exists; a step folder without it is an interrupted save
that readers ignore and the next save of that step deletes.
"""

from __future__ import annotations

import contextlib
import os
import threading

from olmo_jax import storage

COMMIT_MARKER = "commit_success.txt"
_SENTINEL = "/olmo_jax-object-store"  # a local-looking root orbax builds its spec for
_LOCK = threading.Lock()
_INSTALLED: list = []  # the wrapped builder's original, once installed
TS_GCS_URL_ENV = "TENSORSTORE_GCS_HTTP_URL"
_TS_GCS_URL: list = [None]  # the value install() last gave it


def s3_kvstore(bucket: str, key: str) -> dict:
    """tensorstore's `s3` kvstore spec of `s3://bucket/key` (no credentials in it)."""
    spec: dict = {"driver": "s3", "bucket": bucket, "path": key}
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    if endpoint:
        spec["endpoint"] = endpoint
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    if region:
        spec["aws_region"] = region
    if os.environ.get("AWS_ACCESS_KEY_ID") and os.environ.get("AWS_SECRET_ACCESS_KEY"):
        spec["aws_credentials"] = {"type": "environment"}  # read there by tensorstore
    return spec


def _gcs_endpoint() -> None:
    """TENSORSTORE_GCS_HTTP_URL (read by tensorstore whenever it opens a gcs kvstore) is the
    server STORAGE_EMULATOR_HOST names now; one the user set is left alone."""
    current, endpoint = os.environ.get(TS_GCS_URL_ENV), storage.emulator_url()
    if current is not None and current != _TS_GCS_URL[0]:
        return  # the user's own
    if endpoint:
        os.environ[TS_GCS_URL_ENV] = _TS_GCS_URL[0] = endpoint
    elif current is not None:
        del os.environ[TS_GCS_URL_ENV]
        _TS_GCS_URL[0] = None


def _to_sentinel(url: str) -> str:
    return f"{_SENTINEL}/{url.partition('://')[2].rstrip('/')}"


def _swap(spec):
    """`spec` with each `file` kvstore under the sentinel root replaced by the `s3` one of
    the same bucket and key (orbax's file-only options, e.g. its locking mode, dropped)."""
    if isinstance(spec, list):
        return [_swap(s) for s in spec]
    if not isinstance(spec, dict):
        return spec
    path = spec.get("path")
    if spec.get("driver") == "file" and isinstance(path, str) and path.startswith(_SENTINEL + "/"):
        bucket, _, key = path[len(_SENTINEL) + 1:].partition("/")
        return s3_kvstore(bucket, key)
    return {k: _swap(v) for k, v in spec.items()}


def install() -> None:
    """Makes orbax's tensorstore specs of `s3://` folders use the `s3` driver, and points
    tensorstore's `gcs` driver and epath's gcsfs at a GCS-compatible server when
    `STORAGE_EMULATOR_HOST` names one (idempotent; other folders are untouched)."""
    import fsspec
    from orbax.checkpoint._src.serialization import tensorstore_utils as ts_utils

    with _LOCK:
        _gcs_endpoint()
        if _INSTALLED:
            return
        with contextlib.suppress(ImportError):  # gcsfs: the cloud extra
            storage.gcs_setup()
        # epath's s3fs instance lists afresh: other processes write the same folders
        fsspec.config.conf.setdefault("s3", {})["use_listings_cache"] = False
        original = ts_utils.build_kvstore_tspec

        def build_kvstore_tspec(directory, name=None, **kwargs):
            text = str(directory)
            if storage.scheme(text) != "s3":
                return original(directory, name, **kwargs)
            return _swap(original(_to_sentinel(text), name, **kwargs))

        build_kvstore_tspec.__doc__ = original.__doc__
        ts_utils.build_kvstore_tspec = build_kvstore_tspec
        _INSTALLED.append(original)


def atomicity_options():
    """orbax's COMMIT_FILE atomicity: a step is complete when its commit marker exists."""
    import orbax.checkpoint as ocp

    return ocp.options.AtomicityOptions(mode=ocp.options.AtomicityMode.COMMIT_FILE)
