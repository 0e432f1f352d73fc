"""The run folder: unwritable folders are refused; a folder holding a run with another
config is refused unless trainer.overwrite (then the old config is kept aside); launches
of the same run that change only how it runs are accepted."""

import json

import pytest

from olmo_jax import config as config_lib
from olmo_jax.errors import ConfigError
from olmo_jax.trainer import run_dir
from tests.run_config import run_config


def test_unwritable_run_dir_names_the_field(tmp_path):
    (tmp_path / "a_file").write_text("")
    cfg = run_config(tmp_path / "a_file" / "run")  # a folder inside a file: never writable
    with pytest.raises(ConfigError, match=r"trainer.run_dir=.*a_file/run cannot be written to"):
        run_dir.prepare(config_lib.parse(cfg))


def test_a_different_run_is_refused_unless_overwrite(tmp_path):
    first = run_config(tmp_path / "run")
    folder = run_dir.prepare(config_lib.parse(first))
    run_dir.write_config(folder, config_lib.parse(first))
    # The same run, launched again with other run-time settings: accepted.
    again = run_config(tmp_path / "run", hard_stop=7, log_every=5, grad_accum=2, peer_timeout_s=9.0)
    again.parallel.data, again.parallel.expert, again.model.dtype = 2, 4, "bfloat16"
    assert run_dir.prepare(config_lib.parse(again)) == folder
    # Another run: refused, naming every differing field with both values.
    other = run_config(tmp_path / "run", seed=3)
    other.optim.lr = 1e-3
    with pytest.raises(ConfigError) as err:
        run_dir.prepare(config_lib.parse(other))
    msg = str(err.value)
    assert "holds a run with a different config" in msg
    assert "optim.lr: 0.01 -> 0.001" in msg and "trainer.seed: 0 -> 3" in msg
    assert "--config.trainer.overwrite=True" in msg
    other.trainer.overwrite = True
    assert run_dir.prepare(config_lib.parse(other)) == folder
    run_dir.write_config(folder, config_lib.parse(other))
    kept = list(folder.glob("config.replaced-*.json"))
    assert len(kept) == 1 and json.loads(kept[0].read_text())["optim"]["lr"] == 0.01
    assert json.loads((folder / "config.json").read_text())["optim"]["lr"] == 1e-3


def test_unreadable_config_json(tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match=r"config.json .* cannot be read"):
        run_dir.prepare(config_lib.parse(run_config(tmp_path / "run")))
