"""Bad input through the command line's error path (`olmo_jax.train.run_training`, what
`python -m olmo_jax.train` runs after parsing flags): each is refused before training
with exit code 2 and ONE `error:` line naming the field or file and the fix, never a
traceback. (Flag-level errors, an unknown or mistyped key and a wrong type, are checked
on the real command line in tests/test_configs.py; the checks themselves have unit tests
next to their modules: tests/model, tests/data, tests/checkpoint, tests/trainer.)"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from olmo_jax import config as config_lib
from olmo_jax.checkpoint import manager as m
from olmo_jax.config import model_config
from olmo_jax.data import write_token_file
from olmo_jax.optim import build_optimizer
from olmo_jax.train import run_training
from olmo_jax.trainer.run_dir import write_config
from olmo_jax.trainer.state import abstract_train_state
from tests.run_config import run_config


def _token_file(path, tokens, dtype="uint16"):
    write_token_file(path, np.asarray(tokens), dtype)
    return str(path)


def _other_model_checkpoint(path):
    """A checkpoint of the test model with d_model 64 instead of 32."""
    cfg = run_config(path)
    cfg.model.d_model = 64
    model_cfg = model_config(cfg, 384)
    _, abstract = abstract_train_state(model_cfg, build_optimizer(cfg.optim, 10)[0])
    state = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), abstract)  # values do not matter
    with m.Checkpoints(path, async_save=False) as ckpts:
        ckpts.save(1, model={"params": state.params, "model_state": state.model_state},
                   json_items={m.CONFIG: {"config": cfg.to_dict(),
                                          "model": m.model_config_to_dict(model_cfg)}})
    return str(path)


def _setup(case, cfg, tmp):
    """Makes `cfg` bad in the way `case` names; returns what the error must contain."""
    model, moe, data, t, par = cfg.model, cfg.model.moe, cfg.data, cfg.trainer, cfg.parallel
    if case == "missing data file":
        data.paths = str(tmp / "nope.npy")
        return [f"data.paths[0]: token file {tmp / 'nope.npy'} does not exist", "python -m olmo_jax.tokenize"]
    if case == "file size not a multiple of the dtype":
        (tmp / "odd.npy").write_bytes(b"\x01\x00\x02\x00\x03")
        data.paths = str(tmp / "odd.npy")
        return ["has 5 bytes, not a whole number of uint16 tokens", "truncated"]
    if case == "token outside the vocabulary":
        data.paths = _token_file(tmp / "big.npy", [5] * 1000 + [1000] + [5] * 1000)
        return ["token 1000 at offset 1000 is >= vocab_size 384", "data.vocab_size"]
    if case == "heads not dividing d_model":
        model.n_heads = 3
        return ["model.n_heads=3 does not divide model.d_model=32", "model.head_dim"]
    if case == "kv heads not dividing heads":
        model.n_kv_heads = 3
        return ["model.n_kv_heads=3 must divide model.n_heads=2"]
    if case == "top_k above num_experts":
        moe.top_k = 9
        return ["model.moe.top_k=9 must be between 1 and model.moe.num_experts=8"]
    if case == "experts not divisible by the expert axis":
        moe.num_experts = 6
        return ["model.moe.num_experts=6 is not divisible by parallel.expert=8", "choose parallel.expert"]
    if case == "mesh not matching the devices":
        par.data = 3
        return ["1 x 3 x 1 x 8 = 24 does not match the 8 available devices", "-1 to fill"]
    if case == "checkpoint of another model shape":
        t.init_from = _other_model_checkpoint(tmp / "other")
        return ["was written with model.d_model=64 but this run has model.d_model=32",
                "--config.model.d_model=64"]
    if case == "unwritable run_dir":
        (tmp / "file").write_text("")
        t.run_dir = str(tmp / "file" / "run")
        return [f"trainer.run_dir={tmp / 'file' / 'run'} cannot be written to"]
    if case == "run_dir holding another run":
        (tmp / "run").mkdir()
        write_config(tmp / "run", config_lib.parse(run_config(tmp / "run")))
        cfg.optim.b2 = 0.99
        return ["holds a run with a different config", "optim.b2: 0.95 -> 0.99",
                "--config.trainer.overwrite=True"]
    raise AssertionError(case)


CASES = [
    "missing data file", "file size not a multiple of the dtype", "token outside the vocabulary",
    "heads not dividing d_model", "kv heads not dividing heads", "top_k above num_experts",
    "experts not divisible by the expert axis", "mesh not matching the devices",
    "checkpoint of another model shape", "unwritable run_dir", "run_dir holding another run",
]


@pytest.mark.parametrize("case", CASES)
def test_bad_input_is_one_clear_error(case, tmp_path, capsys):
    cfg = run_config(tmp_path / "run")
    expected = _setup(case, cfg, tmp_path)
    assert run_training(cfg) == 2
    out = capsys.readouterr()
    lines = out.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), out.err
    for text in expected:
        assert text in lines[0], (text, lines[0])
    assert "Traceback" not in out.err + out.out
    ckpts = tmp_path / "run" / "checkpoints"
    assert not ckpts.exists() or not any(ckpts.iterdir())  # refused before training
