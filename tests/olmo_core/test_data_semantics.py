"""olmo_jax's data against OLMo-core's own (ai2-olmo-core in .venv-oracle, by subprocess):
the same token files give the same instances, the same labels and the same loss
denominator, for uint8 / uint16 / uint32 files, with and without the repetition filter."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from olmo_jax.data import TokenFile, TokenWindows, dtype_for_vocab, write_token_file
from olmo_jax.data.repetition import RepetitionFilter
from olmo_jax.labels import NO_LABEL
from olmo_jax.objective import labelled

ROOT = Path(__file__).resolve().parents[2]
ORACLE_PY = ROOT / ".venv-oracle" / "bin" / "python"
pytestmark = pytest.mark.skipif(not ORACLE_PY.exists(), reason="no .venv-oracle (make oracle)")

SEQ_LEN = 32


def corpus(rng: np.random.Generator, vocab_size: int, n_tokens: int) -> np.ndarray:
    """Random ids with repetitive stretches of several periods and lengths spliced in."""
    tokens = rng.integers(0, vocab_size, n_tokens)
    for start in range(0, n_tokens - 80, 97):
        period, times = int(rng.integers(1, 9)), int(rng.integers(3, 40))
        stretch = np.tile(rng.integers(0, vocab_size, period), times)[: n_tokens - start]
        tokens[start : start + len(stretch)] = stretch
    return tokens


VOCABS = (256, 50_280, 100_278)  # uint8, uint16, uint32
CASES = [(vocab_size, filtered) for filtered in (False, True) for vocab_size in VOCABS]


def case_name(vocab_size: int, filtered: bool) -> str:
    return f"v{vocab_size}-{'filtered' if filtered else 'all'}"


def case_files(folder: Path, vocab_size: int, filtered: bool) -> list[str]:
    """The case's token files: one of exactly 3 * seq_len tokens (OLMo-core: 3 instances),
    ragged ones, a short one."""
    rng = np.random.default_rng(vocab_size + filtered)
    dtype = dtype_for_vocab(vocab_size)
    lengths = [3 * SEQ_LEN, 5 * SEQ_LEN + 7, SEQ_LEN - 1, 40 * SEQ_LEN + 31]
    folder.mkdir(parents=True)
    paths = []
    for k, n in enumerate(lengths):
        paths.append(str(folder / f"part-{k}.npy"))
        write_token_file(paths[-1], corpus(rng, vocab_size, n), dtype)
    return paths


def rule_of(filtered: bool) -> RepetitionFilter | None:
    return RepetitionFilter(max_count=8) if filtered else None


@pytest.fixture(scope="module")
def oracle(tmp_path_factory) -> dict:
    """{case: (its token files, OLMo-core's arrays)}: every case through one oracle process."""
    root = tmp_path_factory.mktemp("data_oracle")
    files, specs = {}, {}
    for vocab_size, filtered in CASES:
        name = case_name(vocab_size, filtered)
        files[name] = case_files(root / name, vocab_size, filtered)
        rule = rule_of(filtered)
        specs[name] = {
            "paths": files[name], "vocab_size": vocab_size, "seq_len": SEQ_LEN,
            "work_dir": str(root / name),
            "filter": None if rule is None else {"repetition_max_period": rule.max_period,
                                                 "repetition_min_period": rule.min_period,
                                                 "repetition_max_count": rule.max_count}}
    (root / "specs.json").write_text(json.dumps(specs))
    subprocess.run([str(ORACLE_PY), str(Path(__file__).with_name("data_oracle.py")),
                    str(root / "specs.json"), str(root)], check=True, cwd=root, timeout=300)
    return {name: (files[name], np.load(root / f"{name}.npz")) for name in specs}


@pytest.mark.parametrize("vocab_size,filtered", CASES, ids=[case_name(*c) for c in CASES])
def test_instances_labels_and_denominator_match_olmo_core(oracle, vocab_size, filtered):
    dtype = dtype_for_vocab(vocab_size)
    paths, want = oracle[case_name(vocab_size, filtered)]
    rule = rule_of(filtered)
    assert str(want["dtype"]) == dtype.name

    windows = TokenWindows([TokenFile(p, dtype, vocab_size) for p in paths], SEQ_LEN,
                           repetition_filter=rule)
    rows_NL = windows.read(np.arange(len(windows)))
    np.testing.assert_array_equal(rows_NL[:, :-1], want["input_ids"])
    loss_NT, counted_NT = (np.asarray(m) for m in labelled(jnp.asarray(rows_NL[:, 1:])))
    labels_NT = np.where(loss_NT, rows_NL[:, 1:], NO_LABEL)
    np.testing.assert_array_equal(labels_NT, want["labels"])
    np.testing.assert_array_equal(rows_NL[:, -1] == NO_LABEL, want["instance_mask"])
    assert int(counted_NT.sum()) == int(want["denominator"])
    if filtered:  # the corpus's stretches make the filter fire, but not everywhere
        assert 0 < (~want["instance_mask"]).sum() < len(windows)
