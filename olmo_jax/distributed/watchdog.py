"""Lost processes: a heartbeat per process in JAX's coordination-service key-value store,
so that when one process dies (kill -9, a crashed host) or hangs, the others stop with a
message naming it within `peer_timeout_s` instead of waiting forever in a collective.

Keys (prefix olmo_jax/):
  alive/{i}  process i's heartbeat counter, bumped every tick by a daemon thread; "done"
             once the process finished its run normally
  failed     why the run ends: set by process 0 when it finds a lost process, or by any
             process that fails on its own (an error only it saw)

Process 0 reads every heartbeat each tick; every other process reads process 0's and
`failed`. A heartbeat that has not moved for `peer_timeout_s` means a lost process:
process 0 writes `failed`, waits two ticks so the others read it, and every process
exits with EXIT_PEER_LOST after printing the same message. (A tick is peer_timeout_s / 10,
at most 1 s: a few small RPCs per process.)

If process 0 itself dies, the coordination service it hosts dies with it and JAX ends every
other process at once, with its own message ("the leader task was preempted/died").

A collective may also fail at once when a peer dies (jax 0.11's CPU collectives raise
"Gloo AllGather failed: ... Connection reset by peer"): the training process then calls
`await_verdict()` before reporting a crash, so the run still ends with EXIT_PEER_LOST and
the message naming the lost process when that is the cause.
"""

from __future__ import annotations

import os
import sys
import threading
import time

EXIT_PEER_LOST = 75  # EX_TEMPFAIL: the job may be relaunched (it resumes from its checkpoint)
_PREFIX = "olmo_jax/"
_DONE = "done"


class Watchdog:
    def __init__(self, client, process_id: int, num_processes: int, peer_timeout_s: float):
        self.client, self.pid, self.n = client, process_id, num_processes
        self.timeout = float(peer_timeout_s)
        self.tick = min(1.0, max(0.05, self.timeout / 10))
        self.hint = "relaunch every process with the same command to resume from the last checkpoint"
        self._stop = threading.Event()
        watched = range(num_processes) if process_id == 0 else [0]
        now = time.monotonic()
        self._seen = {p: (None, now) for p in watched if p != process_id}
        self._count = 0
        self._thread = threading.Thread(target=self._run, name="olmo_jax-watchdog", daemon=True)

    def start(self) -> Watchdog:
        self._beat()
        self._thread.start()
        return self

    # ---- the daemon thread -----------------------------------------------------------
    def _beat(self, value: str | None = None) -> None:
        self._count += 1
        self.client.key_value_set(f"{_PREFIX}alive/{self.pid}", value or str(self._count),
                                  allow_overwrite=True)

    def _read(self, key: str) -> str | None:
        try:
            return self.client.key_value_try_get(_PREFIX + key)
        except Exception:  # NOT_FOUND: not written (yet)
            return None

    def _heartbeats(self) -> dict[int, str]:
        if self.pid != 0:
            value = self._read("alive/0")
            return {} if value is None else {0: value}
        entries = self.client.key_value_dir_get(f"{_PREFIX}alive/")
        return {int(k.rsplit("/", 1)[1]): v for k, v in entries}

    def _run(self) -> None:
        last_contact = time.monotonic()
        while not self._stop.wait(self.tick):
            try:
                self._beat()
                failed = self._read("failed")
                beats = self._heartbeats()
                last_contact = time.monotonic()
            except Exception as e:  # the coordination service is unreachable
                if time.monotonic() - last_contact > self.timeout:
                    return self._exit(f"lost contact with process 0 (the coordinator) of "
                                      f"{self.n}: {type(e).__name__} for {self.timeout:g} s")
                continue
            if failed is not None:
                return self._exit(failed)
            lost = self._lost(beats)
            if lost is not None and not self._stop.is_set():
                message = (f"lost process {lost} of {self.n}: no heartbeat for "
                           f"{self.timeout:g} s (trainer.peer_timeout_s); it crashed, was killed "
                           "or hangs (see its log)")
                self.report(message)
                time.sleep(2 * self.tick)  # let the others read it before the service goes
                return self._exit(message)

    def _lost(self, beats: dict[int, str]) -> int | None:
        now = time.monotonic()
        for p, (value, since) in list(self._seen.items()):
            new = beats.get(p)
            if new == _DONE:
                del self._seen[p]
            elif new != value:
                self._seen[p] = (new, now)
            elif now - since > self.timeout:
                return p
        return None

    def _exit(self, message: str) -> None:
        print(f"error: {message}; {self.hint}", file=sys.stderr, flush=True)
        os._exit(EXIT_PEER_LOST)

    # ---- called by the training process ----------------------------------------------
    def fail(self, message: str) -> None:
        """This process fails on its own: stop watching and tell the others why."""
        self._stop.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join()
        self.report(message)

    def report(self, message: str) -> None:
        """Records why the run fails so every process stops with this message."""
        try:
            if self._read("failed") is None:
                self.client.key_value_set(_PREFIX + "failed", message, allow_overwrite=True)
        except Exception:  # the service is gone: the others stop anyway
            pass

    def await_verdict(self) -> None:
        """After a runtime error in this process: wait until the watchdog would have found
        a lost process (peer_timeout_s, plus the ticks to read `failed`); if one is lost,
        the watchdog thread exits this process with EXIT_PEER_LOST meanwhile. Returns when
        every watched process still beats (the error is this process's own)."""
        if self._thread.is_alive():
            self._thread.join(self.timeout + 5 * self.tick)

    def finish(self) -> None:
        """This process ended its run normally: stop watching, and tell the others."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        try:
            self._beat(_DONE)
        except Exception:
            pass
