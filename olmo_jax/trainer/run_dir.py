"""The run folder (trainer.run_dir): checked before anything runs, and its config.json.

- A run_dir that cannot be created or written to is refused, naming trainer.run_dir.
- config.json is the resolved config of the run the folder holds, written when training
  starts (after every check passed, so a refused launch never replaces it). Starting
  again on the same folder with the same config is how a run resumes. A config that
  differs in a field that defines the run (architecture, data, optimizer, seed, batch,
  steps) is refused, naming the fields, unless trainer.overwrite=True: then the old file
  is kept as config.replaced-<time>.json and the run goes on with the new config (it still
  resumes from the folder's checkpoints, whose architecture trainer/checkpoints.py checks).
- One owner: process 0 of a training run holds an exclusive lock (`flock`) on the folder's
  `owner.lock` (holding "pid P on host H") for as long as it trains; the kernel drops it
  when the process ends, however it ends (kill -9 included), so no stale lock is left. A
  second trainer on the folder is refused at once, naming the owner. Readers (report,
  convert) take no lock.
- A run folder in a bucket (`s3://bucket/prefix`, `gs://bucket/prefix`): checkpoints are
  written there by orbax (checkpoint/object_store.py), the other files are written in a
  local copy and uploaded (mirror.py); the one owner holds a lease object instead of the flock
  (lease.py), refused with the same message.
- A refused launch leaves nothing behind: a folder this launch created is removed again
  (with the empty folders and the lock file in it) when the run is refused before it
  wrote anything of its own.
- Background errors (orbax's and asyncio's threads, e.g. a failed asynchronous checkpoint
  write) go to the folder's `errors.log`, not to the terminal: the run reports the failure
  as one `error:` line (trainer/checkpoints.py).
- Fields that may change between launches of one run: where and how it runs (parallel.*,
  intervals, hard_stop, the reliability knobs, the metric sinks and profiler, the named
  eval sets, data read-ahead) and the model fields a checkpoint does not
  depend on (trainer/checkpoints.py FREE_MODEL_FIELDS, FREE_MOE_FIELDS).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import shutil
import socket
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

from olmo_jax import storage
from olmo_jax.checkpoint.manager import RUN_SUBDIR
from olmo_jax.config import RunConfig
from olmo_jax.errors import ConfigError, StorageError
from olmo_jax.trainer.checkpoints import FREE_MODEL_FIELDS, FREE_MOE_FIELDS
from olmo_jax.trainer.lease import LEASE_FILE, Lease, LeaseHeld, LeaseLost
from olmo_jax.trainer.mirror import Mirror, local_copy

CONFIG_FILE = "config.json"
LOCK_FILE = "owner.lock"
ERROR_LOG = "errors.log"
FREE_TRAINER_FIELDS = {
    "run_dir", "cache_dir", "log_every", "eval_every", "eval_batches", "expert_counts_every",
    "sample_prompt", "sample_tokens", "sample_temperature", "save_every", "keep_last", "keep_every", "resume",
    "init_from", "hard_stop", "overwrite", "grad_accum", "nan_policy", "max_skipped",
    "spike_sigma", "memory_limit_gb", "peer_timeout_s", "loggers", "profile_steps",
    "lease_ttl_s",
}
MIRROR_EVERY_S = 30.0  # a bucket run folder's files are uploaded at least this often
# Fields of other sections that change what is logged or how data is read, not the run.
FREE_DATA_FIELDS = {"prefetch", "remote_cache_mb"}


def _is_free(dotted: str) -> bool:
    section, _, rest = dotted.partition(".")
    if section == "parallel":
        return True
    if section == "trainer":
        return rest in FREE_TRAINER_FIELDS or rest.startswith("wandb.")
    if section == "data":
        return rest in FREE_DATA_FIELDS or rest.startswith("eval_sets.")
    if section == "model":
        if rest.startswith("moe."):
            return rest[4:] in FREE_MOE_FIELDS
        return rest in FREE_MODEL_FIELDS
    return False


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def as_json(cfg: RunConfig) -> dict:
    """The config as config.json holds it."""
    return json.loads(json.dumps(cfg.to_dict(), default=str))


def differences(saved: dict, current: dict) -> list[tuple[str, object, object]]:
    """(field, saved value, current value) of the run-defining fields that differ (fields
    only one side has, e.g. from another olmo_jax version, are ignored)."""
    a, b = _flat(saved), _flat(current)
    return [(k, a[k], b[k]) for k in a if k in b and a[k] != b[k] and not _is_free(k)]


def _missing(run_dir: Path) -> list[Path]:
    """run_dir and its ancestors that do not exist yet (deepest first)."""
    out = []
    for p in (run_dir, *run_dir.absolute().parents):
        if p.exists():
            break
        out.append(p)
    return out


def prepare(cfg: RunConfig) -> Path:
    """Creates trainer.run_dir, checks it is writable and that it does not hold a run with a
    different config (unless trainer.overwrite). Returns the folder."""
    run_dir = _writable(cfg)
    _check_saved_config(cfg, run_dir)
    return run_dir


def _writable(cfg: RunConfig) -> Path:
    run_dir = Path(cfg.trainer.run_dir).expanduser()
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=run_dir, prefix=".write_check"):
            pass
    except OSError as e:
        raise ConfigError(
            f"trainer.run_dir={cfg.trainer.run_dir} cannot be written to ({e.strerror or e}); "
            "choose a folder you can write (the run's checkpoints and metrics go there)"
        ) from e
    return run_dir


def _check_saved_config(cfg: RunConfig, run_dir: Path) -> None:
    saved_path = run_dir / CONFIG_FILE
    if not saved_path.is_file():
        return
    try:
        saved = json.loads(saved_path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(
            f"{saved_path} (the config of the run in trainer.run_dir) cannot be read: {e}; "
            "remove it or choose another trainer.run_dir"
        ) from e
    diff = differences(saved, as_json(cfg))
    if diff and not cfg.trainer.overwrite:
        shown = ", ".join(f"{k}: {a!r} -> {b!r}" for k, a, b in diff[:5])
        more = f" and {len(diff) - 5} more" if len(diff) > 5 else ""
        raise ConfigError(
            f"trainer.run_dir={cfg.trainer.run_dir} holds a run with a different config "
            f"({saved_path}): {shown}{more}. Use that run's settings to resume it, choose a new "
            "trainer.run_dir, or pass --config.trainer.overwrite=True to continue it with this "
            "config"
        )


def _in_use(cfg: RunConfig, holder: str, where) -> ConfigError:
    return ConfigError(
        f"trainer.run_dir={cfg.trainer.run_dir} is in use by another trainer ({holder}; "
        f"{where}): wait for it to end or stop it, or choose another trainer.run_dir")


def _holder(fd: int) -> str:
    """The owner line of a lock file (the owner may be writing it this instant)."""
    for _ in range(20):
        text = os.pread(fd, 200, 0).decode(errors="replace").strip()
        if text:
            return text
        time.sleep(0.05)
    return "an owner that has not written its pid yet"


class RunFolder:
    """trainer.run_dir of a training run, owned (locked) by process 0; `path` is the folder.
    `release(refused=True)` also removes what this launch created, when it owns the folder."""

    def __init__(self, cfg: RunConfig, main: bool):
        self.url = cfg.trainer.run_dir.rstrip("/") if storage.is_remote(cfg.trainer.run_dir) else None
        self._fd: int | None = None
        self.lease: Lease | None = None
        self.mirror: Mirror | None = None
        if self.url:
            self.created = []
            self.path = local_copy(cfg.trainer.cache_dir, self.url)
            self._open_bucket(cfg, main)
        else:
            self.created = _missing(Path(cfg.trainer.run_dir).expanduser())
            self.path = _writable(cfg)
            if main:
                self._lock(cfg)
        try:
            if main or not self.url:  # a bucket's: only process 0's copy holds its files
                _check_saved_config(cfg, self.path)
        except BaseException:
            self.release(refused=True)
            raise

    @property
    def checkpoint_dir(self) -> str | Path:
        """Where the run's checkpoints go: {run_dir}/checkpoints (in the bucket for one)."""
        return storage.join(self.url, RUN_SUBDIR) if self.url else self.path / RUN_SUBDIR

    def _open_bucket(self, cfg: RunConfig, main: bool) -> None:
        """Process 0 takes the lease, then makes the local copy the bucket's files and
        uploads them from then on; the others only check the bucket (their local folder,
        the same as process 0's on one host, may hold another run's files: they never
        read it)."""
        try:
            storage.makedirs(self.url)  # the bucket exists
            if main:
                lease = Lease(self.url, cfg.trainer.lease_ttl_s)
                lease.acquire()
                self.lease = lease
                self.mirror = Mirror(self.url, self.path)
                self.mirror.pull()
                self.mirror.start(MIRROR_EVERY_S)
            else:
                self.path.mkdir(parents=True, exist_ok=True)
        except LeaseHeld as e:
            raise _in_use(cfg, e.holder, storage.join(self.url, LEASE_FILE)) from None
        except (OSError, ValueError) as e:
            self.release(refused=True)
            raise ConfigError(f"trainer.run_dir: {storage.storage_error(self.url, e, 'writing')}"
                              ) from None

    def on_save(self, step: int) -> None:
        """Before each checkpoint save of a bucket run folder: this trainer still holds
        the lease, and the bucket gets the files written so far (StorageError else)."""
        if self.lease is not None:
            try:
                self.lease.check()
            except LeaseLost as e:
                raise StorageError(
                    f"trainer.run_dir={self.url}: {e}; the run stopped before saving step "
                    f"{step}, so as not to write over another trainer's checkpoints") from None
            except (OSError, ValueError):
                pass  # the store is unreachable: the save itself reports it
        if self.mirror is not None:
            try:
                self.mirror.sync()
            except (OSError, ValueError) as e:
                raise StorageError(storage.storage_error(self.url, e, "writing")) from None

    def _lock(self, cfg: RunConfig) -> None:
        fd = os.open(self.path / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            holder = _holder(fd)
            os.close(fd)
            raise _in_use(cfg, holder, self.path / LOCK_FILE) from e
        self._fd = fd
        stamp = time.strftime("%Y-%m-%d %H:%M:%S %Z")
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"pid {os.getpid()} on host {socket.gethostname()} since {stamp}\n"
                      .encode(), 0)
        except OSError:  # a full disk: the lock holds all the same
            pass

    def release(self, refused: bool = False) -> None:
        """Drops the lock; `refused`: the run wrote nothing of its own, so the folders this
        launch created (and only empty ones) and its lock file go too. A bucket run
        folder uploads its files a last time (none when refused: its local copy goes) and
        gives its lease back."""
        if self.url:
            self._release_bucket(refused)
            return
        if self._fd is None:
            return
        if refused and self.created:
            (self.path / LOCK_FILE).unlink(missing_ok=True)
            for root, _dirs, _files in sorted(os.walk(self.path), key=lambda w: -len(w[0])):
                with contextlib.suppress(OSError):
                    os.rmdir(root)  # only empty folders
            for p in self.created[1:]:
                with contextlib.suppress(OSError):
                    p.rmdir()
        os.close(self._fd)  # closing drops the flock
        self._fd = None

    def _release_bucket(self, refused: bool) -> None:
        mirror, lease, self.mirror, self.lease = self.mirror, self.lease, None, None
        try:
            if mirror is not None:
                try:
                    mirror.close(upload=not refused and not (lease and lease.lost))
                except (OSError, ValueError) as e:  # the last upload: one error line
                    raise StorageError(
                        f"{storage.storage_error(self.url, e, 'writing')}; the run's files "
                        f"are kept in {self.path}") from None
        finally:
            if lease is not None:
                lease.release()
            if refused and self.path.exists():
                with contextlib.suppress(OSError):
                    shutil.rmtree(self.path)


