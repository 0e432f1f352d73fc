"""data.sources through build_data (no oracle: tests/olmo_core/test_mixture.py holds the
selection against OLMo-core): it composes with the loader as it is (the repetition filter,
the plus_one layout, the eval split, per-process rows), its selection is recorded in the
loader state and a changed one is refused naming the fields; config errors name the field."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from olmo_jax import config as config_lib
from olmo_jax.data import BatchLoader, build_data, write_token_file
from olmo_jax.data.mixture import parse_sources
from olmo_jax.errors import ConfigError, DataError
from olmo_jax.labels import FILTERED

SEQ_LEN, B, VOCAB = 16, 4, 8000


@pytest.fixture(scope="module")
def tree(tmp_path_factory) -> Path:
    """web/part-k: tokens 1000k + arange (k = 0..2); code/part-k: 5000 + 1000k + arange,
    the first 32 tokens of code/part-0 one repeated token (the filter drops them)."""
    root = tmp_path_factory.mktemp("tree")
    for k, n in enumerate([200, 333, 150]):
        write_token_file(root / f"web/part-{k}.npy", 1000 * k + np.arange(n), "uint16")
    for k, n in enumerate([100, 90]):
        tokens = 5000 + 1000 * k + np.arange(n)
        if k == 0:
            tokens[:32] = 5999
        write_token_file(root / f"code/part-{k}.npy", tokens, "uint16")
    return root


def sources(root: Path, code_ratio: float = 0.4) -> dict:
    return {"code": {"paths": str(root / "code/*.npy"), "target_ratio": code_ratio,
                     "max_repetition_ratio": 2.0},
            "web": {"paths": [str(root / "web/*.npy")], "target_ratio": 1 - code_ratio}}


def data(root: Path, **extra):
    cfg = {"sources": sources(root), "requested_tokens": 40 * SEQ_LEN, "vocab_size": VOCAB,
           **extra}
    return build_data(cfg, SEQ_LEN, B, seed=3)


def test_windows_are_the_mixture_instances(tree):
    d = data(tree)
    m = d.mixture
    assert m.total_tokens == 40 * SEQ_LEN == len(d.windows) * SEQ_LEN
    code = next(s for s in m.sources if s.source.name == "code")
    assert code.num_selected == int(40 * SEQ_LEN * 0.4) and code.tokens > code.population
    rows = d.windows.read(np.arange(len(d.windows)))[:, :-1]
    starts = [(path, t) for path, tokens in m.entries() for t in range(0, tokens, SEQ_LEN)]
    for row, (path, t) in zip(rows, starts, strict=True):  # each entry: its file's prefix
        np.testing.assert_array_equal(row, np.fromfile(path, np.uint16)[t:t + SEQ_LEN])
    # The loader state records the selection; the outcome is OLMo-core's table plus files.
    assert d.train.state_dict()["mixture"] == m.fingerprint()
    out = m.outcome()
    assert [s["source_name"] for s in out["sources"]] == ["code", "web"]
    assert sum(s["final_tokens"] for s in out["sources"]) == out["total_tokens"]
    assert "code: target 0.4" in m.describe()


def test_composes_with_filter_layout_split_and_rows(tree):
    filtered = data(tree, repetition_filter=True, repetition_max_count=16)
    rows = filtered.windows.read(np.arange(len(filtered.windows)))
    n_code0 = sum(t // SEQ_LEN for p, t in filtered.mixture.entries() if p.endswith("code/part-0.npy"))
    assert 0 < (rows[:, -1] == FILTERED).sum() <= n_code0  # the repeated stretch, each pass

    plus_one = data(tree, instances="plus_one")
    assert len(plus_one.windows) == len(filtered.windows)  # one token past each entry is read
    first = plus_one.windows.window(0)
    path, _ = plus_one.mixture.entries()[0]
    np.testing.assert_array_equal(first, np.fromfile(path, np.uint16)[:SEQ_LEN + 1])

    split = data(tree, eval_fraction=0.2)
    assert split.train.n_windows + split.eval.n_windows == len(split.windows)
    full = split.train.batch(2)
    np.testing.assert_array_equal(split.train.batch(2, rows=slice(1, 3)), full[1:3])


def test_resume_refuses_a_changed_mixture(tree):
    d = data(tree)
    d.train.step = 5
    state = d.train.state_dict()
    same = data(tree)
    same.train.load_state_dict(state)
    assert same.train.step == 5
    np.testing.assert_array_equal(same.train.batch(5), d.train.batch(5))
    changed = build_data({"sources": sources(tree, code_ratio=0.35),
                          "requested_tokens": 40 * SEQ_LEN, "vocab_size": VOCAB}, SEQ_LEN, B, seed=3)
    with pytest.raises(DataError, match="data mixture .* data.sources, data.requested_tokens or data.mix"):
        changed.train.load_state_dict(state)
    plain = BatchLoader(d.windows, np.arange(len(d.windows)), B, 3)  # no mixture
    with pytest.raises(DataError, match="data mixture"):
        plain.load_state_dict(state)
    plain.load_state_dict({k: v for k, v in plain.state_dict().items() if k != "mixture"})


def test_budget_and_errors_name_the_field(tree):
    cfg = {"sources": sources(tree), "vocab_size": VOCAB}
    d = build_data(cfg, SEQ_LEN, B, seed=0, run_tokens=3 * B * SEQ_LEN)  # 0 = the run's tokens
    assert d.mixture.requested_tokens == 3 * B * SEQ_LEN
    with pytest.raises(DataError, match="set data.requested_tokens"):
        build_data(cfg, SEQ_LEN, B, seed=0)
    with pytest.raises(DataError, match=r"data.sources.web.target_ratio is missing"):
        parse_sources({"web": {"paths": "x"}})
    with pytest.raises(DataError, match=r"data.sources.web has no field\(s\) ratio"):
        parse_sources({"web": {"paths": "x", "target_ratio": 1.0, "ratio": 1}})
    with pytest.raises(DataError, match=r"data.sources.web.max_source_fraction=1.5 must be > 0"):
        parse_sources({"web": {"paths": "x", "target_ratio": 1.0, "max_source_fraction": 1.5}})
    with pytest.raises(DataError, match=r"data.sources.web.paths must not be empty"):
        parse_sources({"web": {"paths": [], "target_ratio": 1.0}})
    bad_glob = {"web": {"paths": str(tree / "nope/*.npy"), "target_ratio": 1.0}}
    with pytest.raises(DataError, match=r"data.sources.web.paths\[0\]: the glob .* matches no files"):
        build_data({"sources": bad_glob, "requested_tokens": 64, "vocab_size": VOCAB}, SEQ_LEN, B)
    missing = {"web": {"paths": [str(tree / "web/part-9.npy")], "target_ratio": 1.0}}
    with pytest.raises(DataError, match=r"data.sources.web.paths\[0\]: token file .*part-9.npy does not exist"):
        build_data({"sources": missing, "requested_tokens": 64, "vocab_size": VOCAB}, SEQ_LEN, B)

    cfg = config_lib.default_config()
    cfg.data.paths = str(tree / "web/part-0.npy")
    cfg.data.sources = sources(tree)
    with pytest.raises(ConfigError, match="data.paths is set together with data.sources"):
        config_lib.validate(cfg)
    cfg.data.paths = ""
    cfg.data.sources.web.target_ratio = 0.5  # checked at config time, before any file is read
    with pytest.raises(ConfigError, match=r"data.sources.\*.target_ratio must sum to 1.0, got 0.9"):
        config_lib.validate(cfg)
    cfg.data.sources.web.target_ratio = 0.6
    run = config_lib.validate(cfg)
    assert list(run.data.sources) == ["code", "web"]
