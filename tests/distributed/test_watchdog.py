"""The lost-process watchdog's protocol, on an in-memory stand-in for the coordination
service's key-value store (the real one is exercised by tests/distributed/test_multiprocess.py):
a silent process is named by process 0 and every other process stops with the same message;
a process that fails alone tells the others; one that finished is never called lost; a
runtime error (a collective failing because a peer died) waits for the verdict."""

import threading
import time

from olmo_jax.distributed.watchdog import Watchdog


class FakeKV:
    """key_value_set / key_value_try_get / key_value_dir_get, like JAX's client."""

    def __init__(self):
        self.data, self.lock = {}, threading.Lock()

    def key_value_set(self, key, value, allow_overwrite=False):
        with self.lock:
            self.data[key] = value

    def key_value_try_get(self, key):
        with self.lock:
            if key not in self.data:
                raise KeyError(key)  # JAX raises NOT_FOUND
            return self.data[key]

    def key_value_dir_get(self, prefix):
        with self.lock:
            return [(k, v) for k, v in self.data.items() if k.startswith(prefix)]


class Recording(Watchdog):
    """Records the exit instead of ending the test process."""

    def __init__(self, *args):
        super().__init__(*args)
        self.exited = threading.Event()
        self.message = None

    def _exit(self, message):  # the thread ends after it, as the process would
        self.message = message
        self.exited.set()


def watchdogs(n, timeout=0.5):
    kv = FakeKV()
    return kv, [Recording(kv, i, n, timeout).start() for i in range(n)]


def silence(dog):
    """The process died: its heartbeat thread stops without saying 'done'."""
    dog._stop.set()
    dog._thread.join()


def test_a_silent_process_is_named_by_every_survivor():
    kv, (p0, p1, p2) = watchdogs(3)
    time.sleep(0.3)
    silence(p2)
    started = time.monotonic()
    assert p0.exited.wait(5) and p1.exited.wait(5)
    assert 0.5 <= time.monotonic() - started < 3
    assert p0.message.startswith("lost process 2 of 3: no heartbeat for 0.5 s (trainer.peer_timeout_s)")
    assert p1.message == p0.message == kv.data["olmo_jax/failed"]


def test_a_silent_coordinator_is_named():
    _, (p0, p1) = watchdogs(2)
    silence(p0)
    assert p1.exited.wait(5)
    assert p1.message.startswith("lost process 0 of 2")


def test_a_process_failing_alone_stops_the_others_with_its_message():
    _, (p0, p1, p2) = watchdogs(3)
    p2.fail("process 2 failed: token file /data/x.npy does not exist")
    assert p0.exited.wait(5) and p1.exited.wait(5)
    assert p0.message == p1.message == "process 2 failed: token file /data/x.npy does not exist"
    assert not p2.exited.is_set()  # its own error path reports and exits


def test_finished_processes_are_not_lost():
    _, (p0, p1) = watchdogs(2, timeout=0.3)
    p1.finish()
    time.sleep(1.0)  # > peer timeout: p1 says nothing more, but it said "done"
    assert not p0.exited.is_set()
    p0.finish()


def test_an_error_after_a_peer_died_ends_with_the_lost_process_message():
    """jax 0.11's CPU collectives fail at once when a peer dies ("Connection reset by peer"):
    the survivor waits for the watchdog's verdict instead of reporting its own crash."""
    _, (p0, p1, p2) = watchdogs(3, timeout=2.0)
    time.sleep(0.5)
    silence(p2)
    started = time.monotonic()
    p1.await_verdict()  # returns once p1's watchdog has exited (Recording: instead of os._exit)
    assert p1.exited.is_set() and p1.message.startswith("lost process 2 of 3: no heartbeat for 2 s")
    assert time.monotonic() - started < 2.0 + 5 * 0.2
    assert p0.exited.wait(1)


def test_an_error_of_its_own_is_reported_after_the_wait():
    _, (p0, p1) = watchdogs(2, timeout=1.0)
    started = time.monotonic()
    p1.await_verdict()  # nobody is lost: returns after peer_timeout_s + 5 ticks
    assert 1.0 <= time.monotonic() - started < 3 and not p1.exited.is_set() and not p0.exited.is_set()
    p0.finish()
    p1.finish()