class _QuietHandler(logging.FileHandler):
    def handleError(self, record) -> None:  # a full disk: the log line is lost, quietly
        pass


@contextlib.contextmanager
def background_errors_to_log(run_dir: Path):
    """While training: orbax's and asyncio's log records and the tracebacks of background
    threads and callbacks (sys.excepthook, threading.excepthook, sys.unraisablehook) go
    to run_dir/errors.log instead of the terminal. The run reports a failure itself, as one
    `error:` line; after a StorageError the redirection stays (orbax's threads are still
    failing while the process ends)."""
    handler = _QuietHandler(run_dir / ERROR_LOG, delay=True)
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    loggers = [logging.getLogger(n) for n in ("absl", "asyncio", "orbax")]
    saved = [(lg, lg.propagate) for lg in loggers]
    for lg in loggers:
        lg.addHandler(handler)
        lg.propagate = False
    hooks = sys.excepthook, threading.excepthook, sys.unraisablehook

    def to_log(exc_type, exc, tb, where: str = "callback") -> None:
        with contextlib.suppress(OSError, ValueError):
            text = "".join(traceback.format_exception(exc_type, exc, tb))
            logging.getLogger("asyncio").error("uncaught in a background %s:\n%s", where, text)

    sys.excepthook = to_log
    threading.excepthook = lambda a: to_log(a.exc_type, a.exc_value, a.exc_traceback,
                                            f"thread {a.thread.name if a.thread else ''}")
    # tensorstore's callbacks into a closed event loop (after a failed write) end here
    sys.unraisablehook = lambda u: to_log(u.exc_type, u.exc_value, u.exc_traceback,
                                          f"callback {u.err_msg or ''} {u.object!r}")
    try:
        yield run_dir / ERROR_LOG
    except StorageError:
        raise  # the redirection stays: orbax's failing threads may still report
    except BaseException:
        _restore(hooks, saved, handler)
        raise
    else:
        _restore(hooks, saved, handler)


def _restore(hooks, saved, handler) -> None:
    sys.excepthook, threading.excepthook, sys.unraisablehook = hooks
    for lg, propagate in saved:
        lg.removeHandler(handler)
        lg.propagate = propagate
    handler.close()


def write_config(run_dir: Path, cfg: RunConfig) -> None:
    """Writes config.json (atomically); with trainer.overwrite, a different config.json
    already there is kept as config.replaced-<time>.json."""
    path = run_dir / CONFIG_FILE
    current = as_json(cfg)
    if path.is_file():
        try:
            saved = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            saved = None
        if saved is not None and saved != current:
            if differences(saved, current):
                stamp = time.strftime("%Y%m%d-%H%M%S")
                os.replace(path, run_dir / f"config.replaced-{stamp}.json")
    fd, tmp = tempfile.mkstemp(dir=run_dir, prefix=".config.", suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(current, f, indent=2)
    os.replace(tmp, path)
