"""One real run with everything around it switched on: trainer.loggers=jsonl,tensorboard,wandb,
trainer.profile_steps=2:4, two named eval sets (data.eval_sets), per-expert counts.

- TensorBoard (read by EventAccumulator) and the W&B offline run (its .wandb file) hold
  every scalar of metrics.jsonl at the same steps, with the same values;
- a jax.profiler trace is in {run_dir}/profile, non-empty, its StepTraceAnnotations are
  exactly steps 2 and 3;
- each named set is logged as eval/<name>/loss and eval/<name>/perplexity at each eval
  step, and the last one equals a plain single-device float32 forward pass of the saved
  model over the same batch (the run evaluated it sharded over 8 devices);
- the startup banner states the default split.
"""

import io
import json
import math
import sysconfig
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from rich.console import Console
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from olmo_jax import config as config_lib
from olmo_jax.checkpoint import hf
from olmo_jax.data import ByteTokenizer, build_data, write_token_file
from olmo_jax.objective import forward_losses
from olmo_jax.trainer.loop import train
from tests.trainer import wandb_file
from tests.trainer.test_train_smoke import smoke_config


def text_token_file(path: Path, *stdlib_files: str) -> str:
    root = Path(sysconfig.get_paths()["stdlib"])
    text = "".join((root / f).read_text() for f in stdlib_files)
    write_token_file(path, np.asarray(ByteTokenizer().encode(text)), "uint16")
    return str(path)


@pytest.fixture(autouse=True)
def _no_network(monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_ERROR_REPORTING", "false")


@pytest.mark.filterwarnings("ignore:builtin type event_stats:DeprecationWarning")
def test_a_run_with_every_sink_the_profiler_and_named_eval_sets(tmp_path):
    cfg = smoke_config(tmp_path, steps=6)
    t = cfg.trainer
    t.log_every, t.eval_every, t.expert_counts_every, t.sample_tokens = 2, 3, 3, 0
    t.loggers, t.profile_steps = "jsonl,tensorboard,wandb", "2:4"
    cfg.data.eval_sets = {
        "json": text_token_file(tmp_path / "json.npy", "json/decoder.py"),
        "text": ",".join([text_token_file(tmp_path / "a.npy", "textwrap.py"),
                          text_token_file(tmp_path / "b.npy", "shlex.py")]),
    }
    out = io.StringIO()
    train(config_lib.validate(cfg), console=Console(file=out, width=400))
    run_dir = Path(t.run_dir)
    banner = out.getvalue()
    assert "eval_loss on the default split:" in banner and "data.eval_fraction" in banner, banner
    assert "eval/json/loss on" in banner and "json.npy" in banner

    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 6]
    for r in records:
        has_eval = r["step"] in (3, 6)
        for name in ("json", "text"):
            assert (f"eval/{name}/loss" in r) == has_eval
            if has_eval:
                assert math.isclose(r[f"eval/{name}/perplexity"], math.exp(r[f"eval/{name}/loss"]),
                                    rel_tol=1e-12)
    assert records[-1]["eval/json/loss"] != records[-1]["eval/text/loss"]

    # TensorBoard and W&B: every metrics.jsonl scalar, same steps, same values.
    acc = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0, "histograms": 0})
    acc.Reload()
    history = wandb_file.history(wandb_file.run_file(run_dir))
    keys = {k for r in records for k in r} - {"step"}
    assert keys <= set(acc.Tags()["scalars"]), keys - set(acc.Tags()["scalars"])
    for key in keys:
        logged = [r for r in records if key in r]
        events = acc.Scalars(key)
        assert [e.step for e in events] == [r["step"] for r in logged], key
        assert [e.value for e in events] == [np.float32(r[key]) for r in logged], key
        assert [history[r["step"]][key] for r in logged] == [r[key] for r in logged], key
    counts = [json.loads(line) for line in (run_dir / "expert_counts.jsonl").read_text().splitlines()]
    histograms = acc.Histograms("expert_counts/block1")
    assert [h.step for h in histograms] == [c["step"] for c in counts] == [3, 6]
    for h, c in zip(histograms, counts, strict=True):
        assert h.histogram_value.bucket == c["counts"][0]
        assert history[c["step"]]["expert_counts/block1/values"] == c["counts"][0]

    # The profile: non-empty, readable, annotated with exactly the steps asked for.
    from jax.profiler import ProfileData

    (xplane,) = run_dir.glob("profile/plugins/profile/*/*.xplane.pb")
    assert xplane.stat().st_size > 0
    steps = {int(dict(e.stats)["step_num"]) for plane in ProfileData.from_file(str(xplane)).planes
             for line in plane.lines for e in line.events if e.name == "train"}
    assert steps == {2, 3}

    # The named set's last eval loss = one device, float32, no sharding, the saved model.
    model = hf.load_checkpoint(run_dir)
    data = build_data(config_lib.parse(cfg).data, t.seq_len, t.global_batch_size, t.seed, t.cache_dir)
    batch = jnp.asarray(data.eval_sets["text"].batch(0))
    parts = forward_losses(model.graphdef, model.params, model.model_state, batch, model.config)
    expected = float(parts.ce_sum / parts.n_tokens)
    assert abs(records[-1]["eval/text/loss"] - expected) <= 1e-5 * expected


@pytest.mark.parametrize("field,value,message", [
    ("trainer.profile_steps", "5", r"trainer.profile_steps='5' is not START:END; write it as START:END"),
    ("trainer.profile_steps", "4:4", r"trainer.profile_steps='4:4': need 1 <= START < END"),
    ("trainer.profile_steps", "0:3", r"trainer.profile_steps='0:3': need 1 <= START < END"),
    ("trainer.wandb.mode", "offlne", r"trainer.wandb.mode='offlne': choose one of online, offline, disabled"),
    ("data.prefetch", -1, r"data.prefetch must be >= 0"),
])
def test_bad_observability_fields_name_the_field(field, value, message):
    from olmo_jax.config import default_config, validate
    from olmo_jax.errors import ConfigError

    cfg = default_config()
    section, *rest = field.split(".")
    node = cfg[section]
    for part in rest[:-1]:
        node = node[part]
    node[rest[-1]] = value
    with pytest.raises(ConfigError, match=message):
        validate(cfg)
