"""The owner lease of a run folder in a bucket: what `flock` is for a local folder.

The lease is one object, `{run_dir}/owner.lease` (JSON: the owner line "pid P on host H
since T", pid, host, a random token), created with a conditional write: of two trainers
that start together, the store lets exactly one create it. The owner renews it every
`ttl_s / 4` seconds (a heartbeat: a write conditional on the version it last wrote) and
deletes it at the end (a delete conditional on that version). The version is the ETag in
S3 (`If-None-Match: *` to create, `If-Match` after) and the generation in GCS
(`ifGenerationMatch=0` to create, `ifGenerationMatch=G` after).

A trainer that finds a lease is refused at once, naming the owner, unless the lease is
stale; it then takes it over with a write conditional on the version it read, so two
contenders cannot both take one stale lease. A lease is stale when
- it was not renewed for `ttl_s` seconds, measured on the store's clock (the object's
  last modification time against the Date of the store's reply): no clock of a trainer
  is compared with another's, so clock skew between hosts does not matter; or
- its owner ran on this machine (same host, boot and pid namespace) and its pid no longer
  exists: a run killed with kill -9 is resumed at once, as with `flock`.

What it does not guarantee: a store has no fencing. An owner paused for longer than
`ttl_s` (SIGSTOP, a swapped-out host, a network partition) loses its lease to the next
trainer without knowing; it finds out at its next heartbeat or before its next save
(`check()`, which stops the run), but writes already in flight when it wakes (an
asynchronous checkpoint save, the run files' upload) can still land. Keep `ttl_s` well
above any pause the run may take.
"""

from __future__ import annotations

import contextlib
import datetime
import email.utils
import json
import os
import socket
import threading
import time
import uuid

from olmo_jax import storage

LEASE_FILE = "owner.lease"


def _conflict(exc: BaseException) -> bool:
    """A failed precondition (If-None-Match / If-Match) of the store."""
    text = f"{exc} {exc.__cause__!r}"
    return isinstance(exc, FileExistsError) or "PreconditionFailed" in text or \
        "ConditionalRequestConflict" in text or "pre-conditions" in text


