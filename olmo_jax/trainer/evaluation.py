"""Evaluation during training: every trainer.eval_every steps and at trainer.max_steps, the
mean loss over trainer.eval_batches batches of the default split (data.eval_fraction:
`eval_loss`) and of each named set (data.eval_sets: `eval/<name>/loss` and
`eval/<name>/perplexity`), every batch sharded like training. Its records join the step's
metrics line (hooks.MetricsLine); the last losses are kept for the run's summary."""

from __future__ import annotations

import numpy as np


def evaluate(eval_fn, state, data, n_batches, place) -> dict[str, float]:
    """The eval records: eval_loss on the default split, eval/<name>/loss and
    eval/<name>/perplexity on each named set; every batch sharded like training."""
    record = {}
    if data.eval is not None:
        record["eval_loss"] = eval_loss(eval_fn, state, data.eval, n_batches, place)
    for name, loader in data.eval_sets.items():
        loss = eval_loss(eval_fn, state, loader, n_batches, place)
        record[f"eval/{name}/loss"] = loss
        record[f"eval/{name}/perplexity"] = float(np.exp(min(loss, 700.0)))
    return record


def eval_loss(eval_fn, state, loader, n_batches, place) -> float:
    ce, n = 0.0, 0.0
    for i in range(min(n_batches, max(1, loader.steps_per_epoch))):
        batch = place(loader, i, grad_accum=1)
        c, t = eval_fn(state.params, state.model_state, batch)
        ce, n = ce + float(c), n + float(t)
    return ce / max(n, 1.0)


def _last(history: list[dict], key: str) -> float:
    return next((r[key] for r in reversed(history) if key in r), float("nan"))


class Evaluation:
    """due(step) / run(state) -> the eval records; `last_loss` and `last_sets` ({name:
    loss}) are the latest ones, from `history` (the resumed run's records) until the first
    evaluation of this launch."""

    def __init__(self, eval_fn, data, n_batches: int, place, every: int, max_steps: int,
                 history: list[dict]):
        self.eval_fn, self.data, self.n_batches, self.place = eval_fn, data, n_batches, place
        self.every, self.max_steps = every, max_steps
        self.last_loss = _last(history, "eval_loss")
        self.last_sets = {name: _last(history, f"eval/{name}/loss") for name in data.eval_sets}

    def due(self, step: int) -> bool:
        return bool(self.every and step % self.every == 0) or step == self.max_steps

    def run(self, state) -> dict[str, float]:
        evals = evaluate(self.eval_fn, state, self.data, self.n_batches, self.place)
        self.last_loss = evals.get("eval_loss", self.last_loss)
        self.last_sets = {n: evals[f"eval/{n}/loss"] for n in self.data.eval_sets}
        return evals
