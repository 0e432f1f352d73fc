"""Object-store paths (`s3://bucket/key`, `gs://bucket/key`) beside local ones, through
fsspec (`s3fs`, `gcsfs`: the `cloud` extra).

Credentials and the endpoint come from the environment, the standard way: for S3,
`AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY` (or a profile) and `AWS_ENDPOINT_URL` (or
`AWS_ENDPOINT_URL_S3`) for an S3-compatible server; for GCS, Application Default
Credentials (`GOOGLE_APPLICATION_CREDENTIALS`, `gcloud auth application-default login`, or
the metadata server of a Google Cloud machine) and `STORAGE_EMULATOR_HOST` for a
GCS-compatible server (`gcs_setup`). Nothing here logs or stores them.

- `is_remote`, `join`, `exists`, `is_file`, `size`, `glob`, `read_bytes` / `read_text`,
  `write_bytes` / `write_text`, `append_text`, `makedirs`: one call for either kind of path.
- `RangeCache`: byte ranges of remote files in fixed blocks, least recently used first out,
  bounded in bytes; `data.remote_cache_mb` sizes the token files' one (data/token_file.py
  `RemoteTokenFile` reads through it: a token file is never downloaded whole).
- `storage_error`: one message naming the path for a missing bucket or object, denied
  access, or an unreachable endpoint.
- `gcs_setup`: fsspec's `gs://` filesystem for this process (listings never cached; plain
  gcsfs against a GCS-compatible server), for `filesystem` and for orbax's `epath` alike.
"""

from __future__ import annotations

import collections
import os
import threading
from pathlib import Path

REMOTE_PROTOCOLS = {"s3": "s3", "gs": "gcs", "gcs": "gcs"}  # URL scheme -> fsspec protocol
_FILESYSTEMS: dict[str, object] = {}
_FS_LOCK = threading.Lock()
EMULATOR_ENV = "STORAGE_EMULATOR_HOST"  # a GCS-compatible server (host:port or a URL)


def scheme(path: str | Path) -> str:
    """'s3' / 'gs' / 'gcs' for an object-store URL, '' for a local path."""
    text = str(path)
    head, sep, _ = text.partition("://")
    return head if sep and head in REMOTE_PROTOCOLS else ""


def is_remote(path: str | Path) -> bool:
    return bool(scheme(path))


def bucket_of(path: str) -> str:
    return str(path).partition("://")[2].split("/", 1)[0]


def join(base: str | Path, *parts: str) -> str:
    """`base/part/...`: os.path.join for local paths, '/' for URLs."""
    if not is_remote(base):
        return os.path.join(os.path.expanduser(str(base)), *parts)
    return "/".join([str(base).rstrip("/"), *(p.strip("/") for p in parts)])


def filesystem(path: str | Path):
    """The fsspec filesystem of a URL, one per protocol and process (built lazily: s3fs
    and gcsfs are imported only when an object-store path is used)."""
    protocol = REMOTE_PROTOCOLS[scheme(path)]
    with _FS_LOCK:
        if protocol not in _FILESYSTEMS:
            try:
                import fsspec
                if protocol == "s3":
                    import s3fs  # noqa: F401 (registers the protocol; a clear error if absent)
                else:
                    import gcsfs  # noqa: F401
                    gcs_setup()
            except ImportError as e:
                raise OSError(
                    f"{path}: reading {scheme(path)}:// paths needs "
                    f"{'s3fs' if protocol == 's3' else 'gcsfs'}; install olmo_jax's cloud extra "
                    "(pip install -e '.[cloud]')") from e
            # run folders change under a reader (other processes write them): list afresh
            kwargs: dict = {"use_listings_cache": False}
            if protocol == "s3":
                endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
                if endpoint:
                    kwargs["endpoint_url"] = endpoint
            # A fresh instance (not fsspec's cached one): safe after fork and in threads.
            _FILESYSTEMS[protocol] = fsspec.filesystem(protocol, skip_instance_cache=True,
                                                       **kwargs)
        return _FILESYSTEMS[protocol]


def emulator_url() -> str:
    """The URL of the GCS-compatible server `STORAGE_EMULATOR_HOST` names ('' for GCS)."""
    host = os.environ.get(EMULATOR_ENV, "")
    if host in ("", "default"):
        return ""
    return host if host.startswith(("http://", "https://")) else f"http://{host}"


