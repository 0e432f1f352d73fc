"""OLMo-core token files: dtype choice, memory-mapped reads, and the errors for bad files."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from olmo_jax.data import DataError, TokenFile, dtype_for_vocab, write_token_file
from olmo_jax.data import token_file as token_file_module


def test_dtype_for_vocab():
    assert dtype_for_vocab(256) == np.uint8  # OLMo-core: the smallest uint holding vocab - 1
    assert dtype_for_vocab(257) == np.uint16
    assert dtype_for_vocab(384) == np.uint16
    assert dtype_for_vocab(65_536) == np.uint16
    assert dtype_for_vocab(65_537) == np.uint32
    assert dtype_for_vocab(100_352) == np.uint32
    with pytest.raises(DataError):
        dtype_for_vocab(0)


def test_uint8_files_are_read(tmp_path: Path):
    path = tmp_path / "bytes.npy"
    assert write_token_file(path, np.arange(256), "uint8") == 256
    assert path.stat().st_size == 256
    np.testing.assert_array_equal(TokenFile(path, "uint8", vocab_size=256)[250:256], np.arange(250, 256))
    with pytest.raises(DataError, match="does not fit uint8"):
        write_token_file(path, [256], "uint8")


def test_round_trip_uint16_is_headerless(tmp_path: Path):
    tokens = np.arange(1000) % 384
    path = tmp_path / "part-0.npy"
    assert write_token_file(path, tokens, "uint16") == 1000
    assert path.stat().st_size == 2000  # no NumPy header
    file = TokenFile(path, "uint16", vocab_size=384)
    assert len(file) == 1000
    window = file[10:20]
    assert window.dtype == np.int32
    np.testing.assert_array_equal(window, tokens[10:20])
    np.testing.assert_array_equal(file[990:2000], tokens[990:])  # clipped like a slice
    assert not file.tokens.flags.writeable


def test_round_trip_uint32_with_large_ids(tmp_path: Path):
    tokens = np.array([0, 70_000, 100_351, 5], dtype=np.int64)
    path = tmp_path / "big.npy"
    write_token_file(path, tokens, np.uint32)
    file = TokenFile(path, np.uint32, vocab_size=100_352)
    np.testing.assert_array_equal(file[0:4], tokens)


def test_write_accepts_chunks_and_leaves_no_temp_files(tmp_path: Path):
    path = tmp_path / "sub" / "chunks.npy"
    n = write_token_file(path, (np.arange(k, dtype=np.int32) for k in (3, 0, 4)), "uint16")
    assert n == 7
    np.testing.assert_array_equal(np.fromfile(path, np.uint16), [0, 1, 2, 0, 1, 2, 3])
    assert [p.name for p in path.parent.iterdir()] == ["chunks.npy"]


def test_write_rejects_ids_that_do_not_fit(tmp_path: Path):
    path = tmp_path / "x.npy"
    with pytest.raises(DataError, match="use a wider token dtype"):
        write_token_file(path, np.array([1, 70_000]), "uint16")
    assert list(tmp_path.iterdir()) == []  # neither the file nor a temp file


def test_unsupported_dtype(tmp_path: Path):
    with pytest.raises(DataError, match="'uint8', 'uint16', 'uint32'"):
        TokenFile(tmp_path / "x.npy", "int8", vocab_size=10)


def test_missing_file_names_path_and_tool(tmp_path: Path):
    path = tmp_path / "missing.npy"
    with pytest.raises(DataError) as error:
        TokenFile(path, "uint16", vocab_size=384)
    assert str(path) in str(error.value) and "python -m olmo_jax.tokenize" in str(error.value)


def test_empty_file(tmp_path: Path):
    path = tmp_path / "empty.npy"
    path.touch()
    with pytest.raises(DataError, match="is empty"):
        TokenFile(path, "uint16", vocab_size=384)


def test_odd_size_suggests_the_other_dtype(tmp_path: Path):
    path = tmp_path / "six_bytes.npy"
    path.write_bytes(bytes(6))
    with pytest.raises(DataError) as error:
        TokenFile(path, "uint32", vocab_size=100_352)
    message = str(error.value)
    assert str(path) in message and "6 bytes" in message and "uint32" in message
    assert "data.dtype='uint16'" in message

    path.write_bytes(bytes(3))
    with pytest.raises(DataError, match="3 bytes.*uint16.*truncated"):
        TokenFile(path, "uint16", vocab_size=384)


def test_out_of_vocab_token_checked_on_open(tmp_path: Path):
    tokens = np.zeros(100, dtype=np.int64)
    tokens[37] = 500
    path = tmp_path / "oov.npy"
    write_token_file(path, tokens, "uint16")
    with pytest.raises(DataError) as error:
        TokenFile(path, "uint16", vocab_size=384)
    message = str(error.value)
    assert str(path) in message and "offset 37" in message
    assert "token 500" in message and "vocab_size 384" in message


def test_out_of_vocab_token_checked_on_read_of_large_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setattr(token_file_module, "FULL_CHECK_BYTES", 0)  # treat the file as large
    tokens = np.zeros(100, dtype=np.int64)
    tokens[73] = 1000
    path = tmp_path / "oov.npy"
    write_token_file(path, tokens, "uint16")
    file = TokenFile(path, "uint16", vocab_size=384)  # opens without a full scan
    np.testing.assert_array_equal(file[0:73], 0)
    with pytest.raises(DataError, match="token 1000 at offset 73 is >= vocab_size 384"):
        file[70:80]
