"""data.mix against OLMo-core's own mix files (ai2-olmo-core in .venv-oracle): a mix it
ships, named, is found in the installed package (located, not imported), resolves to the
paths and labels of OLMo-core's `DataMix.build`, and trains from a generated tree of those
files, alone or as the files of data.sources picked by label; a tree missing files gets an
error naming label, path and line for the first five."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import pytest

from olmo_jax.data import build_data, write_token_file
from olmo_jax.data import mix_file as mf
from olmo_jax.errors import DataError

ROOT = Path(__file__).resolve().parents[2]
ORACLE_PY = ROOT / ".venv-oracle" / "bin" / "python"
pytestmark = pytest.mark.skipif(not ORACLE_PY.exists(), reason="no .venv-oracle (make oracle)")

MIX = "OLMo-mix-0925-official"
TOKENIZER = "allenai/dolma3-tokenizer"  # what OLMo-core substitutes for dolma2 in this mix
SEQ_LEN, VOCAB = 16, 100_278


@pytest.fixture(scope="module")
def shipped(tmp_path_factory):
    """(OLMo-core's build of MIX against a generated root, the root): every file of the mix
    made, 2 * SEQ_LEN + 3 tokens each."""
    tmp = tmp_path_factory.mktemp("mix")
    root = tmp / "root"
    out = tmp / "oracle.json"
    subprocess.run([str(ORACLE_PY), str(Path(__file__).with_name("mix_oracle.py")), MIX,
                    str(root), "allenai/dolma2-tokenizer", str(out)], check=True, timeout=300)
    want = json.loads(out.read_text())
    rng = np.random.default_rng(0)
    for path in want["paths"]:
        write_token_file(path, rng.integers(0, VOCAB, 2 * SEQ_LEN + 3), np.uint32)
    return want, root


def _data(mix: str, root: Path, **extra):
    cfg = {"mix": mix, "mix_root": str(root), "mix_tokenizer": TOKENIZER,
           "vocab_size": VOCAB, **extra}
    return build_data(cfg, SEQ_LEN, global_batch_size=4, seed=0)


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
    np.testing.assert_array_equal(data.windows.window(2)[:SEQ_LEN],
                                  np.fromfile(want["paths"][1], np.uint32)[:SEQ_LEN])


def test_mix_file_path_with_sources_by_label(shipped):
    want, root = shipped
    mix = str(Path(want["mixes_dir"]) / f"{MIX}.txt")  # a path: no package lookup needed
    sources = {"arxiv": {"target_ratio": 0.25},
               "stack-edu_Python": {"target_ratio": 0.75, "max_repetition_ratio": 2.0}}
    data = _data(mix, root, sources=sources, requested_tokens=20 * SEQ_LEN)
    by_name = {s.source.name: s for s in data.mixture.sources}
    for label in sources:
        files = [p for p, lab in zip(want["paths"], want["labels"], strict=True) if lab == label]
        assert sorted({p.path for p in by_name[label].path_tokens}) == sorted(files)
    assert data.mixture.total_tokens == 20 * SEQ_LEN == len(data.windows) * SEQ_LEN
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
