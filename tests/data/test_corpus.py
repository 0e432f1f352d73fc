"""The embedded stdlib corpus: deterministic, cached, race-safe, big enough to train on."""

from __future__ import annotations

import platform
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from olmo_jax.data import ByteTokenizer, TokenFile, build_data, stdlib_corpus
from olmo_jax.data.corpus import stdlib_root, stdlib_sources


@pytest.fixture(scope="module")
def corpus_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return stdlib_corpus(tmp_path_factory.mktemp("corpus_cache"))


def test_corpus_is_big_byte_tokenized_stdlib(corpus_path: Path):
    assert f"py{platform.python_version()}" in corpus_path.name
    corpus = TokenFile(corpus_path, "uint16", vocab_size=ByteTokenizer.vocab_size)
    assert len(corpus) > 5_000_000
    tokens_N = corpus.tokens
    sources = stdlib_sources(stdlib_root())
    assert sources == sorted(sources)
    assert not any({"site-packages", "dist-packages"} & set(source.parts) for source in sources)
    assert int(np.count_nonzero(tokens_N == ByteTokenizer.eos_id)) == len(sources)
    assert tokens_N[-1] == ByteTokenizer.eos_id
    first_document = sources[0].read_bytes()
    assert tokens_N[: len(first_document)].astype(np.uint8).tobytes() == first_document


def test_corpus_build_is_deterministic_and_race_safe(corpus_path: Path, tmp_path: Path):
    with ThreadPoolExecutor(2) as pool:  # two builders racing on one cache folder
        raced = list(pool.map(stdlib_corpus, [tmp_path, tmp_path]))
    assert raced[0] == raced[1] and raced[0].name == corpus_path.name
    assert [p.name for p in tmp_path.iterdir()] == [corpus_path.name]  # no temp files left
    assert raced[0].read_bytes() == corpus_path.read_bytes()


def test_corpus_cache_hit_does_not_rewrite(corpus_path: Path):
    modified_ns = corpus_path.stat().st_mtime_ns
    assert stdlib_corpus(corpus_path.parent) == corpus_path
    assert corpus_path.stat().st_mtime_ns == modified_ns


def test_build_data_defaults_to_the_corpus(corpus_path: Path):
    data = build_data({}, seq_len=512, global_batch_size=16, seed=0, cache_dir=corpus_path.parent)
    assert isinstance(data.tokenizer, ByteTokenizer) and data.vocab_size == 384
    assert data.windows.files[0].path == corpus_path
    assert data.eval is None  # data.eval_fraction defaults to 0: no silent hold-out
    batch_BX = data.train.batch(0)
    assert batch_BX.shape == (16, 513) and batch_BX.max() <= ByteTokenizer.eos_id
    assert "def " in data.tokenizer.decode(data.train.batch(1).ravel())
