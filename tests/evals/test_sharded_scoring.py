"""Downstream scoring on 8 fake devices (data x expert, FSDP and DDP) equals one device on
the same weights: the continuation sums and the answer-position log-probabilities."""

import jax
import numpy as np
import pytest
from flax import nnx

from olmo_jax.errors import ConfigError
from olmo_jax.evals import score, tasks
from olmo_jax.model.abstract import abstract_model
from tests.parallel.harness import VOCAB, Pipe, host_state, make_cfg, with_capacity
from tests.sections import plan_for


def _toy_tasks(rng) -> list[tasks.Task]:
    """The same random requests as a plain task (continuation sums) and as a fast-MC one
    (four single-token choices at the answer position); queries of 2..16 tokens."""
    samples = []
    for i, n in enumerate((3, 9, 14, 5, 11, 7, 2, 13, 6, 10)):
        cont = rng.integers(0, VOCAB, 1 + i % 3).tolist()
        query = rng.integers(0, VOCAB, n).tolist() + cont[:-1]
        samples.append({"doc_id": i, "cont_id": 0, "query": query, "continuation": cont,
                        "ctx_len": len(query) - len(cont) + 1, "choices": rng.integers(0, VOCAB, 4).tolist(),
                        "fast_mc": True})
    return [tasks.Task("toy", "acc", False, 16, samples), tasks.Task("toy_fast", "acc", True, 16, samples)]


@pytest.fixture(scope="module")
def reference():
    _, _, _, graphdef, state = host_state()

    def apply(params, ids):
        return nnx.merge(graphdef, params, state.model_state)(ids).logits_BTV

    tasks_ = _toy_tasks(np.random.default_rng(0))
    scorer = score.Scorer(score.single_device_run(apply, state.params), 8, pad_id=0, fixed_ctx_len=True)
    return tasks_, [scorer(t) for t in tasks_]


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_sharded_scores_equal_one_device(reference, strategy):
    tasks_, want = reference
    model_cfg, tx, _, _, state = host_state()
    cfg = make_cfg(data=2, expert=4, strategy=strategy)
    plan = plan_for(cfg, with_capacity(model_cfg, cfg))
    graphdef = abstract_model(plan.model_cfg, plan.dispatcher)[0]
    placed = jax.device_put(state, plan.state_shardings(state, tx))
    run = score.sharded_run(graphdef, plan, lambda: (placed.params, placed.model_state))
    scorer = score.Scorer(run, 8, pad_id=0, fixed_ctx_len=True)
    got = [scorer(t) for t in tasks_]
    assert scorer.programs == 1  # [8, 16]: 10 requests in two batches, the last one padded
    diff = max(np.abs(np.asarray(g, np.float64) - np.asarray(w)).max() for g, w in zip(got, want, strict=True))
    print(f"{strategy}: max |diff| {diff:.2g}")
    assert diff <= 1e-5


def test_pipeline_plans_are_refused():
    model_cfg = host_state()[0]
    cfg = make_cfg(data=2, expert=2, pipe=Pipe(2, "1f1b", 2))
    plan = plan_for(cfg, with_capacity(model_cfg, cfg))
    with pytest.raises(ConfigError, match="pipeline plans"):
        score.sharded_run(None, plan, None)
