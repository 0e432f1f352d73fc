"""The metric sinks with the real libraries: records written through `build_sinks` are read
back from metrics.jsonl, from the TensorBoard event files by tensorboard's own
EventAccumulator, and from the W&B offline run's .wandb file (tests/trainer/wandb_file.py),
with the same steps and values; per-expert counts come back as histograms; the resolved
config is logged; a resumed run's TensorBoard view drops the steps logged after the
checkpoint; processes other than 0 write nothing; bad trainer.loggers are refused."""

import json

import numpy as np
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from olmo_jax.config import default_config, validate
from olmo_jax.errors import ConfigError
from olmo_jax.trainer.sinks import build_sinks
from tests.trainer import wandb_file


@pytest.fixture(autouse=True)
def _no_network(monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_ERROR_REPORTING", "false")


def sink_config(run_dir, loggers="jsonl,tensorboard,wandb"):
    cfg = default_config()
    cfg.trainer.run_dir, cfg.trainer.loggers = str(run_dir), loggers
    return validate(cfg)


def sinks_of(cfg, run_dir, *args, **kw):
    return build_sinks(cfg.trainer, cfg.to_dict(), run_dir, *args, **kw)


def fake_records(steps, offset=0.0):
    rng = np.random.default_rng(len(steps) + int(offset))
    return [{"step": s, "loss": float(5 - s / 7 + offset), "lr": float(rng.uniform()),
             "eval/wiki/loss": float(rng.uniform(2, 4)), "tokens_per_s": float(rng.uniform(1e3, 1e5))}
            for s in steps]


def tensorboard(run_dir) -> EventAccumulator:
    acc = EventAccumulator(str(run_dir / "tensorboard"),
                           size_guidance={"scalars": 0, "histograms": 0, "tensors": 0})
    acc.Reload()
    return acc


def test_every_sink_gets_the_same_steps_values_counts_and_config(tmp_path):
    cfg = sink_config(tmp_path)
    sinks = sinks_of(cfg, tmp_path, first_block=1, resume_step=None, main=True)
    records = fake_records(range(1, 7))
    counts = {3: np.array([[10, 0, 5, 1], [4, 4, 4, 4]]), 6: np.array([[1, 2, 3, 10], [0, 0, 16, 0]])}
    for r in records:
        sinks.scalars(r["step"], r)
        if r["step"] in counts:
            sinks.expert_counts(r["step"], [1, 2], counts[r["step"]])
    # Flushed at every logged step: the event file already holds step 6.
    assert tensorboard(tmp_path).Scalars("loss")[-1].step == 6
    sinks.close()

    jsonl = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert jsonl == records
    acc = tensorboard(tmp_path)
    history = wandb_file.history(wandb_file.run_file(tmp_path))
    for key in ("loss", "lr", "eval/wiki/loss", "tokens_per_s"):
        events = acc.Scalars(key)
        assert [e.step for e in events] == [r["step"] for r in jsonl]
        assert [e.value for e in events] == [np.float32(r[key]) for r in jsonl]  # float32 summaries
        assert [history[r["step"]][key] for r in jsonl] == [r[key] for r in jsonl]  # exact

    for step, counts_LE in counts.items():
        for block, counts_E in zip([1, 2], counts_LE, strict=True):
            (h,) = [e for e in acc.Histograms(f"expert_counts/block{block}") if e.step == step]
            assert h.histogram_value.bucket == list(counts_E)  # bucket e = expert e
            assert h.histogram_value.bucket_limit == [0.5, 1.5, 2.5, 3.5]
            assert h.histogram_value.num == counts_E.sum()
            assert history[step][f"expert_counts/block{block}/values"] == list(counts_E)
            assert history[step][f"expert_counts/block{block}/bins"] == [-0.5, 0.5, 1.5, 2.5, 3.5]
    (config_event,) = acc.Tensors("config")
    text = config_event.tensor_proto.string_val[0].decode()
    as_json = json.loads(json.dumps(cfg.to_dict()))  # what JSON keeps: tuples become lists
    assert json.loads(text.removeprefix("```json\n").removesuffix("\n```")) == as_json
    assert wandb_file.config(wandb_file.run_file(tmp_path)) == as_json
    assert (tmp_path / "expert_counts.jsonl").read_text().count("\n") == 2


def test_resumed_tensorboard_drops_steps_after_the_checkpoint(tmp_path):
    cfg = sink_config(tmp_path, "jsonl,tensorboard")
    first = sinks_of(cfg, tmp_path, 1, None, main=True)
    for r in fake_records(range(1, 9)):  # the lost process got to step 8
        first.scalars(r["step"], r)
    first.close()
    resumed = sinks_of(cfg, tmp_path, 1, resume_step=5, main=True)  # resumed from checkpoint 5
    again = fake_records(range(6, 11), offset=100.0)
    for r in again:
        resumed.scalars(r["step"], r)
    resumed.close()
    events = tensorboard(tmp_path).Scalars("loss")
    assert [e.step for e in events] == list(range(1, 11))
    want = [np.float32(r["loss"]) for r in fake_records(range(1, 9))[:5] + again]
    assert [e.value for e in events] == want


def test_only_process_zero_writes(tmp_path):
    sinks = sinks_of(sink_config(tmp_path), tmp_path, 1, None, main=False)
    sinks.scalars(1, fake_records([1])[0])
    sinks.expert_counts(1, [1], np.ones((1, 4)))
    sinks.close()
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("loggers,message", [
    ("jsonl,tensorbord", "unknown logger 'tensorbord'; choose from jsonl, tensorboard, wandb"),
    ("tensorboard", "must include jsonl"),
])
def test_bad_loggers_name_the_field(tmp_path, loggers, message):
    with pytest.raises(ConfigError, match=f"trainer.loggers.*{message}"):
        sink_config(tmp_path, loggers)


def test_a_missing_library_names_the_extra(tmp_path, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name == "wandb" else real(name))
    with pytest.raises(ConfigError, match=r"the wandb package is not installed; pip install 'olmo-jax\[wandb\]'"):
        sink_config(tmp_path)


def test_wandb_disabled_writes_no_run(tmp_path):
    cfg = sink_config(tmp_path).with_values({"trainer.wandb.mode": "disabled"})
    sinks = sinks_of(cfg, tmp_path, 1, None, main=True)
    sinks.scalars(1, fake_records([1])[0])
    sinks.close()
    assert not (tmp_path / "wandb").exists() and (tmp_path / "tensorboard").is_dir()
