"""Durations and the data seed through the real loop: a run measured in tokens
(trainer.max_tokens, with max_steps=0) stops after ceil(max_tokens / tokens per step) steps,
says in its banner that max_tokens binds, and applies a token-unit OLMo-core scheduler
(optim.scheduler) step by step; data.seed fixes the data order while trainer.seed changes
the init; bad values name the field."""

import io
import json
import math
from pathlib import Path

import numpy as np
import pytest
from rich.console import Console

from olmo_jax import config as config_lib
from olmo_jax.errors import ConfigError
from olmo_jax.trainer import loop
from olmo_jax.trainer import run_dir as run_dir_lib
from tests.run_config import run_config
from tests.trainer.test_train_smoke import smoke_config

LR, TPB = 1e-2, 8 * 32  # run_config: 8 sequences of 32 tokens a step


def test_a_token_budget_ends_the_run_and_drives_a_token_scheduler(tmp_path):
    cfg = run_config(tmp_path / "run", max_steps=0, max_tokens=4 * TPB - 100)  # 4 steps,
    t = cfg.trainer  # the last one partly over budget
    cfg.optim.lr = LR
    cfg.optim.scheduler = f"cos_with_warmup(warmup={2 * TPB}, alpha_f=0.1, units='tokens')"
    out = io.StringIO()
    summary = loop.train(config_lib.validate(cfg), console=Console(file=out, width=400))
    banner = out.getvalue()
    assert f"duration: 4 steps x {TPB} tokens" in banner, banner
    assert f"trainer.max_tokens={t.max_tokens:,} binds" in banner, banner
    records = [json.loads(line) for line in Path(summary.metrics_path).read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4] and summary.steps == 4

    # OLMo-core's CosWithWarmup by hand: current = tokens seen after the step's batch,
    # t_max = max_tokens (tests/olmo_core/test_schedulers.py checks the class itself).
    def cos_with_warmup(current, warmup=2 * TPB, t_max=t.max_tokens, eta_min=0.1 * LR):
        if current < warmup:
            return LR * current / warmup
        if current >= t_max:
            return eta_min
        c, n = current - warmup, t_max - warmup
        return eta_min + (LR - eta_min) * (1 + math.cos(math.pi * c / n)) / 2

    want = [cos_with_warmup(k * TPB) for k in (1, 2, 3, 4)]
    assert [r["lr"] for r in records] == pytest.approx(want, rel=1e-6)
    assert want[:2] == pytest.approx([LR / 2, LR]) and LR > want[2] > want[3]
    assert want[3] == pytest.approx(0.1 * LR)  # past max_tokens: alpha_f x lr


def test_data_seed_fixes_the_order_apart_from_the_init(tmp_path):
    def built(name, trainer_seed, data_seed):
        cfg = smoke_config(tmp_path / name, steps=4)
        cfg.trainer.seed, cfg.data.seed = trainer_seed, data_seed
        run_cfg = config_lib.validate(cfg)
        run = loop._build(run_cfg, Console(quiet=True), True, run_dir_lib.prepare(run_cfg))
        run.checkpoints.close()
        return run.data.train

    a, b = built("a", 1, 7), built("b", 2, 7)
    default, other = built("c", 1, -1), built("d", 7, -1)
    assert (a.seed, b.seed, default.seed) == (7, 7, 1)  # -1 (default): trainer.seed
    for step in range(3):
        np.testing.assert_array_equal(a.batch(step), b.batch(step))
        np.testing.assert_array_equal(a.batch(step), other.batch(step))  # data seed 7 either way
    assert not np.array_equal(a.batch(0), default.batch(0))


@pytest.mark.parametrize("field,value,message", [
    ("trainer.max_tokens", -1, "trainer.max_tokens must be >= 0"),
    ("trainer.max_steps", 0, "0 = no step limit needs trainer.max_tokens > 0"),
    ("data.seed", -2, r"data.seed must be >= 0, or -1 \(= trainer.seed\)"),
])
def test_bad_durations_and_seeds_name_the_field(field, value, message):
    cfg = config_lib.default_config()
    config_lib.set_path(cfg, field, value)
    with pytest.raises(ConfigError, match=message):
        config_lib.validate(cfg)


def test_which_limit_binds():
    t = config_lib.defaults().trainer  # 32 x 256 = 8,192 tokens a step, 100 steps
    steps = config_lib.defaults().with_values({"trainer.max_tokens": 50 * 8192 + 1}).trainer
    assert (steps.total_steps, steps.binds, steps.budget_tokens) == (51, "trainer.max_tokens", 50 * 8192 + 1)
    more = t.__class__(**{**t.__dict__, "max_tokens": 10**9})
    assert (more.total_steps, more.binds, more.budget_tokens) == (100, "trainer.max_steps", 100 * 8192)
    assert "trainer.max_steps=100 binds before trainer.max_tokens" in more.duration_line()
    with pytest.raises(ConfigError, match="hard_stop=60 must be below the 51 steps of trainer.max_tokens"):
        config_lib.defaults().with_values({"trainer.max_tokens": 50 * 8192 + 1, "trainer.hard_stop": 60})
