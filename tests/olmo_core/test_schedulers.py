"""olmo_jax's learning-rate schedulers (optim.scheduler) against OLMo-core's own classes
(ai2-olmo-core in .venv-oracle, by subprocess: one run computes every case's table): each
of OLMo-core's 13 registered schedulers, in steps and in tokens, with warmup / decay given
as counts and as fractions, at every step of a 3,000-step run as OLMo-core's trainer
counts it (1e-9 relative); the optax schedule the train step reads is that table in
float32; a bad scheduler gets OLMo-core's own message, naming the field."""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path

import numpy as np
import pytest

from olmo_jax.errors import ConfigError
from olmo_jax.optim import schedulers
from olmo_jax.optim.config import OptimConfig
from olmo_jax.optim.optimizer import run_schedule

ROOT = Path(__file__).resolve().parents[2]
ORACLE_PY = ROOT / ".venv-oracle" / "bin" / "python"
pytestmark = pytest.mark.skipif(not ORACLE_PY.exists(), reason="no .venv-oracle (make oracle)")

LR, STEPS, TPB = 4e-4, 3000, 512
TOKENS = STEPS * TPB - 100  # a token budget that is not a whole number of steps
CASES = [  # (spec, max_tokens: 0 = max_steps * tokens per step)
    ("constant", 0),
    ("constant_with_warmup(warmup=100)", 0),
    ("constant_with_warmup(warmup_fraction=0.05, warmup_min_lr=1e-5, units='tokens')", TOKENS),
    ("linear_with_warmup(warmup=200, alpha_f=0.0)", 0),
    ("linear_with_warmup(warmup_fraction=0.1, t_max=2500)", 0),
    ("inv_sqrt_with_warmup(warmup=300)", 0),
    ("cos_with_warmup(warmup=100)", 0),
    ("cos_with_warmup(warmup=51200, alpha_f=0.05, units='tokens')", TOKENS),
    ("half_cos_with_warmup(warmup_fraction=0.02)", 0),
    ("cos_with_warmup_and_linear_decay(warmup=100, decay=500, decay_fraction=None)", 0),
    ("cos_with_warmup_and_linear_decay(warmup_fraction=0.01, decay_fraction=0.2, "
     "decay_min_lr=1e-6, units='tokens')", 0),
    ("wsd(warmup=100)", 0),
    ("wsd(warmup_fraction=0.05, decay=358400, decay_fraction=None, warmup_min_lr=1e-5, "
     "decay_min_lr=1e-6, units='tokens')", TOKENS),
    ("wsds(period_lengths=[1000, 1000, 1000], period_lr_multipliers=[1.0, 0.5, 0.25], "
     "warmup=100, decay_fraction=0.1)", 0),
    ("wsds(period_lengths=[800, 1200, 2000], warmup_fraction=0.1, decay=150)", 0),
    ("power_lr(b=-0.51, warmup=100)", 0),
    ("power_lr(b=-0.3, warmup_fraction=0.05, decay=153600, decay_fraction=None, "
     "units='tokens')", 0),
    ("exponential(lr_min=1e-7)", 0),
    ("sequential(schedulers=[constant_with_warmup(warmup=100), cos_with_warmup(warmup=0)], "
     "schedulers_max=[1000])", 0),
    ("sequential(schedulers=[linear_with_warmup(warmup=100, alpha_f=0.5), constant(), "
     "wsd(warmup=0, decay_fraction=0.3)], schedulers_max=[1000, 500, 9999], "
     "override_decay=override_decay(start=2500, duration=300, shape='cosine', end_lr_fraction=0.0))", 0),
    ("composable(stages=[stage(duration=100, start_lr=0.0, end_lr_fraction=1.0), "
     "stage(duration=1500, end_lr_fraction=1.0), "
     "stage(duration=1000, shape='cosine', end_lr_fraction=0.1)])", 0),
    ("composable(stages=[stage(duration=200, start_lr_fraction=0.01, end_lr=2e-3), "
     "stage(duration=2000, shape='cosine', end_lr=1e-4)], "
     "override_decay=override_decay(start=1800, duration=400, end_lr=0.0))", 0),
]
BAD = [  # OLMo-core's validation, each message expected verbatim in ours
    "cos_with_warmup()",
    "wsd(warmup=10, decay=5)",
    "wsd(warmup=10, decay_fraction=1.5)",
    "power_lr(warmup=10, b=0.5)",
    "constant_with_warmup(warmup=10, warmup_fraction=0.1)",
    "wsds(period_lengths=[100], warmup=90, decay=20)",
    "wsds(period_lengths=[], warmup=1, decay=1)",
    "exponential(lr_min=0.0)",
    "sequential(schedulers=[constant(), constant(), constant()], schedulers_max=[10])",
    "composable(stages=[])",
    "composable(stages=[stage(duration=0, end_lr=0.0)])",
    "composable(stages=[stage(duration=10)])",
]


