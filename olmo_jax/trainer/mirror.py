"""The local working copy of a run folder kept in a bucket (trainer.run_dir=s3://... or gs://...).

Checkpoints go to the bucket directly (orbax, checkpoint/object_store.py). The run's other
files (config.json, metrics.jsonl, expert_counts.jsonl, errors.log, mesh.json, the
mixture's outcome, TensorBoard events, profiles) are appended to line by line, which an
object store cannot do, so the trainer writes them in a local folder and this module
copies them to the bucket:

- `pull()` at start: the local copy becomes the bucket's files (all but `checkpoints/`
  and the lease), so a resumed run continues the metrics the bucket holds;
- `sync()` uploads the files that changed since the last upload: before every checkpoint
  save (so the bucket's metrics reach at least the step of its newest checkpoint, and a
  resume after kill -9 loses nothing), every `every_s` seconds from a background thread,
  and at the end. A file deleted locally is not deleted in the bucket.

The copy lives in `{trainer.cache_dir}/run_dirs/{scheme}/{bucket}/{key}`.
"""

from __future__ import annotations

import shutil
import threading
from pathlib import Path

from olmo_jax import storage

SKIP = ("checkpoints/", "owner.lease")  # the bucket's own: never copied either way


def local_copy(cache_dir: str, url: str) -> Path:
    """Where the local copy of run folder `url` lives."""
    return (Path(cache_dir).expanduser() / "run_dirs" / storage.scheme(url)
            / url.partition("://")[2].strip("/"))


class Mirror:
    """The run folder `url` (in a bucket), worked on in `local`."""

    def __init__(self, url: str, local: Path):
        self.url, self.local = url.rstrip("/"), local
        self._sent: dict[str, tuple[int, int]] = {}  # relative path -> (size, mtime_ns) uploaded
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None  # the last background upload's failure

    def pull(self) -> None:
        """Replaces the local copy with the bucket's files."""
        if self.local.exists():
            shutil.rmtree(self.local)
        # exist_ok: another process of the run on this host may make it meanwhile
        self.local.mkdir(parents=True, exist_ok=True)
        fs = storage.filesystem(self.url)
        prefix = f"{storage.scheme(self.url)}://"
        root = self.url.partition("://")[2]
        for key in fs.find(root):
            rel = key[len(root):].lstrip("/")
            if not rel or rel.startswith(SKIP):
                continue
            dst = self.local / rel
            dst.parent.mkdir(parents=True, exist_ok=True)
            fs.get_file(prefix + key, str(dst))
            st = dst.stat()
            self._sent[rel] = (st.st_size, st.st_mtime_ns)

    def sync(self) -> int:
        """Uploads the files changed since their last upload; returns how many."""
        with self._lock:
            fs, sent = storage.filesystem(self.url), 0
            for src in sorted(self.local.rglob("*")):
                if not src.is_file():
                    continue
                rel = src.relative_to(self.local).as_posix()
                try:
                    st = src.stat()
                except FileNotFoundError:  # replaced meanwhile (os.replace): next time
                    continue
                if self._sent.get(rel) == (st.st_size, st.st_mtime_ns) or rel.startswith(SKIP):
                    continue
                fs.put_file(str(src), storage.join(self.url, rel))
                self._sent[rel] = (st.st_size, st.st_mtime_ns)
                sent += 1
            return sent

    def start(self, every_s: float) -> None:
        """Syncs every `every_s` seconds from a background thread until `close()`."""
        def loop():
            while not self._stop.wait(every_s):
                try:
                    self.sync()
                except Exception as e:  # the next sync (or close) tries again
                    self.error = e
        self._thread = threading.Thread(target=loop, name="olmo_jax-mirror", daemon=True)
        self._thread.start()

    def close(self, upload: bool = True) -> None:
        """Stops the background thread and (`upload`) syncs once more."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=60)
            self._thread = None
        if upload:
            self.sync()
