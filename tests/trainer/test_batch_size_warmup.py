"""Batch-size warmup through the real loop (tests/run_config.py, 8 devices): a run measured
in tokens whose trainer.batch_size_schedule takes it from 8 to 16 sequences a step (the
increase waiting a step for alignment, as OLMo-core's) compiles one step program per size,
logs each step's `batch_size`, trains on as many tokens as the schedule says, and applies
OLMo-core's scheduler to the learning rate rescaled by sqrt(batch /
trainer.global_batch_size); stopped mid-warmup (hard_stop) and resumed, every step's
metrics are bitwise the uninterrupted run's, the pending size change applying after the
resume. The report's summary names the schedule."""

import io
import json
import math
from pathlib import Path

import pytest
from rich.console import Console

from olmo_jax import config as config_lib
from olmo_jax.report import page, sources
from olmo_jax.trainer import loop
from tests.run_config import run_config

SEQ, LR = 32, 1e-2
# 8 sequences; 16 is due at step 2 (256 tokens seen) but waits a step for the position
# (8 sequences) to be a multiple of 16, as OLMo-core's loader does
SCHEDULE = "256@0,512@200"
SIZES = [256, 256, 512, 512]
BUDGET = sum(SIZES)
SCHEDULER = "cos_with_warmup(warmup=512, alpha_f=0.1, units='tokens')"


def _config(run_dir: Path, **trainer):
    cfg = run_config(run_dir, max_steps=0, max_tokens=BUDGET, batch_size_schedule=SCHEDULE, **trainer)
    cfg.optim.scheduler = SCHEDULER
    return config_lib.validate(cfg)


def _records(summary):
    return [json.loads(line) for line in Path(summary.metrics_path).read_text().splitlines()]


def _steps(records):
    timing = {"tokens_per_s", "step_time_s", "tflops_per_device", "mfu"}
    return [{k: v for k, v in r.items() if k not in timing} for r in records]


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    out = io.StringIO()
    summary = loop.train(_config(tmp_path_factory.mktemp("straight") / "run"),
                         console=Console(file=out, width=400))
    return summary, _records(summary), out.getvalue()


def test_each_size_has_its_program_and_the_lr_follows_olmo_core(straight):
    summary, records, banner = straight
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert [r["batch_size"] for r in records] == SIZES
    assert summary.steps == 4 and summary.tokens == BUDGET
    assert "2 step program(s) compiled" in banner, banner
    assert ("batch size schedule (trainer.batch_size_schedule): 256 tokens (8 x 32) from step 1, "
            "512 tokens (16 x 32) from step 3; lr x sqrt(batch / 256 tokens)") in banner, banner
    assert f"duration: 4 steps, {BUDGET:,} tokens; trainer.max_tokens={BUDGET:,} binds" in banner

    # OLMo-core: the scheduler starts from lr x sqrt(batch / 256) (the callback's running
    # product), at the tokens seen after the step's batch, of max_tokens
    def cos_with_warmup(initial, current, warmup=512, t_max=BUDGET):
        eta_min = 0.1 * initial
        if current < warmup:
            return initial * current / warmup
        c, n = current - warmup, t_max - warmup
        return eta_min + (initial - eta_min) * (1 + math.cos(math.pi * c / n)) / 2

    initial = [LR] * 2 + [LR * math.sqrt(2)] * 2
    seen = [sum(SIZES[: k + 1]) for k in range(4)]
    want = [cos_with_warmup(i, t) for i, t in zip(initial, seen, strict=True)]
    assert [r["lr"] for r in records] == pytest.approx(want, rel=1e-6)
    assert records[-1]["loss"] < records[0]["loss"]
    run = sources.load_run(Path(summary.metrics_path).parent)  # the report's summary says it
    rows = dict(page.run_page(run, sources.model_config(run.cfg))["sections"][0]["data"]["run"])
    assert rows["batch"] == f"8 x 32 tokens, grad_accum 1; batch_size_schedule {SCHEDULE}"


def test_resume_mid_warmup_is_bitwise(straight, tmp_path):
    _, want, _ = straight
    run_dir = tmp_path / "run"
    first = loop.train(_config(run_dir, hard_stop=1), console=Console(quiet=True))
    assert first.steps == 1  # 16 is due at the next step, which still waits at 8
    second = loop.train(_config(run_dir), console=Console(quiet=True))
    assert second.steps == 4 and second.tokens == BUDGET
    assert _steps(_records(second)) == _steps(want)  # every field of every step, bitwise
