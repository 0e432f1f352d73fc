"""Per-parameter-group overrides (optim.group_overrides): AdamW steps with lr and
weight-decay multipliers chosen by glob equal a plain float64 numpy AdamW applying each
parameter's own learning rate (its group's schedule, from lr x lr_mult) and decay; a group
with lr_mult=0 is frozen; the globs are checked as OLMo-core's strict build_groups checks
them (no match, a parameter in two groups); the run's optimizer state is built and sharded
with groups on real parameter paths."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from rich.console import Console

from olmo_jax import config as config_lib
from olmo_jax.errors import ConfigError
from olmo_jax.model.params import path_name
from olmo_jax.optim import build_optimizer, schedulers
from olmo_jax.optim.config import OptimConfig
from olmo_jax.trainer import loop
from olmo_jax.trainer import run_dir as run_dir_lib
from tests.run_config import run_config

SPEC = ("*router*,embedding: wd_mult=0.0, lr_mult=2.0; lm_head: lr_mult=0.5; "
        "*attn_norm*: wd_mult=3.0; final_norm/*: lr_mult=0")
MULTS = {"embedding": (2.0, 0.0), "moe_blocks/ffn/router/weight": (2.0, 0.0), "lm_head": (0.5, 1.0),
         "moe_blocks/attn_norm/weight": (1.0, 3.0), "final_norm/weight": (0.0, 1.0),
         "moe_blocks/attn/q_proj": (1.0, 1.0)}  # (lr_mult, wd_mult); the last: default group
SCHEDULER = "wsd(warmup=2, decay=2, decay_fraction=None, decay_min_lr=1e-3)"  # not linear in lr
STEPS = 5


def _params(rng):
    shapes = {"embedding": (6, 4), "lm_head": (4, 6), "final_norm": {"weight": (4,)},
              "moe_blocks": {"ffn": {"router": {"weight": (2, 4, 3)}}, "attn_norm": {"weight": (2, 4)},
                             "attn": {"q_proj": (2, 4, 4)}}}
    return jax.tree.map(lambda s: jnp.asarray(rng.normal(size=s), jnp.float32), shapes,
                        is_leaf=lambda x: isinstance(x, tuple))


def test_group_multipliers_equal_a_numpy_adamw_per_parameter():
    rng = np.random.default_rng(0)
    params = _params(rng)
    grads = [jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape), jnp.float32), params)
             for _ in range(STEPS)]
    o = dataclasses.replace(OptimConfig(), lr=1e-2, weight_decay=0.1, clip_grad_norm=0.0,
                            scheduler=SCHEDULER, group_overrides=SPEC)
    tx, _ = build_optimizer(o.validate(), total_steps=STEPS)
    state, p = tx.init(params), params
    for g in grads:
        updates, state = tx.update(g, state, p)
        p = jax.tree.map(lambda a, u: a + u, p, updates)

    flat_p0 = {path_name(k): np.asarray(v, np.float64) for k, v in jax.tree_util.tree_flatten_with_path(params)[0]}
    flat_g = [{path_name(k): np.asarray(v, np.float64) for k, v in jax.tree_util.tree_flatten_with_path(g)[0]}
              for g in grads]
    got = {path_name(k): np.asarray(v) for k, v in jax.tree_util.tree_flatten_with_path(p)[0]}
    assert set(got) == set(MULTS)
    for name, (lr_mult, wd_mult) in MULTS.items():
        w, m, v = flat_p0[name].copy(), 0.0, 0.0
        table = (schedulers.lr_table(schedulers.parse(SCHEDULER), o.lr * lr_mult, STEPS, 0)
                 if lr_mult else np.zeros(STEPS))
        decays = w.ndim >= 2  # optimizer.decay_mask (decay_embeddings=True)
        for t in range(STEPS):
            gt = flat_g[t][name]
            m, v = 0.9 * m + 0.1 * gt, 0.95 * v + 0.05 * gt * gt
            mhat, vhat = m / (1 - 0.9 ** (t + 1)), v / (1 - 0.95 ** (t + 1))
            wd = o.weight_decay * wd_mult if decays else 0.0
            w = w - table[t] * (mhat / (np.sqrt(vhat) + o.eps) + wd * w)
        np.testing.assert_allclose(got[name], w, rtol=2e-6, atol=1e-7, err_msg=name)
    np.testing.assert_array_equal(got["final_norm/weight"], flat_p0["final_norm/weight"])  # frozen


@pytest.mark.parametrize("spec,message", [
    ("*nothing*: wd_mult=0", "the glob '\\*nothing\\*' matches no parameter"),
    ("*norm*: wd_mult=0; final_norm/*: lr_mult=0.5", "parameter 'final_norm/weight' is in more than one group"),
])
def test_globs_are_checked_as_olmo_core_checks_them(spec, message):
    o = dataclasses.replace(OptimConfig(), group_overrides=spec).validate()
    tx, _ = build_optimizer(o, total_steps=4)
    with pytest.raises(ConfigError, match=f"optim.group_overrides: {message}"):
        tx.init(_params(np.random.default_rng(0)))


@pytest.mark.parametrize("spec,message", [
    ("embedding wd_mult=0", "has no 'GLOBS:' part"),
    ("embedding: decay=0", "'decay=0' is not one of lr_mult=X, wd_mult=X"),
    ("embedding: lr_mult=fast", "lr_mult='fast' is not a number"),
    ("embedding: lr_mult=-1", "lr_mult=-1 must be >= 0"),
    ("embedding:", "sets nothing"),
])
def test_bad_group_overrides_name_the_field(spec, message):
    with pytest.raises(ConfigError, match="optim.group_overrides") as err:
        dataclasses.replace(OptimConfig(), group_overrides=spec).validate()
    assert message in str(err.value)
    with pytest.raises(ConfigError, match="optim.name=muon"):
        dataclasses.replace(OptimConfig(), name="muon", group_overrides="embedding: wd_mult=0").validate()


def test_a_run_builds_and_shards_grouped_state(tmp_path):
    cfg = run_config(tmp_path / "run", max_steps=4)
    cfg.optim.group_overrides = "*router*,embedding: wd_mult=0.0; *norm*: lr_mult=0.5"
    run_cfg = config_lib.validate(cfg)
    run = loop._build(run_cfg, Console(quiet=True), True, run_dir_lib.prepare(run_cfg))
    run.checkpoints.close()
    leaves = jax.tree.leaves(run.abstract.opt_state)
    assert leaves and len(jax.tree.leaves(run.shardings.opt_state)) == len(leaves)
