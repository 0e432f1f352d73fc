"""Preemption: SIGTERM (what SLURM and Kubernetes send before killing a job) or SIGINT
(Ctrl-C) during training asks the loop to save a checkpoint at the current step, wait for
it and exit 0; rerunning the command resumes exactly there.

    with Preemption() as preempt:
        for step in ...:
            ...
            if preempt.requested(done): save, wait, stop

One process: a Python handler sets a flag the loop reads after each step (no device
sync). Several processes: all must stop at the same step, and a signal may reach only
some of them. JAX's preemption service (started with jax.distributed) catches SIGTERM,
tells every process, and agrees on a step (the largest any has reached, plus one); each
process asks `reached_preemption_sync_point(step)` after every step, a local check until
a notice arrives. SIGINT is forwarded to it as SIGTERM. A second signal while stopping
is not caught again (Ctrl-C twice interrupts at once).
"""

from __future__ import annotations

import os
import signal
import threading

import jax
from jax.experimental import multihost_utils


class Preemption:
    def __init__(self):
        self.signal_name: str | None = None
        self._multi = jax.process_count() > 1
        self._previous: dict[int, object] = {}

    def _on_signal(self, signum, frame) -> None:
        self.signal_name = signal.Signals(signum).name
        for s, handler in self._previous.items():  # the next signal acts as usual
            signal.signal(s, handler)
        self._previous = {}
        if self._multi:  # into JAX's preemption service, which tells the other processes
            os.kill(os.getpid(), signal.SIGTERM)

    def __enter__(self) -> Preemption:
        if threading.current_thread() is threading.main_thread():
            # Several processes: JAX's C++ handler owns SIGTERM; only SIGINT is ours.
            signals = (signal.SIGINT,) if self._multi else (signal.SIGTERM, signal.SIGINT)
            for s in signals:
                self._previous[s] = signal.signal(s, self._on_signal)
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous = {}

    def requested(self, step: int) -> bool:
        """True when the run should save and stop after `step` (every process agrees)."""
        if self._multi:
            if multihost_utils.reached_preemption_sync_point(step):
                self.signal_name = self.signal_name or "SIGTERM"
                return True
            return False
        return self.signal_name is not None
