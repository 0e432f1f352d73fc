"""The train state's bad-step guard (trainer/guard.py) goes through checkpoints: saved with
the state and restored exactly; a checkpoint written before the guard existed (no
`guard/*` arrays in its `train` item) still resumes, with fresh counters."""

import jax
import jax.numpy as jnp
import numpy as np
from rich.console import Console

from olmo_jax.checkpoint import manager as m
from olmo_jax.config import validate
from olmo_jax.data import build_data
from olmo_jax.optim import build_optimizer
from olmo_jax.parallel.strategy import build_plan
from olmo_jax.trainer.checkpoints import RunCheckpoints, model_tree
from olmo_jax.trainer.guard import GuardConfig
from olmo_jax.trainer.state import abstract_train_state
from tests.run_config import run_config


def _setup(run):
    cfg = validate(run_config(run))
    t = cfg.trainer
    data = build_data(cfg.data, t.seq_len, t.global_batch_size, t.seed, t.cache_dir)
    model_cfg = cfg.model_config(data.vocab_size)
    plan = build_plan(cfg.parallel, t, model_cfg, optim=cfg.optim)
    tx = build_optimizer(cfg.optim, t.max_steps)[0]
    gcfg = GuardConfig.from_trainer(t)
    _, abstract = abstract_train_state(model_cfg, tx, dispatcher=plan.dispatcher, guard_cfg=gcfg)
    shardings = plan.state_shardings(abstract, tx)
    # Any values do (zeros, cheap): what matters is that they come back as saved.
    state = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), abstract)
    return cfg, model_cfg, data, tx, abstract, shardings, state


def _resume(cfg, model_cfg, data, tx, abstract, shardings, run):
    ckpts = RunCheckpoints(cfg.trainer, cfg.to_dict(), run, model_cfg, Console(quiet=True))
    try:
        return ckpts.start(abstract, shardings, tx, data.train, run / "metrics.jsonl", init=None)
    finally:
        ckpts.close()


def test_guard_round_trips_and_old_checkpoints_resume(tmp_path):
    run = tmp_path / "run"
    cfg, model_cfg, data, tx, abstract, shardings, state = _setup(run)
    state = state._replace(step=state.step + 3, guard=state.guard._replace(
        skipped=state.guard.skipped + 2, loss_W=state.guard.loss_W.at[1].set(4.5)))
    data.train.step = 3
    config = {"config": cfg.to_dict(), "model": m.model_config_to_dict(model_cfg)}
    with m.Checkpoints(run / "checkpoints", async_save=False) as ckpts:
        ckpts.save(3, model=model_tree(state),
                   train={"step": state.step, "rng": state.rng, "opt_state": state.opt_state,
                          "guard": state.guard},
                   json_items={m.DATA: data.train.state_dict(), m.CONFIG: config})
        ckpts.save(4, model=model_tree(state),  # an older olmo_jax's train item: no guard
                   train={"step": state.step + 1, "rng": state.rng, "opt_state": state.opt_state},
                   json_items={m.DATA: {**data.train.state_dict(), "step": 4}, m.CONFIG: config})
    old = _resume(cfg, model_cfg, data, tx, abstract, shardings, run)
    assert int(old.step) == 4
    jax.tree.map(lambda x: np.testing.assert_array_equal(np.asarray(x), 0), old.guard)
    for leaf in jax.tree.leaves(old.guard):
        assert leaf.sharding.is_fully_replicated
    (run / "checkpoints" / "4").rename(tmp_path / "set_aside")
    new = _resume(cfg, model_cfg, data, tx, abstract, shardings, run)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
                 new.guard, state.guard)
