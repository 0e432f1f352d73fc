"""Evaluation during training: every trainer.eval_every steps and at trainer.max_steps, the
mean loss over trainer.eval_batches batches of the default split (data.eval_fraction:
`eval_loss`) and of each named set (data.eval_sets: `eval/<name>/loss` and
`eval/<name>/perplexity`), every batch sharded like training; with trainer.downstream_evals
each task's ICLMetric numbers (`downstream/<label>/<metric>`) and the seconds it took
(`downstream/<label>/seconds`), scored on the plan's mesh (olmo_jax/evals). Its records join
the step's metrics line (hooks.MetricsLine, every sink); the last ones are kept for the
run's summary."""

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


class Downstream:
    """The downstream tasks (built and checked before any compute: evals.suite.Suite) and
    their scorer, whose run reads the state being evaluated. run(state) -> records."""

    def __init__(self, suite, make_scorer):
        self.suite, self._state = suite, None
        self.scorer = make_scorer(lambda: (self._state.params, self._state.model_state))

    def run(self, state) -> dict[str, float]:
        self._state = state
        try:
            results, seconds = self.suite.evaluate(self.scorer)
        finally:
            self._state = None
        record = {f"downstream/{label}/{k}": v for label, m in results.items() for k, v in m.items()}
        record.update({f"downstream/{label}/seconds": s for label, s in seconds.items()})
        return record


def _last_downstream(history: list[dict]) -> dict[str, float]:
    return next(({k: v for k, v in r.items() if k.startswith("downstream/")} for r in reversed(history)
                 if any(k.startswith("downstream/") for k in r)), {})


class Evaluation:
    """due(step) / run(state) -> the eval records; `last_loss` and `last_sets` ({name:
    loss}) and `last_downstream` ({downstream/<label>/<metric>: value}) are the latest ones,
    from `history` (the resumed run's records) until the first evaluation of this launch."""

    def __init__(self, eval_fn, data, n_batches: int, place, every: int, max_steps: int,
                 history: list[dict], downstream: Downstream | None = None):
        self.eval_fn, self.data, self.n_batches, self.place = eval_fn, data, n_batches, place
        self.every, self.max_steps, self.downstream = every, max_steps, downstream
        self.last_loss = _last(history, "eval_loss")
        self.last_sets = {name: _last(history, f"eval/{name}/loss") for name in data.eval_sets}
        self.last_downstream = _last_downstream(history)

    def due(self, step: int) -> bool:
        return bool(self.every and step % self.every == 0) or step == self.max_steps

    def run(self, state) -> dict[str, float]:
        evals = evaluate(self.eval_fn, state, self.data, self.n_batches, self.place)
        if self.downstream is not None:
            self.last_downstream = self.downstream.run(state)
            evals.update(self.last_downstream)
        self.last_loss = evals.get("eval_loss", self.last_loss)
        self.last_sets = {n: evals[f"eval/{n}/loss"] for n in self.data.eval_sets}
        return evals