def _machine() -> str:
    """This machine and pid namespace (a pid means the same process only within it)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        return f"{boot}/{os.stat('/proc/self/ns/pid').st_ino}"
    except OSError:
        return ""


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class LeaseHeld(Exception):
    """Another trainer holds the lease; `holder` is its owner line."""

    def __init__(self, holder: str):
        super().__init__(holder)
        self.holder = holder


class LeaseLost(Exception):
    """The lease was taken over by another trainer (this one did not renew it in time)."""


class _StoreObject:
    """The lease object `url` in a bucket: its bucket and key."""

    def __init__(self, url: str):
        self.url = url
        self.bucket = storage.bucket_of(url)
        self.key = url.partition("://")[2].split("/", 1)[1]


class _S3Object(_StoreObject):
    """The lease object in an S3 bucket; its version is the ETag."""

    def _call(self, method: str, **kwargs):
        return storage.filesystem(self.url).call_s3(method, Bucket=self.bucket, Key=self.key,
                                                     **kwargs)

    def write(self, body: bytes, version: str | None) -> str:
        """Writes `body` if the object is at `version` (None: if it does not exist); the
        new version (a conflict error otherwise)."""
        cond = {"IfNoneMatch": "*"} if version is None else {"IfMatch": version}
        return self._call("put_object", Body=body, **cond)["ETag"]

    def head(self) -> tuple[str, float | None]:
        """(version, seconds since the last write on the store's clock, or None);
        FileNotFoundError when there is no lease."""
        head = self._call("head_object")
        now = head.get("ResponseMetadata", {}).get("HTTPHeaders", {}).get("date")
        age = None
        if now and head.get("LastModified") is not None:
            age = (email.utils.parsedate_to_datetime(now) - head["LastModified"]).total_seconds()
        return head["ETag"], age

    def delete(self, version: str) -> None:
        self._call("delete_object", IfMatch=version)


class _GcsObject(_StoreObject):
    """The lease object in a GCS bucket (JSON API through gcsfs); its version is the
    generation. Writes are multipart uploads, as gcsfs's own small ones are."""

    def write(self, body: bytes, version: str | None) -> str:
        fs = storage.filesystem(self.url)
        meta = json.dumps({"name": self.key}).encode()
        data = (b"--==0==\nContent-Type: application/json; charset=UTF-8\n\n" + meta +
                b"\n--==0==\nContent-Type: application/octet-stream\n\n" + body + b"\n--==0==--")
        out = fs.call("POST", f"{fs._location}/upload/storage/v1/b/{{}}/o", self.bucket,
                      uploadType="multipart", ifGenerationMatch=version or "0", data=data,
                      headers={"Content-Type": 'multipart/related; boundary="==0=="'},
                      json_out=True)
        return str(out["generation"])

    def head(self) -> tuple[str, float | None]:
        headers, content = storage.filesystem(self.url).call("GET", "b/{}/o/{}", self.bucket,
                                                             self.key)
        meta = json.loads(content)
        now, updated = headers.get("Date"), meta.get("updated")
        age = None
        if now and updated:
            written = datetime.datetime.fromisoformat(updated.replace("Z", "+00:00"))
            age = (email.utils.parsedate_to_datetime(now) - written).total_seconds()
        return str(meta["generation"]), age

    def delete(self, version: str) -> None:
        storage.filesystem(self.url).call("DELETE", "b/{}/o/{}", self.bucket, self.key,
                                          ifGenerationMatch=version)


class Lease:
    """The owner lease `{run_url}/owner.lease` (an `s3://` or `gs://` folder)."""

    def __init__(self, run_url: str, ttl_s: float):
        self.url = storage.join(run_url, LEASE_FILE)
        self._object = (_S3Object if storage.scheme(self.url) == "s3" else _GcsObject)(self.url)
        self.ttl_s = ttl_s
        self._etag: str | None = None  # the version this trainer last wrote
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.lost: str | None = None  # why the lease was lost, once it is

    def _body(self) -> bytes:
        stamp = time.strftime("%Y-%m-%d %H:%M:%S %Z")
        owner = f"pid {os.getpid()} on host {socket.gethostname()} since {stamp}"
        return json.dumps({"owner": owner, "pid": os.getpid(), "host": socket.gethostname(),
                           "machine": _machine(), "token": uuid.uuid4().hex,
                           "ttl_s": self.ttl_s}).encode()

    def acquire(self) -> None:
        """Takes the lease (LeaseHeld when a live owner has it) and starts the heartbeat."""
        body = self._body()
        try:
            self._etag = self._object.write(body, None)
        except Exception as e:
            if not _conflict(e):
                raise
            self._take_over(body)
        self._thread = threading.Thread(target=self._beat, name="olmo_jax-lease", daemon=True)
        self._thread.start()

    def _take_over(self, body: bytes) -> None:
        try:
            version, age = self._object.head()
        except FileNotFoundError:  # released meanwhile: try to create it again
            try:
                self._etag = self._object.write(body, None)
                return
            except Exception as e:
                if _conflict(e):
                    raise LeaseHeld("another trainer that started at the same moment") from e
                raise
        try:
            held = json.loads(storage.read_bytes(self.url))
        except (OSError, ValueError):
            held = {}
        holder = str(held.get("owner", "an owner whose lease cannot be read"))
        if not self._stale(age, held):
            raise LeaseHeld(holder)
        try:
            self._etag = self._object.write(body, version)
        except Exception as e:
            if _conflict(e):
                raise LeaseHeld("another trainer that took over the stale lease of "
                                f"{holder}") from e
            raise

    def _stale(self, age: float | None, held: dict) -> bool:
        if age is not None and age > self.ttl_s:  # on the store's clock
            return True
        machine = _machine()
        pid = held.get("pid")
        return bool(machine) and held.get("machine") == machine and isinstance(pid, int) \
            and not _pid_alive(pid)

    def _beat(self) -> None:
        while not self._stop.wait(self.ttl_s / 4):
            try:
                self.renew()
            except LeaseLost:
                return
            except Exception:  # the store is unreachable: try again at the next beat
                continue

    def renew(self) -> None:
        """Rewrites the lease if this trainer still holds it (LeaseLost otherwise)."""
        with self._lock:
            if self.lost:
                raise LeaseLost(self.lost)
            if self._etag is None:
                return
            try:
                self._etag = self._object.write(self._body(), self._etag)
            except Exception as e:
                if not (_conflict(e) or isinstance(e, FileNotFoundError)):
                    raise
                try:
                    holder = json.loads(storage.read_bytes(self.url)).get("owner", "?")
                except (OSError, ValueError):
                    holder = "nobody (the lease was deleted)"
                self.lost = (f"its lease {self.url} was taken over by {holder}: this trainer "
                             f"did not renew it for {self.ttl_s:g}s (trainer.lease_ttl_s)")
                raise LeaseLost(self.lost) from e

    def check(self) -> None:
        """LeaseLost when the lease is no longer this trainer's (asks the store)."""
        self.renew()

    def release(self) -> None:
        """Stops the heartbeat and deletes the lease if it is still this trainer's."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        with self._lock:
            if self._etag is not None and not self.lost:
                with contextlib.suppress(Exception):  # a lost lease stays its owner's
                    self._object.delete(self._etag)
            self._etag = None
