"""Every file in configs/ loads and validates; bad overrides fail fast naming the field."""

import os
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

from olmo_jax import config as config_lib
from olmo_jax.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted(p for p in (ROOT / "configs").glob("*.py") if p.stem != "__init__")


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_every_config_file_loads_and_validates(path):
    cfg = runpy.run_path(str(path))["get_config"]()
    config_lib.validate(cfg)
    model_cfg = config_lib.model_config(cfg, vocab_size=384)
    assert model_cfg.n_layers >= 1
    # Every override path later checks rely on exists.
    for dotted in ("trainer.max_steps", "trainer.seed", "trainer.run_dir",
                   "trainer.global_batch_size", "trainer.seq_len", "trainer.log_every",
                   "model.dtype", "parallel.data", "parallel.expert", "parallel.pipe"):
        node = cfg
        for part in dotted.split("."):
            node = node[part]


def test_unknown_key_error_suggests_the_nearest_field():
    cfg = config_lib.default_config()
    err = config_lib.unknown_key_error(cfg, "trainer.max_step")
    assert "trainer.max_step" in str(err) and "trainer.max_steps" in str(err)


@pytest.mark.parametrize(
    "field,value,match",
    [
        ("trainer.grad_accum", 5, "trainer.grad_accum"),
        ("trainer.expert_counts_every", -1, "trainer.expert_counts_every"),
        ("optim.schedule", "linear", "optim.schedule"),
        ("model.remat", "all", "model.remat"),
        ("trainer.max_steps", 0, "trainer.max_steps"),
    ],
)
def test_validate_names_the_field(field, value, match):
    cfg = config_lib.default_config()
    section, name = field.split(".")
    cfg[section][name] = value
    with pytest.raises(ConfigError, match=match.replace(".", r"\.")):
        config_lib.validate(cfg)


def _run_train(*args, timeout=120):
    env = {**os.environ, "XLA_FLAGS": ""}
    return subprocess.run(
        [sys.executable, "-m", "olmo_jax.train", "--config=configs/tiny.py", *args],
        cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env,
    )


def test_typo_override_fails_fast_naming_the_field():
    r = _run_train("--config.trainer.max_step=5")
    assert r.returncode != 0
    assert "trainer.max_step" in r.stderr and "trainer.max_steps" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


def test_wrong_type_override_fails():
    r = _run_train("--config.trainer.max_steps=abc")
    assert r.returncode != 0 and "trainer.max_steps" in r.stderr, r.stderr


def test_unknown_data_path_names_the_path(tmp_path):
    missing = tmp_path / "nope.npy"
    r = _run_train(f"--config.data.paths={missing}", f"--config.trainer.run_dir={tmp_path}/run")
    assert r.returncode != 0
    assert str(missing) in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_olmoe3_47b_mix_reads_like_an_olmo_run():
    """configs/olmoe3_47b_mix.py: OLMo-core's OLMo-mix-0925-official under gs://ai2-llm and a
    1T-token budget that ends the run, with a token-unit WSD schedule; the mix resolves to
    bucket URLs as OLMo-core's `DataMix.build(base_dir, tokenizer)` joins them."""
    import math

    from olmo_jax.data.mix_file import read_mix

    run = config_lib.validate(runpy.run_path(str(ROOT / "configs/olmoe3_47b_mix.py"))["get_config"]())
    assert run.trainer.binds == "trainer.max_tokens"
    assert run.trainer.total_steps == math.ceil(10**12 / (512 * 8192)) == 238_419
    assert run.data.mix == "OLMo-mix-0925-official" and run.data.mix_root == "gs://ai2-llm"
    assert "units='tokens'" in run.optim.scheduler
    mixes = sorted((ROOT / ".venv-oracle" / "lib").glob("python3*/site-packages/olmo_core/data/mixes"))
    if not mixes:
        pytest.skip("no .venv-oracle with ai2-olmo-core (make oracle) for the shipped mix")
    lines = read_mix(str(mixes[0] / f"{run.data.mix}.txt"), run.data.mix_root,
                     run.data.mix_tokenizer)
    assert len(lines) == 950 and len({m.label for m in lines}) > 10
    assert lines[0].path == ("gs://ai2-llm/preprocessed/dolma3-0625/v0.1-official/"
                             "allenai/dolma3-tokenizer/common_crawl/adult_content/000000.npy")
