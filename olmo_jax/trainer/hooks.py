"""The training loop's periodic side tasks (loop.py), each a hook run after every step.

    for step in range(start, stop):
        state, metrics = run_step(state, step)
        for hook in hooks:
            hook.on_step(step + 1, state, metrics)   # completed steps: 1, 2, ...
    ...
    finally: every hook's on_end()

in this order:
    StepProfiler   trainer.profile_steps: stops the trace after its last step (profiler.py)
    ExpertCounts   per-expert routed counts every trainer.expert_counts_every steps
    MetricsLine    the logged step's line (every trainer.log_every steps, the first and last,
                   and each eval step), with its throughput and evaluation (evaluation.py),
                   to the sinks (sinks.py) and the progress bar
    Checkpointing  saves every trainer.save_every steps, at the stop step, and when SIGTERM /
                   SIGINT asks the run to stop (preemption.py); then the loop stops
A step whose metrics are read (MetricsLine) or whose state is saved (Checkpointing) is first
checked for a halt of the bad-step guard (HaltCheck, guard.py): a halted run raises there,
its last save complete, and no halted state is ever saved.
"""

from __future__ import annotations

import time
from typing import Protocol

import jax
import numpy as np

from olmo_jax.trainer import guard as guard_lib
from olmo_jax.trainer.checkpoints import RunCheckpoints
from olmo_jax.trainer.evaluation import Evaluation
from olmo_jax.trainer.logger import ProgressBar
from olmo_jax.trainer.preemption import Preemption
from olmo_jax.trainer.sinks import Sinks


class Hook(Protocol):
    def on_step(self, step: int, state, metrics: dict) -> None:
        """After step `step` (completed steps, from 1); `metrics` still on the devices."""

    def on_end(self) -> None:
        """When the loop ends, finished or not (in its `finally`)."""


class HaltCheck:
    """halt(halt_step, reason): raises TrainingHalted when the guard halted the run at
    `halt_step` (0: not halted), once the last save made before the bad step is complete."""

    def __init__(self, checkpoints: RunCheckpoints, cfg: guard_lib.GuardConfig):
        self.checkpoints, self.cfg = checkpoints, cfg

    def __call__(self, halt_step, reason) -> None:
        if int(halt_step):
            self.checkpoints.close()  # the last save, made before the bad step, completes
            raise guard_lib.TrainingHalted(guard_lib.halt_message(
                int(halt_step), int(reason), self.cfg, self.checkpoints.last_saved,
                str(self.checkpoints.ckpts.directory)))


class ExpertCounts:
    """Every `every` steps (0: never), the step's per-expert routed counts to the sinks
    (process 0 only: the others have none)."""

    def __init__(self, sinks: Sinks, every: int, first_block: int, main: bool):
        self.sinks, self.every, self.first, self.main = sinks, every, first_block, main

    def on_step(self, step: int, state, metrics: dict) -> None:
        if self.main and self.every and step % self.every == 0:
            counts_LE = np.asarray(metrics["expert_counts"])  # [MoE blocks, experts]
            blocks = list(range(self.first, self.first + len(counts_LE)))
            self.sinks.expert_counts(step, blocks, counts_LE)

    def on_end(self) -> None:
        pass


class Throughput:
    """tokens/s, step time, TFLOP/s per device and MFU over the steps since the last
    logged one (`restart`). `tokens_before(step)`: the tokens of the run's first `step`
    steps when the batch size changes (trainer.batch_size_schedule)."""

    def __init__(self, tokens_per_step: int, flops_per_token: float, devices: int,
                 peak_flops: float, tokens_before=None):
        self.tokens_per_step, self.flops_tok = tokens_per_step, flops_per_token
        self.n_dev, self.peak = devices, peak_flops
        self.tokens_before = tokens_before or (lambda step: step * tokens_per_step)
        self.t_last, self.step_last = None, None

    def restart(self, step: int) -> None:
        self.t_last, self.step_last = time.perf_counter(), step

    def record(self, step: int) -> dict[str, float]:
        now = time.perf_counter()
        tok_s = (self.tokens_before(step) - self.tokens_before(self.step_last)) / (now - self.t_last)
        return {
            "tokens_per_s": tok_s,
            "step_time_s": (now - self.t_last) / (step - self.step_last),
            "tflops_per_device": self.flops_tok * tok_s / self.n_dev / 1e12,
            "mfu": self.flops_tok * tok_s / self.n_dev / self.peak,
        }


class MetricsLine:
    """The metrics line of each logged step: every `log_every` steps, the first and the
    `max_steps`-th, and each step `evaluation` is due. The step's scalar metrics, its
    throughput and the eval records go to the sinks, `history` and the progress bar."""

    def __init__(self, sinks: Sinks, bar: ProgressBar, halt: HaltCheck, evaluation: Evaluation,
                 throughput: Throughput, log_every: int, max_steps: int, history: list[dict]):
        self.sinks, self.bar, self.halt = sinks, bar, halt
        self.evaluation, self.throughput = evaluation, throughput
        self.log_every, self.max_steps = log_every, max_steps
        self.history = history

    def due(self, step: int) -> bool:
        return (step % self.log_every == 0 or step in (1, self.max_steps)
                or self.evaluation.due(step))

    def on_step(self, step: int, state, metrics: dict) -> None:
        if not self.due(step):
            return
        metrics = jax.device_get(metrics)
        self.halt(metrics.pop("halted"), state.guard.halt_reason)
        record = {"step": step, **{k: float(v) for k, v in metrics.items() if v.ndim == 0}}
        record.update(self.throughput.record(step))
        if self.evaluation.due(step):
            record.update(self.evaluation.run(state))
        self.sinks.scalars(step, record)
        self.history.append(record)
        self.bar.update(step, record)
        self.throughput.restart(step)  # the next interval starts after the evaluation

    def on_end(self) -> None:
        pass


class Checkpointing:
    """Saves after every trainer.save_every steps, after the `stop`-th step and when a
    SIGTERM / SIGINT asks the run to stop (`preempted` is then (signal, step): the loop
    stops). The grain iterator state of `stream` is saved too; on_end waits for the last
    save."""

    def __init__(self, checkpoints: RunCheckpoints, halt: HaltCheck, preempt: Preemption,
                 train_loader, stream, stop: int):
        self.checkpoints, self.halt, self.preempt = checkpoints, halt, preempt
        self.train_loader, self.stream, self.stop = train_loader, stream, stop
        self.preempted: tuple[str, int] | None = None

    def on_step(self, step: int, state, metrics: dict) -> None:
        self.checkpoints.poll()  # a failed asynchronous save stops the run here
        preempt_now = self.preempt.requested(step)
        force = step == self.stop or preempt_now
        if self.checkpoints.due(step, force):  # never save a halted run's state
            self.halt(state.guard.halt_step, state.guard.halt_reason)
        self.checkpoints.maybe_save(step, state, self.train_loader, force=force,
                                    stream=self.stream)
        if preempt_now:
            self.preempted = (self.preempt.signal_name, step)

    def on_end(self) -> None:
        self.checkpoints.close()  # waits for the last save
