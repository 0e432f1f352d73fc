"""Fixtures of the checkpoint tests: ONE session-scoped oracle launch that builds every
parity case's tiny random OlmoeForCausalLM (with its logits, loss and gradients) and
loads the olmo_jax-initialized models exported with orbax-to-hf."""

from pathlib import Path

import numpy as np
import pytest

from olmo_jax.checkpoint import hf
from olmo_jax.checkpoint import manager as m
from tests.checkpoint.oracle import (
    BASE,
    CASES,
    INPUT_IDS,
    JAX_BORN,
    LOSS_BATCH,
    LOSS_CASE,
    jax_born_model,
    run_oracle,
)


@pytest.fixture(scope="session")
def hf_cases(tmp_path_factory) -> Path:
    """{out}/<case>/hf and logits.npy (plus loss.json and grads.safetensors for LOSS_CASE);
    {out}/<jax_born>/{orbax, hf, jax_logits.npy} and {out}/loaded/<jax_born>/{logits.npy,
    info.json} (what transformers computed and reported loading our export)."""
    out = tmp_path_factory.mktemp("hf_cases")
    dirs = {}
    for i, (name, case) in enumerate(JAX_BORN.items()):
        model = jax_born_model(case, seed=100 + i)
        ckpts = m.Checkpoints(out / name / "orbax", async_save=False)
        config = {
            "config": hf.run_config(model.config),
            "model": m.model_config_to_dict(model.config),
        }
        ckpts.save(
            3,
            model={"params": model.params, "model_state": model.model_state},
            json_items={m.CONFIG: config},
        )
        ckpts.close()
        hf.orbax_to_hf(out / name / "orbax", out / name / "hf")
        np.save(out / name / "jax_logits.npy", np.asarray(model(np.asarray(INPUT_IDS, np.int32))))
        dirs[name] = str(out / name / "hf")
    cases = {
        name: {"config": {**BASE, **overrides}, "seed": seed, **extra}
        for name, (overrides, seed, extra) in CASES.items()
    }
    cases[LOSS_CASE]["batch"] = LOSS_BATCH
    run_oracle({"input_ids": INPUT_IDS, "cases": cases, "dirs": dirs}, out)
    return out