def gcs_setup() -> None:
    """fsspec's `gs://` / `gcs://` filesystem for this process, whoever builds it (here or
    orbax's epath): its listings are never cached (other processes write the same run
    folders). Against a GCS-compatible server (`STORAGE_EMULATOR_HOST`) it is gcsfs's plain
    `GCSFileSystem`: the default one first asks Google's storage-control API (gRPC, no
    emulator has it) whether a bucket is zonal, and waits 60 s for the answer, on every
    call."""
    import fsspec

    for protocol in ("gs", "gcs"):
        fsspec.config.conf.setdefault(protocol, {})["use_listings_cache"] = False
    if emulator_url():
        from gcsfs.core import GCSFileSystem

        for protocol in ("gs", "gcs"):
            fsspec.register_implementation(protocol, GCSFileSystem, clobber=True)


def storage_error(path: str | Path, exc: BaseException, doing: str = "reading") -> str:
    """One line naming `path` and what went wrong (never the credentials)."""
    path = str(path)
    if not is_remote(path):
        return f"{doing} {path}: {exc}"
    bucket = bucket_of(path)
    text = f"{type(exc).__name__}: {exc}"
    if isinstance(exc, PermissionError) or "AccessDenied" in text or "Forbidden" in text \
            or "InvalidAccessKeyId" in text or "SignatureDoesNotMatch" in text:
        why = (f"access to bucket {bucket!r} is denied; check the credentials in the "
               "environment (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, or GCS's default "
               "credentials) and the bucket's permissions")
    elif "NoSuchBucket" in text or "bucket does not exist" in text.lower():
        why = f"the bucket {bucket!r} does not exist; fix the path or create the bucket"
    elif isinstance(exc, FileNotFoundError):
        why = (f"no such object (or the bucket {bucket!r} does not exist); fix the path or "
               "the bucket")
    elif isinstance(exc, (ConnectionError, TimeoutError)) or "Could not connect" in text \
            or "EndpointConnectionError" in text:
        why = ("the object store cannot be reached; check AWS_ENDPOINT_URL / "
               "STORAGE_EMULATOR_HOST / the network")
    else:
        why = text
    return f"{doing} {path}: {why}"


def _bucket_missing(path: str) -> bool:
    """True when the bucket of `path` does not exist (a missing key in an existing bucket
    is not that; nor is a bucket this process may not list: the operation itself then says
    whether access is denied)."""
    try:
        if scheme(path) == "s3":  # s3fs's exists() says False for denied access too
            filesystem(path).call_s3("head_bucket", Bucket=bucket_of(path))
            return False
        return not filesystem(path).exists(f"{scheme(path)}://{bucket_of(path)}")
    except FileNotFoundError:
        return scheme(path) == "s3"
    except PermissionError:
        return False


def _bucket_filesystem(path: str):
    """The filesystem of remote `path`, whose bucket must exist (FileNotFoundError names a
    missing one, storage_error's NoSuchBucket)."""
    if _bucket_missing(path):
        raise FileNotFoundError(f"NoSuchBucket: {bucket_of(path)}")
    return filesystem(path)


def exists(path: str | Path) -> bool:
    if not is_remote(path):
        return Path(path).expanduser().exists()
    return bool(_bucket_filesystem(str(path)).exists(str(path)))


def is_file(path: str | Path) -> bool:
    if not is_remote(path):
        return Path(path).expanduser().is_file()
    return bool(_bucket_filesystem(str(path)).isfile(str(path)))


def size(path: str | Path) -> int:
    if not is_remote(path):
        return Path(path).expanduser().stat().st_size
    return int(filesystem(path).size(str(path)))


def glob(pattern: str) -> list[str]:
    """The files matching `pattern` in a bucket (`*` within a part, `**` across parts),
    sorted, as full URLs."""
    fs = filesystem(pattern)
    prefix = f"{scheme(pattern)}://"
    return sorted(prefix + p if not p.startswith(prefix) else p
                  for p in fs.glob(pattern) if fs.isfile(prefix + p.removeprefix(prefix)))


def read_bytes(path: str | Path, start: int | None = None, end: int | None = None) -> bytes:
    """Bytes [start, end) of a file (all of it by default)."""
    if not is_remote(path):
        with open(Path(path).expanduser(), "rb") as f:
            if start:
                f.seek(start)
            return f.read() if end is None else f.read(end - (start or 0))
    return filesystem(path).cat_file(str(path), start=start, end=end)


def read_text(path: str | Path) -> str:
    return read_bytes(path).decode("utf-8")


def write_bytes(path: str | Path, data: bytes) -> None:
    """Writes `data` as the whole file (an object PUT in a bucket, which is atomic)."""
    if not is_remote(path):
        Path(path).expanduser().write_bytes(data)
        return
    with filesystem(path).open(str(path), "wb") as f:
        f.write(data)


def write_text(path: str | Path, text: str) -> None:
    write_bytes(path, text.encode("utf-8"))