@pytest.fixture(scope="module")
def oracle(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("scheduler_oracle")
    cases = [{"spec": spec, "max_tokens": tokens or STEPS * TPB, "tokens_per_step": TPB,
              "max_steps": math.ceil(tokens / TPB) if tokens else STEPS} for spec, tokens in CASES]
    (tmp / "spec.json").write_text(json.dumps({"lr": LR, "cases": cases, "bad": BAD}))
    subprocess.run([str(ORACLE_PY), str(Path(__file__).with_name("scheduler_oracle.py")),
                    str(tmp / "spec.json"), str(tmp / "out.json")], check=True, cwd=tmp, timeout=300)
    return json.loads((tmp / "out.json").read_text())


def test_every_olmo_core_scheduler_is_covered():
    named = {spec.split("(")[0] for spec, _ in CASES}
    assert named == set(schedulers.SCHEDULERS)


@pytest.mark.parametrize("case", range(len(CASES)), ids=[s.split("(")[0] for s, _ in CASES])
def test_scheduler_equals_olmo_core_at_every_step(oracle, case):
    spec, max_tokens = CASES[case]
    want = np.asarray(oracle["lrs"][case], np.float64)
    steps = len(want)
    got = schedulers.lr_table(schedulers.parse(spec), LR, steps, TPB, max_tokens)
    np.testing.assert_allclose(got, want, rtol=1e-9, atol=0)
    assert len(np.unique(want)) > (1 if spec != "constant" else 0)  # the schedule moves
    # What the train step reads at optimizer step s: OLMo-core's value, in float32.
    schedule = run_schedule(OptimConfig(lr=LR, scheduler=spec), steps, TPB, max_tokens)
    sampled = np.r_[0:5, steps // 2, steps - 2, steps - 1]
    assert [float(schedule(s)) for s in sampled] == [float(np.float32(want[s])) for s in sampled]


def test_bad_scheduler_gets_olmo_cores_message(oracle):
    for spec, message in zip(BAD, oracle["errors"], strict=True):
        assert message is not None, spec
        with pytest.raises(ConfigError, match="optim.scheduler") as err:
            OptimConfig(scheduler=spec).validate()
        assert message.replace("‑", "-") in str(err.value).replace("‑", "-"), (spec, message)


def test_scheduler_spec_errors_name_the_field():
    for spec, words in [("cosine_decay(warmup=1)", "unknown scheduler 'cosine_decay'"),
                        ("wsd(warmup=1, decay_steps=3)", "wsd has no field 'decay_steps'"),
                        ("wsd(1)", "keyword arguments only"),
                        ("wsd(warmup=x)", "not a literal"),
                        ("wsd(warmup=1, units='epochs')", "units='epochs'"),
                        ("cos_with_warmup(warmup=10", "is not a scheduler call")]:
        with pytest.raises(ConfigError, match="optim.scheduler") as err:
            OptimConfig(scheduler=spec).validate()
        assert words in str(err.value), (spec, str(err.value))
