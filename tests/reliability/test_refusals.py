"""Bad input refused before anything runs: one `error:` line naming the file or field and
the fix, exit code 2, no traceback, and nothing left behind (the run folder a refused
launch would have created does not exist afterwards). The commands run at once, in
parallel: none of them trains or compiles."""

import json

import numpy as np
import pytest

from tests.checkpoint.oracle import BASE
from tests.reliability.conftest import finish, one_error_line, start, tiny_args


def _cases(tmp) -> dict:
    """{name: (command args, module, expected parts of the error line, folder that must not
    exist afterwards)}."""
    missing = tmp / "no_such_config.py"
    broken = tmp / "broken.py"
    broken.write_text("def get_config(:\n    pass\n")
    tokens_dir = tmp / "shards"
    tokens_dir.mkdir()
    hf = tmp / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps(
        {**BASE, "model_type": "olmoe", "architectures": ["OlmoeForCausalLM"]}))
    from safetensors.numpy import save_file

    shard = hf / "model.safetensors"
    save_file({"model.embed_tokens.weight": np.zeros((BASE["vocab_size"], 32), np.float32)}, str(shard))
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    run_dir = tmp / "refused" / "run"
    tokens = tmp / "tokens.npy"
    tokens.write_bytes(np.zeros(4096, np.uint16).tobytes())
    args = tiny_args(run_dir, tokens)
    return {
        "missing config": ([f"--config={missing}", *args[1:]], "olmo_jax.train",
                           [f"--config={missing}: no such file"], run_dir),
        "syntax error": ([f"--config={broken}", *args[1:]], "olmo_jax.train",
                         [f"syntax error in {broken}, line 1"], run_dir),
        "long warmup": ([*args, "--config.optim.warmup_steps=30"], "olmo_jax.train",
                        ["optim.warmup_steps=30 is longer than the run (trainer.max_steps: 6 steps)",
                         "--config.optim.shorten_warmup=True"], run_dir),
        "directory in data.paths": (tiny_args(run_dir, tokens_dir), "olmo_jax.train",
                                    [f"data.paths[0]: {tokens_dir} is a directory"], run_dir),
        "truncated safetensors": (["hf-to-orbax", "--hf", str(hf), "--out", str(tmp / "out")],
                                  "olmo_jax.convert",
                                  [f"safetensors file {shard} is truncated or corrupt"],
                                  tmp / "out"),
    }


@pytest.fixture(scope="module")
def refused(tmp_path_factory, compile_cache):
    tmp = tmp_path_factory.mktemp("refusals")
    cases = _cases(tmp)
    procs = {name: start(a, compile_cache, module) for name, (a, module, _, _) in cases.items()}
    return {name: (finish(p), cases[name]) for name, p in procs.items()}


@pytest.mark.parametrize("name", ["missing config", "syntax error", "long warmup",
                                  "directory in data.paths", "truncated safetensors"])
def test_bad_input_is_one_error_line_and_leaves_nothing(refused, name):
    proc, (_, _, parts, folder) = refused[name]
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-4000:]
    line = one_error_line(proc)
    for part in parts:
        assert part in line, line
    assert not folder.exists(), sorted(folder.parent.rglob("*"))


def test_a_run_file_that_cannot_be_written_is_a_storage_error(monkeypatch, capsys):
    """A write failing for the storage's sake outside a checkpoint (metrics, config.json)
    is one `error:` line naming the file, exit 74; any other OSError stays a crash."""
    import errno

    from olmo_jax import cli, train
    from olmo_jax.trainer import loop

    def full(cfg):
        raise OSError(errno.ENOSPC, "No space left on device", "/runs/x/metrics.jsonl")

    monkeypatch.setattr(train.config_lib, "validate", lambda cfg: cfg)
    monkeypatch.setattr(loop, "train", full)
    assert train.run_training(None) == cli.EXIT_STORAGE == 74
    err = capsys.readouterr().err
    assert err.startswith("error: cannot write /runs/x/metrics.jsonl: No space left on device"), err

    def missing(cfg):
        raise FileNotFoundError(errno.ENOENT, "No such file or directory", "/nowhere")

    monkeypatch.setattr(loop, "train", missing)
    with pytest.raises(FileNotFoundError):
        train.run_training(None)
