"""`python -m olmo_jax.tokenize` end to end, run as a user would: a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np

from olmo_jax.cli import EXIT_BAD_INPUT
from olmo_jax.data import ByteTokenizer, HFTokenizer, TokenFile, build_data

REPO = Path(__file__).resolve().parents[2]


def tokenize_files(*args: str) -> subprocess.CompletedProcess[str]:
    python_path = [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(python_path)}
    return subprocess.run(
        [sys.executable, "-m", "olmo_jax.tokenize", *args],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )


def write_texts(root: Path) -> dict[str, str]:
    texts = {
        "b.txt": "second file\n" * 50,
        "a.txt": "first file: héllo 日本 🚀\n" * 50,
        "sub/c.txt": "nested\n" * 50,
        "sub/skip.md": "# not matched by *.txt\n",
    }
    for name, text in texts.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text, encoding="utf-8")
    return texts


def test_byte_tokenized_directory(tmp_path: Path):
    texts = write_texts(tmp_path / "texts")
    extra = tmp_path / "extra.md"
    extra.write_text("explicitly named files are always included\n")
    output = tmp_path / "out" / "tokens.npy"
    result = tokenize_files(str(extra), str(tmp_path / "texts"), "-o", str(output))
    assert result.returncode == 0, result.stderr
    tokenizer = ByteTokenizer()
    documents = [extra.read_text(), texts["a.txt"], texts["b.txt"], texts["sub/c.txt"]]
    expected_N = np.concatenate([[*tokenizer.encode(doc), tokenizer.eos_id] for doc in documents])
    tokens_N = np.fromfile(output, dtype=np.uint16)  # headerless uint16
    np.testing.assert_array_equal(tokens_N, expected_N)
    assert f"{len(tokens_N)} tokens (4 documents, uint16)" in result.stdout
    assert str(output) in result.stdout
    data = build_data({"paths": [str(output)], "eval_fraction": 0.0}, 16, 4)
    assert data.train.n_windows == (len(tokens_N) - 1) // 16


def test_hf_tokenizer_and_globs(tmp_path: Path, hf_tokenizer_json: Path):
    texts = write_texts(tmp_path / "texts")
    output = tmp_path / "hf.npy"
    texts_dir = str(tmp_path / "texts")
    tokenizer_arg = ["--tokenizer", str(hf_tokenizer_json)]
    result = tokenize_files(
        texts_dir, "--glob", "*.md", "--glob", "c.txt", "-o", str(output), *tokenizer_arg
    )
    assert result.returncode == 0, result.stderr
    tokenizer = HFTokenizer(hf_tokenizer_json)
    tokens_N = TokenFile(output, "uint16", tokenizer.padded_vocab_size)[:]
    documents = np.split(tokens_N, np.flatnonzero(tokens_N == tokenizer.eos_id) + 1)[:-1]
    assert [tokenizer.decode(doc) for doc in documents] == [
        texts["sub/c.txt"],
        texts["sub/skip.md"],
    ]
    assert "2 documents, uint16" in result.stdout


def test_missing_input_is_reported(tmp_path: Path):
    missing = tmp_path / "nothing-here"
    result = tokenize_files(str(missing), "-o", str(tmp_path / "out.npy"))
    assert result.returncode == EXIT_BAD_INPUT
    assert result.stderr.startswith("error: ") and len(result.stderr.splitlines()) == 1  # no traceback
    assert str(missing) in result.stderr and "does not exist" in result.stderr
    assert not (tmp_path / "out.npy").exists()


def test_no_matching_file_is_reported(tmp_path: Path):
    write_texts(tmp_path / "texts")
    result = tokenize_files(str(tmp_path / "texts"), "--glob", "*.rst", "-o", str(tmp_path / "out.npy"))
    assert result.returncode == EXIT_BAD_INPUT
    assert "no input files match ['*.rst']" in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "out.npy").exists()