def makedirs(path: str | Path) -> None:
    """A local folder (and its parents); nothing for a bucket prefix (objects make their
    own), but the bucket must exist."""
    if not is_remote(path):
        Path(path).expanduser().mkdir(parents=True, exist_ok=True)
    elif _bucket_missing(str(path)):
        raise FileNotFoundError(f"NoSuchBucket: {bucket_of(str(path))}")


class RangeCache:
    """Fixed-size blocks of remote files, read by byte range, least recently used evicted
    past `max_bytes` (at least one block is kept). Thread-safe; `fetched_bytes` counts the
    bytes read from the store. The loader makes a block one instance's tokens (seq_len x
    the token size), so a window is one block, or two for data.instances='plus_one'."""

    def __init__(self, max_bytes: int, block_bytes: int = 1 << 20):
        if block_bytes < 1:
            raise ValueError(f"block_bytes={block_bytes} must be >= 1")
        self.max_bytes = max_bytes
        self.block_bytes = block_bytes
        self._blocks: collections.OrderedDict[tuple[str, int], bytes] = collections.OrderedDict()
        self._held = 0
        self._lock = threading.Lock()
        self.fetched_bytes = 0

    @property
    def held_bytes(self) -> int:
        return self._held

    def read(self, path: str, start: int, end: int, file_bytes: int) -> bytes:
        """Bytes [start, end) of `path` (a file of `file_bytes` bytes)."""
        if end <= start:
            return b""
        first, last = start // self.block_bytes, (end - 1) // self.block_bytes
        parts = [self._block(path, b, file_bytes) for b in range(first, last + 1)]
        joined = b"".join(parts) if len(parts) > 1 else parts[0]
        offset = start - first * self.block_bytes
        return joined[offset:offset + end - start]

    def prefetch(self, path: str, spans: list[tuple[int, int]], file_bytes: int) -> None:
        """Reads the blocks of byte ranges `spans` of `path` that are not held, all in one
        concurrent request batch (fsspec's `cat_ranges`): a batch's windows cost one round
        trip, not one each."""
        with self._lock:
            wanted = sorted({b for start, end in spans if end > start
                             for b in range(start // self.block_bytes,
                                            (end - 1) // self.block_bytes + 1)
                             if (path, b) not in self._blocks})
        if not wanted:
            return
        starts = [b * self.block_bytes for b in wanted]
        ends = [min(s + self.block_bytes, file_bytes) for s in starts]
        if is_remote(path):
            got = filesystem(path).cat_ranges([path] * len(wanted), starts, ends,
                                              on_error="raise")
        else:
            got = [read_bytes(path, s, e) for s, e in zip(starts, ends, strict=True)]
        with self._lock:
            for index, data in zip(wanted, got, strict=True):
                self.fetched_bytes += len(data)
                if (path, index) not in self._blocks:
                    self._blocks[(path, index)] = data
                    self._held += len(data)
            while self._held > self.max_bytes and len(self._blocks) > 1:
                _, dropped = self._blocks.popitem(last=False)
                self._held -= len(dropped)

    def _block(self, path: str, index: int, file_bytes: int) -> bytes:
        key = (path, index)
        with self._lock:
            if key in self._blocks:
                self._blocks.move_to_end(key)
                return self._blocks[key]
        lo = index * self.block_bytes
        data = read_bytes(path, lo, min(lo + self.block_bytes, file_bytes))
        with self._lock:
            self.fetched_bytes += len(data)
            if key not in self._blocks:
                self._blocks[key] = data
                self._held += len(data)
            while self._held > self.max_bytes and len(self._blocks) > 1:
                _, dropped = self._blocks.popitem(last=False)
                self._held -= len(dropped)
        return data


def download_tree(url: str, local_dir: str | Path) -> None:
    """Copies the files under `url` (a bucket prefix, or one file) into `local_dir`."""
    fs = filesystem(url)
    root = str(url).rstrip("/")
    prefix = f"{scheme(url)}://"
    if _bucket_missing(root):
        raise FileNotFoundError(f"NoSuchBucket: {bucket_of(root)}")
    found = [prefix + p.removeprefix(prefix) for p in fs.find(root)]
    if not found:
        raise FileNotFoundError(f"no objects under {url}")
    for src in found:
        rel = src[len(root):].lstrip("/") or os.path.basename(root)
        dst = Path(local_dir) / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        fs.get_file(src, str(dst))


def upload_tree(local_dir: str | Path, url: str) -> None:
    """Copies every file under `local_dir` to the prefix `url` (same relative paths)."""
    fs = filesystem(url)
    if _bucket_missing(str(url)):
        raise FileNotFoundError(f"NoSuchBucket: {bucket_of(str(url))}")
    for src in sorted(Path(local_dir).rglob("*")):
        if src.is_file():
            fs.put_file(str(src), join(url, str(src.relative_to(local_dir))))
