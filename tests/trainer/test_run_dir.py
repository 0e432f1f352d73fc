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


def test_one_owner_and_a_refused_launch_leaves_nothing(tmp_path):
    """The owner's lock refuses a second owner naming its pid (a second open file in this
    very process is refused as another process would be); a refused launch removes the
    folders it created, only empty ones."""
    import os
    import socket

    cfg = config_lib.parse(run_config(tmp_path / "new" / "run"))
    owner = run_dir.RunFolder(cfg, main=True)
    assert f"pid {os.getpid()} on host {socket.gethostname()}" in (
        owner.path / run_dir.LOCK_FILE).read_text()
    with pytest.raises(ConfigError, match=rf"trainer.run_dir=.*new/run is in use by another "
                                          rf"trainer \(pid {os.getpid()} on host"):
        run_dir.RunFolder(cfg, main=True)
    reader = run_dir.RunFolder(cfg, main=False)  # not process 0: no lock
    reader.release(refused=True)
    (owner.path / "checkpoints").mkdir()
    owner.release(refused=True)
    assert not (tmp_path / "new").exists()

    (tmp_path / "kept").mkdir()
    cfg = config_lib.parse(run_config(tmp_path / "kept" / "run"))
    owner = run_dir.RunFolder(cfg, main=True)
    (owner.path / "metrics.jsonl").write_text("")
    owner.release(refused=True)  # a file it did not make: the folder stays
    assert (owner.path / "metrics.jsonl").is_file()
    run_dir.RunFolder(cfg, main=True).release()  # the lock was dropped
