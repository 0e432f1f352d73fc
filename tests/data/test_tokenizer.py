"""Byte and Hugging Face tokenizers, and load_tokenizer's choice between them."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from olmo_jax.data import ByteTokenizer, DataError, HFTokenizer, load_tokenizer, pad_vocab

TEXT = "plain ascii, héllo wörld, naïve café — 日本語のテキスト 🚀\n\ttabs"


def test_byte_tokenizer_constants():
    tokenizer = ByteTokenizer()
    assert (tokenizer.eos_id, tokenizer.pad_id, tokenizer.vocab_size) == (256, 257, 258)
    assert tokenizer.padded_vocab_size == 384
    assert pad_vocab(258) == 384 and pad_vocab(384) == 384 and pad_vocab(100_278) == 100_352


def test_byte_tokenizer_round_trip_non_ascii():
    tokenizer = ByteTokenizer()
    ids = tokenizer.encode(TEXT)
    assert ids.dtype == np.int32
    np.testing.assert_array_equal(ids, list(TEXT.encode("utf-8")))
    assert tokenizer.decode(ids) == TEXT
    assert tokenizer.decode(ids.tolist()) == TEXT


def test_byte_tokenizer_decode_skips_specials_and_replaces_bad_utf8():
    tokenizer = ByteTokenizer()
    ids = np.concatenate([tokenizer.encode("ab"), [256, 257, 300], tokenizer.encode("c")])
    assert tokenizer.decode(ids) == "abc"
    assert tokenizer.decode([0xFF, ord("x")]) == "\ufffdx"


def test_hf_tokenizer_round_trip_and_specials(hf_tokenizer_json: Path):
    tokenizer = HFTokenizer(hf_tokenizer_json)
    assert tokenizer.eos_id == 0 and tokenizer.pad_id == 1
    assert tokenizer.vocab_size == 300
    assert tokenizer.padded_vocab_size == 384
    ids = tokenizer.encode(TEXT)
    assert ids.dtype == np.int32 and ids.max() < tokenizer.vocab_size
    assert tokenizer.decode(ids) == TEXT
    assert len(tokenizer.encode("the quick brown fox")) < len("the quick brown fox")  # merges
    # EOS and ids in the padding region are skipped.
    assert tokenizer.decode(np.concatenate([ids, [tokenizer.eos_id, 350]])) == TEXT


def test_hf_tokenizer_eos_names_and_explicit_eos(tmp_path: Path, make_hf_tokenizer):
    path = make_hf_tokenizer(tmp_path / "s" / "tokenizer.json", ["<unk>", "</s>"])
    assert HFTokenizer(path).eos_id == 1
    assert HFTokenizer(path).pad_id == 1  # no pad token: falls back to EOS
    assert HFTokenizer(path, eos_id=0).eos_id == 0
    with pytest.raises(DataError, match="outside the vocabulary"):
        HFTokenizer(path, eos_id=10_000)


def test_hf_tokenizer_without_eos_names_the_fix(tmp_path: Path, make_hf_tokenizer):
    path = make_hf_tokenizer(tmp_path / "tokenizer.json", ["<sep>"])
    with pytest.raises(DataError, match="eos_id=") as error:
        HFTokenizer(path)
    assert str(path) in str(error.value)


def test_hf_tokenizer_missing_package_names_the_extra(
    hf_tokenizer_json: Path, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # makes `import tokenizers` fail
    with pytest.raises(DataError, match=r"pip install 'olmo-jax\[hf\]'"):
        HFTokenizer(hf_tokenizer_json)


def test_hf_tokenizer_malformed_file(tmp_path: Path):
    path = tmp_path / "tokenizer.json"
    path.write_text("{not json")
    with pytest.raises(DataError, match="not a readable"):
        HFTokenizer(path)


def test_load_tokenizer_specs(hf_tokenizer_json: Path, tmp_path: Path):
    assert isinstance(load_tokenizer(""), ByteTokenizer)
    assert isinstance(load_tokenizer("bytes"), ByteTokenizer)
    assert isinstance(load_tokenizer(str(hf_tokenizer_json)), HFTokenizer)
    from_dir = load_tokenizer(str(hf_tokenizer_json.parent))
    assert isinstance(from_dir, HFTokenizer) and from_dir.path == hf_tokenizer_json
    missing = tmp_path / "nowhere" / "tokenizer.json"
    with pytest.raises(DataError, match="does not exist") as error:
        load_tokenizer(str(missing))
    assert str(missing) in str(error.value) and "'bytes'" in str(error.value)
