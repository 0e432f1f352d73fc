"""Muon through the real training loop on 8 devices (data=2 x expert=4, ZeRO-1: the
momentum stored split, Newton-Schulz on each matrix's owner): 8 steps straight equal, bit
for bit, 4 steps (hard stop, checkpoint of the params, Muon's momentum and AdamW's
moments) then a resume to 8."""

import json
from pathlib import Path

import numpy as np
import pytest

from olmo_jax import config as config_lib
from olmo_jax.trainer.loop import train
from tests.run_config import run_config


def _cfg(run_dir: Path, **trainer):
    cfg = run_config(run_dir, max_steps=8, save_every=4, **trainer)
    cfg.parallel.data, cfg.parallel.expert = 2, 4
    cfg.optim.name = "muon"
    return cfg


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_muon_resume_is_bitwise(tmp_path, compile_cache):
    straight = train(config_lib.validate(_cfg(tmp_path / "straight")))
    run = tmp_path / "run"
    train(config_lib.validate(_cfg(run, hard_stop=4)))
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["4"]
    resumed = train(config_lib.validate(_cfg(run)))
    a, b = _records(tmp_path / "straight"), _records(run)
    assert [r["step"] for r in b] == list(range(1, 9))
    for x, y in zip(a, b, strict=True):
        assert x["loss"] == y["loss"] and x["grad_norm"] == y["grad_norm"], (x, y)
    assert resumed.final_loss == straight.final_loss
    assert np.isfinite(straight.final_loss) and a[-1]["loss"] < a[0]["loss"]
