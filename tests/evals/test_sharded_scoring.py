"""Downstream scoring on 8 fake devices, as the trainer runs it in the loop, equals one
device on the same weights: the continuation sums and the answer-position
log-probabilities of every request, and the ICLMetric numbers logged. Meshes: data x expert (DDP and FSDP), the pipeline
(pipe 2 x data 2 x expert 2, 1F1B, 2 microbatches: the stages' forward as the trainer's
evaluation runs it), and context parallelism (zig-zag shards of the positions) without
and with a pipeline (all-gather attention, and the ring's pair exchanges). Each mesh
compiles one program (one [8, 16] batch shape)."""

import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx

from olmo_jax.errors import ConfigError
from olmo_jax.evals import metric, score, tasks
from olmo_jax.evals.suite import Suite
from olmo_jax.model.abstract import abstract_model
from olmo_jax.trainer.evaluation import Downstream
from tests.parallel.harness import VOCAB, Pipe, host_state, make_cfg, with_capacity
from tests.sections import plan_for

CTX = 16  # the eval context; every batch is [8, CTX] (fixed_ctx_len)


def _toy_tasks(rng) -> list[tasks.Task]:
    """Five documents of three choices (queries of 2..15 tokens, continuations of 1..3
    tokens) as a multiple-choice task (15 requests: two batches, the last one padded), and
    one request per document as a fast-MC task (each choice a single token at the answer
    position)."""
    rc, fast = [], []
    for doc in range(5):
        ctx = rng.integers(0, VOCAB, int(rng.integers(1, 12))).tolist()
        label = int(rng.integers(0, 3))
        for c in range(3):
            cont = rng.integers(0, VOCAB, 1 + (doc + c) % 3).tolist()
            query = ctx + cont[:-1]
            n = len(cont) + 1  # a leading space
            rc.append({"doc_id": doc, "cont_id": c, "label_id": label, "query": query, "continuation": cont,
                       "ctx_len": len(ctx) + 1, "cont_str_len": n, "cont_byte_len": n,
                       "cont_str_len_no_leading_space": n - 1, "cont_byte_len_no_leading_space": n - 1})
        fast.append({**rc[-1], "cont_id": 0, "query": ctx, "continuation": [0], "ctx_len": len(ctx),
                     "choices": rng.integers(0, VOCAB, 3).tolist(), "fast_mc": True,
                     "cont_str_len": 2, "cont_byte_len": 2, "cont_str_len_no_leading_space": 1,
                     "cont_byte_len_no_leading_space": 1})
    return [tasks.Task("toy_mc", "acc", False, CTX, rc), tasks.Task("toy_fast", "acc", True, CTX, fast)]


def _metrics(task, scores) -> dict[str, float]:
    return metric.compute(task.metric_type, metric.records(task.metric_type, task.samples, scores))


@pytest.fixture(scope="module")
def reference():
    _, _, _, graphdef, state = host_state()

    def apply(params, ids):
        return nnx.merge(graphdef, params, state.model_state)(ids).logits_BTV

    tasks_ = _toy_tasks(np.random.default_rng(0))
    scorer = score.Scorer(score.single_device_run(apply, state.params), 8, pad_id=0, fixed_ctx_len=True)
    scores = [scorer(t) for t in tasks_]
    return tasks_, scores, [_metrics(t, s) for t, s in zip(tasks_, scores, strict=True)]


def _plan(context_attention="ring", **mesh):
    model_cfg = host_state()[0]
    cfg = make_cfg(seq=CTX, **mesh)
    model_cfg = dataclasses.replace(with_capacity(model_cfg, cfg), context_attention=context_attention)
    return plan_for(cfg, model_cfg)


MESHES = {
    "ddp": dict(data=2, expert=4),
    "fsdp": dict(data=2, expert=4, strategy="fsdp"),
    "pipe": dict(data=2, expert=2, pipe=Pipe(2, "1f1b", 2)),
    "context": dict(data=2, context=2, expert=2),
    "pipe_context": dict(context=2, expert=2, pipe=Pipe(2, "1f1b", 2), context_attention="allgather"),
    "pipe_context_ring": dict(context=2, expert=2, pipe=Pipe(2, "1f1b", 2)),
}


def _suite(tasks_) -> Suite:
    """A Suite of the toy tasks (built directly: Suite() builds olmo_eval's labels)."""
    suite = Suite.__new__(Suite)
    suite.tasks = {t.label: t for t in tasks_}
    return suite


@pytest.mark.parametrize("mesh", list(MESHES))
def test_sharded_scores_equal_one_device(reference, mesh):
    """Scored as the trainer scores in the loop (trainer.evaluation.Downstream over the
    placed TrainState, the scorer loop._downstream builds): its records and every
    request's scores equal one device's."""
    tasks_, want, want_metrics = reference
    _, tx, _, _, state = host_state()
    plan = _plan(**MESHES[mesh])
    assert plan.mesh.size == 8 and (plan.pipeline is not None) == ("pipe" in mesh)
    graphdef = abstract_model(plan.model_cfg, plan.dispatcher)[0]
    placed = jax.device_put(state, plan.state_shardings(state, tx))
    scored, scorers = {}, []

    def make_scorer(get_state):
        scorers.append(score.Scorer(score.sharded_run(graphdef, plan, get_state), 8, pad_id=0, fixed_ctx_len=True))

        def recording(task):
            scored[task.label] = scorers[0](task)
            return scored[task.label]

        return recording

    records = Downstream(_suite(tasks_), make_scorer).run(placed)
    assert scorers[0].programs == 1  # [8, 16]
    got = [scored[t.label] for t in tasks_]
    diff = max(np.abs(np.asarray(g, np.float64) - np.asarray(w)).max() for g, w in zip(got, want, strict=True))
    print(f"{mesh}: max |diff| {diff:.2g}")
    assert diff <= 1e-5
    for task, w in zip(tasks_, want_metrics, strict=True):
        m = {k.split("/")[-1]: v for k, v in records.items() if k.startswith(f"downstream/{task.label}/")}
        assert m.pop("seconds") > 0 and m.keys() == w.keys()
        assert m[f"{task.metric_type}_v1"] == w[f"{task.metric_type}_v1"]  # the same choices
        assert max(abs(m[k] - w[k]) for k in w) <= 1e-5, (task.label, m, w)


def test_context_length_must_split_into_zigzag_chunks():
    plan = _plan(data=2, context=2, expert=2)
    run = score.sharded_run(None, plan, None)
    ids = np.zeros((8, 18), np.int32)
    with pytest.raises(ConfigError, match="18 tokens does not split into the 2 x parallel.context = 4"):
        run(ids, ids, ids.astype(np.float32), np.zeros(8, np.int32))
