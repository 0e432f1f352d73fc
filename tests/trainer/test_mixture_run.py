"""A source mixture (data.sources) through the real training loop: the start-up banner
prints OLMo-core's outcome numbers and mixture.json in the run folder holds them; a run
stopped at step 3 and resumed trains bitwise as one straight run; resuming with a changed
mixture is refused by the loader state, naming the fields, and leaves mixture.json as it was."""

from __future__ import annotations

import json

import numpy as np
import pytest
from rich.console import Console

from olmo_jax import config as config_lib
from olmo_jax.data import write_token_file
from olmo_jax.errors import DataError
from olmo_jax.trainer.loop import train
from tests.trainer.test_train_smoke import smoke_config

STEPS = 6


def mixture_config(tmp_path, run: str, math_ratio: float = 0.3, **trainer):
    rng = np.random.default_rng(0)
    for name, lengths in (("web", [900, 700]), ("math", [300])):
        for k, n in enumerate(lengths):
            path = tmp_path / "tree" / name / f"part-{k}.npy"
            if not path.exists():
                write_token_file(path, rng.integers(0, 256, n), "uint16")
    cfg = smoke_config(tmp_path, steps=STEPS)
    t = cfg.trainer
    t.run_dir = str(tmp_path / run)
    t.eval_every, t.sample_tokens, t.expert_counts_every, t.save_every = 0, 0, 0, 3
    t.seq_len = 32
    cfg.data.eval_fraction = 0.0
    cfg.data.sources = {
        "math": {"paths": str(tmp_path / "tree/math/*.npy"), "target_ratio": math_ratio,
                 "max_repetition_ratio": 2.0},
        "web": {"paths": str(tmp_path / "tree/web/*.npy"), "target_ratio": 1 - math_ratio},
    }
    for k, v in trainer.items():
        (cfg.data if k == "requested_tokens" else t)[k] = v
    return config_lib.validate(cfg)


def losses(run_dir) -> list[float]:
    return [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_mixture_banner_outcome_and_bitwise_resume(tmp_path):
    console = Console(record=True, width=400)
    straight = train(mixture_config(tmp_path, "straight"), console=console)
    run_dir = tmp_path / "straight"
    banner = console.export_text()
    outcome = json.loads((run_dir / "mixture.json").read_text())
    assert outcome["requested_tokens"] == STEPS * 8 * 32  # 0 = the run's max_steps batches
    assert [s["source_name"] for s in outcome["sources"]] == ["math", "web"]
    for s in outcome["sources"]:
        assert f"{s['source_name']}: target {s['target_ratio']:.4g}, population " \
               f"{s['source_population']:,}, selected {s['num_selected']:,}" in banner
    assert f"fingerprint {outcome['fingerprint']}" in banner

    train(mixture_config(tmp_path, "resumed", hard_stop=3), console=Console(quiet=True))
    train(mixture_config(tmp_path, "resumed"), console=Console(quiet=True))
    assert losses(tmp_path / "resumed") == losses(run_dir)  # bitwise, each step once
    assert len(losses(run_dir)) == STEPS and straight.final_loss == losses(run_dir)[-1]

    changed = mixture_config(tmp_path, "resumed", math_ratio=0.25, max_steps=9, overwrite=True,
                             requested_tokens=STEPS * 8 * 32)
    with pytest.raises(DataError, match="data mixture .* data.sources, data.requested_tokens"):
        train(changed, console=Console(quiet=True))
    resumed = json.loads((tmp_path / "resumed" / "mixture.json").read_text())
    assert resumed == outcome  # the refused launch did not overwrite the run's record
