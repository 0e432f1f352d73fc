"""data.sources and data.mix against OLMo-core's own source mixture and mix files
(ai2-olmo-core in .venv-oracle, one subprocess: mixture_oracle.py).

1. Mixtures, on generated token files of several sizes and dtypes: the same tokens per
   source, the same files and token counts in the same order, and so the same instances;
   upsampling (max_repetition_ratio > 1, one and two extra passes), globs (`*` and `**`),
   max_source_fraction; and OLMo-core's errors (a source too small for its ratio, ratios
   not summing to 1, a repetition ratio below 1).
2. Mix files: a mix OLMo-core ships, named, is found in the installed package (located,
   not imported), resolves to the paths and labels of OLMo-core's `DataMix.build`, and
   trains from a generated tree of those files, alone or as the files of data.sources
   picked by label; a tree missing files gets an error naming label, path and line for
   the first five."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import pytest

from olmo_jax.data import build_data, write_token_file
from olmo_jax.data import mix_file as mf
from olmo_jax.data.build import _mixture_files
from olmo_jax.data.loader import TokenWindows
from olmo_jax.data.mixture import parse_sources, select_mixture
from olmo_jax.data.token_file import dtype_for_vocab
from olmo_jax.errors import DataError

ROOT = Path(__file__).resolve().parents[2]
ORACLE_PY = ROOT / ".venv-oracle" / "bin" / "python"
pytestmark = pytest.mark.skipif(not ORACLE_PY.exists(), reason="no .venv-oracle (make oracle)")

SEQ_LEN = 32
MIX = "OLMo-mix-0925-official"
TOKENIZER = "allenai/dolma3-tokenizer"  # what OLMo-core substitutes for dolma2 in this mix
MIX_SEQ_LEN, MIX_VOCAB = 16, 100_278


def _files(folder: Path, lengths: list[int], vocab_size: int, rng) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for k, n in enumerate(lengths):
        tokens = rng.integers(1, vocab_size, n)
        tokens[rng.integers(0, n, n // 40 + 1)] = 0  # EOS: OLMo-core's prepare() wants documents
        tokens[-1] = 0
        write_token_file(folder / f"part-{k:02d}.npy", tokens, dtype_for_vocab(vocab_size))


def _cases(tmp: Path) -> list[dict]:
    """(case spec for the oracle) on generated trees; sources are listed in name order, the
    order data.sources takes them in."""
    rng = np.random.default_rng(0)
    cases = []
    # uint16: globbed web, two code files, a math file too small for its share (upsampled 1.1x).
    _files(tmp / "a/web", [1000, 2345, 777], 50_280, rng)
    _files(tmp / "a/code", [1500, 613], 50_280, rng)
    _files(tmp / "a/math", [900], 50_280, rng)
    sources_a = [
        {"source_name": "code", "paths": [str(tmp / "a/code/part-00.npy"),
                                          str(tmp / "a/code/part-01.npy")],
         "target_ratio": 0.2, "max_repetition_ratio": 1.0, "max_source_fraction": 1.0},
        {"source_name": "math", "paths": [str(tmp / "a/math/*.npy")], "target_ratio": 0.2,
         "max_repetition_ratio": 3.0, "max_source_fraction": 1.0},
        {"source_name": "web", "paths": [str(tmp / "a/web/*.npy")], "target_ratio": 0.6,
         "max_repetition_ratio": 1.0, "max_source_fraction": 1.0},
    ]
    for seed in (42, 7):
        cases.append({"sources": sources_a, "requested_tokens": 5000, "seed": seed,
                      "global_batch_tokens": 4 * SEQ_LEN, "vocab_size": 50_280})
    # uint8: `**` glob over nested folders, a capped source (max_source_fraction 0.5).
    _files(tmp / "b/books/x", [640, 333], 256, rng)
    _files(tmp / "b/books/y/z", [1111], 256, rng)
    _files(tmp / "b/wiki", [4096, 101], 256, rng)
    cases.append({"sources": [
        {"source_name": "books", "paths": [str(tmp / "b/books/**/*.npy")], "target_ratio": 0.3,
         "max_repetition_ratio": 1.0, "max_source_fraction": 1.0},
        {"source_name": "wiki", "paths": [str(tmp / "b/wiki/*.npy")], "target_ratio": 0.7,
         "max_repetition_ratio": 1.0, "max_source_fraction": 0.5},
    ], "requested_tokens": 2900, "seed": 1, "global_batch_tokens": 2 * SEQ_LEN,
        "vocab_size": 256})
    # uint32: a source taken 2.6 times (three passes), requested tokens off the batch grid.
    _files(tmp / "c/small", [300, 257], 100_278, rng)
    _files(tmp / "c/big", [5000], 100_278, rng)
    cases.append({"sources": [
        {"source_name": "big", "paths": [str(tmp / "c/big/part-00.npy")], "target_ratio": 0.65,
         "max_repetition_ratio": 1.0, "max_source_fraction": 1.0},
        {"source_name": "small", "paths": [str(tmp / "c/small/*.npy")], "target_ratio": 0.35,
         "max_repetition_ratio": 3.0, "max_source_fraction": 1.0},
    ], "requested_tokens": 4123, "seed": 3, "global_batch_tokens": 8 * SEQ_LEN,
        "vocab_size": 100_278})
    # Errors: math allows 2700 tokens but 0.5 of 6000 asks 3000; ratios summing to 0.9;
    # a repetition ratio below 1.
    cases.append({**cases[0], "requested_tokens": 6000, "sources": [
        {**sources_a[0], "target_ratio": 0.3}, {**sources_a[1], "target_ratio": 0.5},
        {**sources_a[2], "target_ratio": 0.2}]})
    cases.append({**cases[0], "sources": [sources_a[0], sources_a[1],
                                          {**sources_a[2], "target_ratio": 0.5}]})
    cases.append({**cases[0], "sources": [sources_a[0], {**sources_a[1],
                                                         "max_repetition_ratio": 0.5},
                                          sources_a[2]]})
    for i, case in enumerate(cases):
        case.update(seq_len=SEQ_LEN, work_dir=str(tmp / f"work-{i}"))
    return cases


def _ours(case: dict):
    spec = {s["source_name"]: {k: s[k] for k in ("paths", "target_ratio", "max_repetition_ratio",
                                                 "max_source_fraction")}
            for s in case["sources"]}
    dtype = dtype_for_vocab(case["vocab_size"])
    mixture = select_mixture(parse_sources(spec), case["requested_tokens"],
                             case["global_batch_tokens"], case["seq_len"], dtype.itemsize)
    return mixture, dtype


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("mixture")
    cases = _cases(tmp)
    mix = {"name": MIX, "base_dir": str(tmp / "root"), "tokenizer": "allenai/dolma2-tokenizer"}
    (tmp / "spec.json").write_text(json.dumps({"cases": cases, "mix": mix}))
    subprocess.run([str(ORACLE_PY), str(Path(__file__).with_name("mixture_oracle.py")),
                    str(tmp / "spec.json"), str(tmp / "out.json")], check=True, cwd=tmp,
                   timeout=600)
    out = json.loads((tmp / "out.json").read_text())
    return cases, out["cases"], out["mix"], tmp / "root"


@pytest.mark.parametrize("k", [0, 1, 2, 3])
def test_selection_and_instances_match_olmo_core(outcomes, k):
    cases, wants, *_ = outcomes
    case, want = cases[k], wants[k]
    assert "error" not in want, want
    mixture, dtype = _ours(case)
    assert dtype.name == want["dtype"]
    assert [list(e) for e in mixture.entries()] == want["entries"]
    assert [{"source_name": s.source.name, "population": s.population,
             "num_selected": s.num_selected} for s in mixture.sources] == want["details"]
    assert {s.source.name: s.tokens for s in mixture.sources} == want["outcome_tokens"]
    # The instances, in OLMo-core's dataset order, token for token.
    files = _mixture_files(mixture, dtype, case["vocab_size"], "olmo_core")
    windows = TokenWindows(files, SEQ_LEN)
    rows_NL = windows.read(np.arange(len(windows)))
    np.testing.assert_array_equal(rows_NL[:, :-1], np.array(want["input_ids"]))
    # Exactly the batches ceil(requested / batch) asks for.
    steps = -(-case["requested_tokens"] // case["global_batch_tokens"])
    assert len(windows) * SEQ_LEN == steps * case["global_batch_tokens"]


def test_upsampling_repeats_files(outcomes):
    cases, *_ = outcomes
    mixture, _ = _ours(cases[0])
    math = next(s for s in mixture.sources if s.source.name == "math")
    assert len(math.path_tokens) == 2 and math.tokens > math.population  # a second pass
    small, _ = _ours(cases[3])
    small_src = next(s for s in small.sources if s.source.name == "small")
    assert len(small_src.path_tokens) == 6  # 2 files x 3 passes (take ratio 2.6)


def test_errors_match_olmo_core(outcomes):
    cases, wants, *_ = outcomes
    assert wants[4]["error"].startswith("OLMoConfigurationError: Insufficient tokens for source: math")
    with pytest.raises(DataError) as e:
        _ours(cases[4])
    assert str(e.value).startswith(wants[4]["error"].split(": ", 1)[1])
    assert "data.sources.math" in str(e.value)
    assert "target_ratios must sum to 1.0" in wants[5]["error"]
    with pytest.raises(DataError, match=r"data.sources.\*.target_ratio must sum to 1.0"):
        _ours(cases[5])
    assert "max_repetition_ratio must be >= 1" in wants[6]["error"]
    with pytest.raises(DataError, match=r"data.sources.math.max_repetition_ratio=0.5 must be >= 1"):
        _ours(cases[6])


@pytest.fixture(scope="module")
def shipped(outcomes):
    """(OLMo-core's build of MIX against a generated root, the root): every file of the mix
    made, 2 * MIX_SEQ_LEN + 3 tokens each."""
    *_, want, root = outcomes
    rng = np.random.default_rng(0)
    for path in want["paths"]:
        write_token_file(path, rng.integers(0, MIX_VOCAB, 2 * MIX_SEQ_LEN + 3), np.uint32)
    return want, root


def _data(mix: str, root: Path, **extra):
    cfg = {"mix": mix, "mix_root": str(root), "mix_tokenizer": TOKENIZER,
           "vocab_size": MIX_VOCAB, **extra}
    return build_data(cfg, MIX_SEQ_LEN, global_batch_size=4, seed=0)


def test_shipped_mix_by_name_matches_olmo_core(shipped, monkeypatch):
    want, root = shipped
    assert mf.shipped_mix_dir() is None  # this venv has no ai2-olmo-core
    with pytest.raises(DataError, match="ai2-olmo-core is not installed"):
        mf.find_mix(MIX)
    site = Path(want["mixes_dir"]).parents[2]  # .../site-packages of the oracle venv
    monkeypatch.syspath_prepend(str(site))
    assert mf.shipped_mix_dir() == Path(want["mixes_dir"])
    assert MIX in mf.shipped_mixes()
    lines = mf.read_mix(MIX, str(root), TOKENIZER)
    assert [m.path for m in lines] == want["paths"]
    assert [m.label for m in lines] == want["labels"]
    with pytest.raises(DataError, match="neither a file nor a mix OLMo-core ships.*OLMo-mix-0625"):
        mf.find_mix("OLMo-mix-9999")

    data = _data(MIX, root)  # by name, through build_data
    assert len(data.windows) == 2 * len(want["paths"])
    assert data.mixture is None
    np.testing.assert_array_equal(data.windows.window(2)[:MIX_SEQ_LEN],
                                  np.fromfile(want["paths"][1], np.uint32)[:MIX_SEQ_LEN])


def test_mix_file_path_with_sources_by_label(shipped):
    want, root = shipped
    mix = str(Path(want["mixes_dir"]) / f"{MIX}.txt")  # a path: no package lookup needed
    sources = {"arxiv": {"target_ratio": 0.25},
               "stack-edu_Python": {"target_ratio": 0.75, "max_repetition_ratio": 2.0}}
    data = _data(mix, root, sources=sources, requested_tokens=20 * MIX_SEQ_LEN)
    by_name = {s.source.name: s for s in data.mixture.sources}
    for label in sources:
        files = [p for p, lab in zip(want["paths"], want["labels"], strict=True) if lab == label]
        assert sorted({p.path for p in by_name[label].path_tokens}) == sorted(files)
    assert data.mixture.total_tokens == 20 * MIX_SEQ_LEN == len(data.windows) * MIX_SEQ_LEN
    with pytest.raises(DataError, match="data.sources.wiki has no paths and data.mix=.* has no "
                                        "label 'wiki'; its labels are arxiv, common_crawl"):
        _data(mix, root, sources={"wiki": {"target_ratio": 1.0}}, requested_tokens=64)


def test_missing_mix_files_name_label_path_and_line(shipped, tmp_path):
    want, root = shipped
    mix = tmp_path / "small.txt"
    text = Path(want["mixes_dir"], f"{MIX}.txt").read_text().splitlines()[:12]
    mix.write_text("\n".join(text) + "\n")
    lines = mf.read_mix(str(mix), str(tmp_path / "elsewhere"), TOKENIZER)
    with pytest.raises(DataError) as e:
        _data(str(mix), tmp_path / "elsewhere")
    msg = str(e.value)
    assert f"{len(lines)} of its {len(lines)} token files do not exist" in msg
    first = lines[0]
    assert f"label {first.label!r}: {first.path} (line {first.line}: {first.text.strip()})" in msg
    assert msg.count("  label ") == 5 and f"and {len(lines) - 5} more" in msg
    with pytest.raises(DataError, match="set data.mix_tokenizer"):
        mf.read_mix(str(mix), str(root), "")
    with pytest.raises(DataError, match="set data.mix_root"):
        mf.read_mix(str(mix), "", TOKENIZER)
