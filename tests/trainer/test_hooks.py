"""The loop's hooks (olmo_jax/trainer/hooks.py) on fakes, no model: which steps write a
metrics line and run an evaluation (every trainer.log_every steps, the first and the last
step, and each eval step; evaluations every trainer.eval_every steps and at
trainer.max_steps), and the record a logged step writes."""

import itertools

import numpy as np
import pytest

from olmo_jax.trainer.evaluation import Evaluation
from olmo_jax.trainer.hooks import MetricsLine, Throughput


class _Recorder:
    def __init__(self):
        self.lines = []

    def scalars(self, step, record):
        self.lines.append(record)

    def update(self, step, record):
        pass


class _Guard:
    halt_reason = np.int32(0)


class _State:
    guard = _Guard()
    params = model_state = None


class _Loader:
    steps_per_epoch = 5

    def __init__(self, name):
        self.name = name


class _Data:
    eval = _Loader("default split")
    eval_sets = {"held": _Loader("named set")}


def _eval_fn_calls(calls):
    def eval_fn(params, model_state, batch):
        calls.append(batch.name)
        return np.float32(6.0), np.float32(3.0)
    return eval_fn


def _line(log_every, eval_every, max_steps, history=()):
    sinks, calls = _Recorder(), []
    evaluation = Evaluation(_eval_fn_calls(calls), _Data(), 1, lambda loader, i, grad_accum: loader,
                            eval_every, max_steps, list(history))
    throughput = Throughput(tokens_per_step=64, flops_per_token=1e6, devices=8, peak_flops=1e12)
    throughput.restart(0)
    line = MetricsLine(sinks, sinks, lambda halt, reason: None, evaluation, throughput,
                       log_every, max_steps, list(history))
    return line, sinks, calls


@pytest.mark.parametrize("log_every,eval_every,max_steps", list(itertools.product((1, 3, 4), (0, 2, 5), (7, 12))))
def test_logged_and_evaluated_steps(log_every, eval_every, max_steps):
    line, sinks, _ = _line(log_every, eval_every, max_steps)
    for step in range(1, max_steps + 1):
        line.on_step(step, _State(), {"loss": np.float32(step), "halted": np.int32(0),
                                      "expert_counts": np.zeros((2, 4))})
    logged = [r["step"] for r in sinks.lines]
    evaluated = [r["step"] for r in sinks.lines if "eval_loss" in r]
    is_eval = {s for s in range(1, max_steps + 1) if eval_every and s % eval_every == 0}
    assert logged == [s for s in range(1, max_steps + 1)
                      if s % log_every == 0 or s in (1, max_steps) or s in is_eval]
    assert evaluated == sorted(is_eval | {max_steps})
    assert line.evaluation.last_loss == 2.0 and line.evaluation.last_sets == {"held": 2.0}


def test_a_logged_record():
    line, sinks, calls = _line(1, 2, 2)
    line.on_step(2, _State(), {"loss": np.float32(1.5), "halted": np.int32(0),
                               "expert_counts": np.zeros((2, 4))})
    (record,) = sinks.lines
    assert list(record) == ["step", "loss", "tokens_per_s", "step_time_s", "tflops_per_device",
                            "mfu", "eval_loss", "eval/held/loss", "eval/held/perplexity"]
    assert record["loss"] == 1.5 and record["eval/held/perplexity"] == pytest.approx(np.exp(2.0))
    assert calls == ["default split", "named set"]  # one batch of each
    assert line.history == [record]


def test_evaluation_starts_from_the_resumed_records():
    history = [{"step": 2, "eval_loss": 3.0, "eval/held/loss": 4.0}, {"step": 3, "loss": 1.0}]
    evaluation = _line(1, 0, 10, history)[0].evaluation
    assert evaluation.last_loss == 3.0 and evaluation.last_sets == {"held": 4.0}
