"""`trainer.profile_steps=START:END`: a jax.profiler trace of train steps START..END-1
(numbered as in metrics.jsonl: the first step is 1) into {run_dir}/profile, readable by
xprof / TensorBoard's profile plugin (`tensorboard --logdir {run_dir}/profile`). Each step
is a `StepTraceAnnotation("train", step_num=N)`, so the trace viewer and the step-time
tools split the trace by step. The trace starts before step START is dispatched and stops
once step END-1's results are ready (or when the loop ends first). In a multi-process run
process I > 0 writes into {run_dir}/profile/process_I."""

from __future__ import annotations

import contextlib
from pathlib import Path

import jax

from olmo_jax.trainer.config import profile_window


class StepProfiler:
    def __init__(self, spec: str, run_dir: Path):
        self.window = profile_window(spec)
        index = jax.process_index()
        self.logdir = Path(run_dir) / "profile" / (f"process_{index}" if index else "")
        self.active = False

    def step(self, step: int):
        """A context for dispatching step `step`: starts the trace at START, annotates the
        traced steps."""
        if self.window is None or not self.window[0] <= step < self.window[1]:
            return contextlib.nullcontext()
        if not self.active:
            self.logdir.mkdir(parents=True, exist_ok=True)
            jax.profiler.start_trace(str(self.logdir))
            self.active = True
        return jax.profiler.StepTraceAnnotation("train", step_num=step)

    def after(self, step: int, outputs) -> None:
        """Stops the trace once step END-1 (`outputs` its results) has run."""
        if self.active and step >= self.window[1] - 1:
            jax.block_until_ready(outputs)
            self.stop()

    def stop(self) -> None:
        if self.active:
            self.active = False
            jax.profiler.stop_trace()

    # The loop's hook (hooks.py): `step` wraps the dispatch, these run after it.
    def on_step(self, step: int, state, metrics: dict) -> None:
        self.after(step, state)

    def on_end(self) -> None:
        self.stop()
